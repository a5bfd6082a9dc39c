"""nanokl.engine.fused.chunked_log_probs: the trainer's log-probs and entropy without the [tokens, V] logits.

What is proven and how. The reference is today's path written out: F.linear (the LM head), at least
fp32, over the temperature, then ppo.logprobs_from_logits and ppo.entropy_from_logits.
- Values and gradients equal it: float64 to 1e-10 with a chunk (3) that does not divide the 14 rows,
  for a loss that mixes both outputs with random weights (so both incoming gradients are generic),
  plus torch.autograd.gradcheck of the hand-written backward; float32 to 1e-5 at a larger shape.
  Without entropy the second output is None and the log-prob gradient is still right; a loss on the
  entropy alone (log-prob's gradient None) is right too.
- Memory: a TorchDispatchMode records the element count of every op's output, in the forward and
  in the backward separately. The chunked path never makes a tensor above chunk x V elements; the
  plain path makes N x V in both, which shows the mode sees what it must (the test can fail).
- The meta device runs the forward and the backward with the right shapes (a benchmark relies on it),
  so nothing in it reads data.
- CPU bf16 autocast: fp32 outputs, values and gradients close to the plain path under the same
  autocast. Loose tolerances there: both paths round the head's matmul to bf16 (eps 2^-8), and the
  weight gradient is one bf16 matmul in the plain path but a fp32 sum of per-chunk bf16 products here.
- Edge cases: chunk 1, chunk = N, chunk > N, chunk None; temperatures below and above 1.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nanokl import ppo
from nanokl.engine.fused import chunked_log_probs


def plain(hidden, weight, labels, temperature):
    """Today's path (forwards.response_logits + ppo): full logits, at least fp32, over the temperature."""
    z = F.linear(hidden, weight)
    z = z.to(torch.promote_types(z.dtype, torch.float32)) / temperature
    return ppo.logprobs_from_logits(z, labels), ppo.entropy_from_logits(z)


def inputs(shape, H, V, dtype, scale=1.0):
    hidden = torch.randn(*shape, H, dtype=dtype).requires_grad_()
    weight = (scale * torch.randn(V, H, dtype=dtype)).requires_grad_()
    return hidden, weight, torch.randint(0, V, shape)


def grads(outputs, a, b, hidden, weight):
    """d/d(hidden, weight) of (a lp).sum() + (b ent).sum(), the entropy term left out when it is None."""
    lp, ent = outputs
    loss = (a * lp).sum() + (0 if ent is None else (b * ent).sum())
    return torch.autograd.grad(loss, (hidden, weight))


def check_against_plain(shape, H, V, dtype, temperature, chunk, tol, scale=1.0):
    hidden, weight, labels = inputs(shape, H, V, dtype, scale)
    a, b = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    got = chunked_log_probs(hidden, weight, labels, temperature, chunk)
    want = plain(hidden, weight, labels, temperature)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == shape
        torch.testing.assert_close(g, w, rtol=0, atol=tol)
    for g, w in zip(grads(got, a, b, hidden, weight), grads(want, a, b, hidden, weight)):
        torch.testing.assert_close(g, w, rtol=0, atol=tol)


def test_float64_equals_plain_path():
    check_against_plain((2, 7), H=16, V=50, dtype=torch.float64, temperature=0.7, chunk=3, tol=1e-10)


def test_gradcheck_float64():
    hidden, weight, labels = inputs((5,), H=4, V=7, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda h, w: chunked_log_probs(h, w, labels, 0.7, chunk=2), (hidden, weight))
    assert torch.autograd.gradcheck(lambda h, w: chunked_log_probs(h, w, labels, 1.3, chunk=2, with_entropy=False)[0],
                                    (hidden, weight))


def test_float32_equals_plain_path():
    check_against_plain((64,), H=32, V=1000, dtype=torch.float32, temperature=0.7, chunk=16, tol=1e-5, scale=0.2)


def test_without_entropy_returns_none_and_the_same_log_probs():
    hidden, weight, labels = inputs((3, 5), H=8, V=40, dtype=torch.float64)
    a = torch.randn(3, 5, dtype=torch.float64)
    lp, ent = chunked_log_probs(hidden, weight, labels, 0.9, chunk=4, with_entropy=False)
    assert ent is None
    want = plain(hidden, weight, labels, 0.9)
    torch.testing.assert_close(lp, want[0], rtol=0, atol=1e-10)
    for g, w in zip(grads((lp, None), a, None, hidden, weight), grads((want[0], None), a, None, hidden, weight)):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


def test_gradient_through_entropy_alone():
    """The log-prob output unused: its incoming gradient is None and only the entropy terms remain."""
    hidden, weight, labels = inputs((9,), H=8, V=30, dtype=torch.float64)
    b = torch.randn(9, dtype=torch.float64)
    got = torch.autograd.grad((b * chunked_log_probs(hidden, weight, labels, 0.8, chunk=4)[1]).sum(), (hidden, weight))
    want = torch.autograd.grad((b * plain(hidden, weight, labels, 0.8)[1]).sum(), (hidden, weight))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


class LargestOutput(TorchDispatchMode):
    """Records the largest element count of any tensor an op returns while the mode is on."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        self.ops += 1
        return out


def largest_tensors(fn, hidden, weight, labels):
    """(largest output of the forward, largest output of the backward) of fn's log-probs and entropy."""
    with LargestOutput() as fwd:
        lp, ent = fn(hidden, weight, labels)
        loss = lp.sum() + ent.sum()
    with LargestOutput() as bwd:
        loss.backward()
    assert fwd.ops and bwd.ops, "the mode saw no ops"
    return fwd.largest, bwd.largest


def test_no_tensor_above_chunk_times_vocab():
    N, H, V, chunk = 256, 16, 1000, 32  # H <= chunk: the [V, H] weight gradient stays under chunk x V
    hidden, weight, labels = inputs((N,), H, V, dtype=torch.float32)
    fwd, bwd = largest_tensors(lambda h, w, y: chunked_log_probs(h, w, y, 0.7, chunk), hidden, weight, labels)
    assert fwd <= chunk * V and bwd <= chunk * V, (fwd, bwd)
    assert weight.grad.shape == (V, H) and hidden.grad.shape == (N, H)
    fwd, bwd = largest_tensors(lambda h, w, y: plain(h, w, y, 0.7), hidden, weight, labels)
    assert fwd >= N * V and bwd >= N * V, (fwd, bwd)  # the plain path does make the full logits


def test_meta_device_forward_and_backward():
    N, H, V = 4096, 64, 151_936
    hidden = torch.empty(2, N // 2, H, device="meta", requires_grad=True)
    weight = torch.empty(V, H, device="meta", requires_grad=True)
    labels = torch.empty(2, N // 2, dtype=torch.long, device="meta")
    lp, ent = chunked_log_probs(hidden, weight, labels, 0.7, chunk=1000)
    assert lp.shape == ent.shape == (2, N // 2) and lp.dtype == ent.dtype == torch.float32
    (lp.sum() + ent.sum()).backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape
    assert hidden.grad.device.type == weight.grad.device.type == "meta"


def test_cpu_bf16_autocast_close_to_plain_path():
    shape, H, V, T = (4, 12), 32, 300, 0.7
    hidden, weight, labels = inputs(shape, H, V, dtype=torch.float32, scale=0.3)
    a, b = torch.randn(shape), torch.randn(shape)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunked_log_probs(hidden, weight, labels, T, chunk=5)
        want = plain(hidden, weight, labels, T)
        got_grads, want_grads = grads(got, a, b, hidden, weight), grads(want, a, b, hidden, weight)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=0, atol=1e-2)  # the same bf16 logits (equal here, in fact)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == torch.float32
        # bf16 eps is 2^-8; the weight gradient differs by ~0.3% of its largest entry (see the top)
        torch.testing.assert_close(g, w, rtol=0, atol=1e-2 * w.abs().max().item())
    # and bf16 really was used: the fp32 path differs from both by more than float error
    lp32 = chunked_log_probs(hidden, weight, labels, T, chunk=5)[0]
    assert (lp32 - got[0]).abs().max() > 1e-4


@pytest.mark.parametrize("chunk", [1, 12, 13, 1000, None])
@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_chunk_and_temperature_edges(chunk, temperature):
    check_against_plain((12,), H=8, V=37, dtype=torch.float64, temperature=temperature, chunk=chunk, tol=1e-10)

"""Tests for nanokl/ppo.py beside the policy losses: every agg_loss mode against python loops (also
with NaN/±inf under the mask), the clipped value loss, entropy and log-probs. The policy losses
(dual-clip, GSPO, CISPO) are tests/test_ppo.py, which reduces with python_agg and NORMS from here.

How the tests prove it. Value loss and vf_clipfrac equal a per-token python reference (both clip
branches asserted hit); all four agg_loss modes (with and without global_norm/horizon) equal
python-loop reductions, and micro-batch losses with the global count as global_norm add up to the
whole batch's; entropy and log-probs equal float64 −Σp log p and log_softmax-gather.

Masks hold for gradients too (tests/poison.py). NaN, +inf, −inf or a mix of them are planted
under the mask in the loss matrix of agg_loss and in every input of the value loss (vpreds,
returns, values), one input at a time and all at once, for every loss_agg_mode, with and without
global_norm/horizon, for bool/int/float masks. Then (1) the loss and metrics are torch.equal to
those with finite numbers there, (2) every gradient is finite and torch.equal to the finite
version's, (3) the gradient under the mask is exactly 0. Against the code before the inputs were
selected, the value test fails (0·inf = NaN in the backward).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from nanokl.ppo import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_value_loss,
    entropy_from_logits,
    logprobs_from_logits,
)
from poison import POISONS, assert_mask_holds


def python_agg(loss_rows, mask_rows, mode, global_norm=None, horizon=None):
    """Loop reduction of a list-of-lists loss matrix, written from the mode's definition."""
    if mode == "token-mean":
        total = sum(l for lr, mr in zip(loss_rows, mask_rows) for l, m in zip(lr, mr) if m > 0)
        count = sum(1 for mr in mask_rows for m in mr if m > 0)
        return total / (global_norm if global_norm is not None else max(count, 1))
    per_seq = []
    for lr, mr in zip(loss_rows, mask_rows):
        s = sum(l for l, m in zip(lr, mr) if m > 0)
        n = sum(1 for m in mr if m > 0)
        if mode == "seq-mean-token-sum":
            per_seq.append(s)
        elif mode == "seq-mean-token-mean":
            per_seq.append(s / n if n else 0.0)
        else:
            per_seq.append(s / (horizon if horizon is not None else len(lr)))
    return sum(per_seq) / (global_norm if global_norm is not None else len(per_seq))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_matches_reference(mode):
    B, T, clip = 3, 7, 0.5
    values = torch.randn(B, T, dtype=torch.float64)
    vpreds = values + torch.randn(B, T, dtype=torch.float64)  # some moves beyond ±0.5
    returns = values + torch.randn(B, T, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[1, 4:] = 0.0
    vpreds.requires_grad_(True)
    loss, metrics = compute_value_loss(vpreds, returns, values, mask, clip, mode)
    rows, clipped = [], []
    for i in range(B):
        row = []
        for t in range(T):
            v, r, old = vpreds[i, t].item(), returns[i, t].item(), values[i, t].item()
            vc = old + min(max(v - old, -clip), clip)
            row.append(max((v - r) ** 2, (vc - r) ** 2))
            if mask[i, t] > 0:
                clipped.append((vc - r) ** 2 > (v - r) ** 2)
        rows.append(row)
    assert 0 < sum(clipped) < len(clipped)  # both branches hit
    assert loss.item() == pytest.approx(0.5 * python_agg(rows, mask.tolist(), mode), rel=1e-12)
    assert metrics["vf_clipfrac"].item() == pytest.approx(sum(clipped) / len(clipped), rel=1e-12)
    assert metrics["vf_clipfrac"].dim() == 0 and not metrics["vf_clipfrac"].requires_grad


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_modes_with_and_without_global_norm(mode):
    loss_mat = torch.randn(4, 5, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 0]],
                        dtype=torch.float64)  # includes an empty row and a hole
    rows, m = loss_mat.tolist(), mask.tolist()
    assert agg_loss(loss_mat, mask, mode).item() == pytest.approx(python_agg(rows, m, mode), rel=1e-12)
    got = agg_loss(loss_mat, mask.bool(), mode, global_norm=37.0, horizon=16)
    assert got.item() == pytest.approx(python_agg(rows, m, mode, global_norm=37.0, horizon=16), rel=1e-12)


def test_agg_loss_global_norm_makes_micro_batches_add_up():
    """Splitting a batch into micro-batches and summing their losses with the global count as
    global_norm (what gradient accumulation does) equals the whole-batch loss."""
    loss_mat = torch.randn(6, 5, dtype=torch.float64)
    mask = (torch.rand(6, 5) > 0.3).double()
    for mode in LOSS_AGG_MODES:
        whole = agg_loss(loss_mat, mask, mode)
        norm = mask.sum() if mode == "token-mean" else 6
        parts = sum(agg_loss(loss_mat[s], mask[s], mode, global_norm=norm)
                    for s in (slice(0, 1), slice(1, 4), slice(4, 6)))
        assert parts.item() == pytest.approx(whole.item(), rel=1e-12)


def test_agg_loss_unknown_mode():
    with pytest.raises(ValueError) as err:
        agg_loss(torch.zeros(2, 2), torch.ones(2, 2), "seq-sum")
    for mode in LOSS_AGG_MODES:
        assert mode in str(err.value)


def test_entropy_matches_float64_sum():
    logits = torch.randn(3, 4, 11) * 3
    ent = entropy_from_logits(logits.double())
    ent32 = entropy_from_logits(logits)
    for i in range(3):
        for t in range(4):
            z = logits[i, t].double().tolist()
            mx = max(z)
            zsum = sum(math.exp(v - mx) for v in z)
            p = [math.exp(v - mx) / zsum for v in z]
            h = -sum(pi * math.log(pi) for pi in p if pi > 0)
            assert ent[i, t].item() == pytest.approx(h, rel=1e-12)
            assert ent32[i, t].item() == pytest.approx(h, rel=1e-5, abs=1e-6)


def test_logprobs_from_logits_matches_log_softmax_gather():
    logits = (torch.randn(3, 5, 50, dtype=torch.float64) * 4).requires_grad_(True)
    labels = torch.randint(0, 50, (3, 5))
    lp = logprobs_from_logits(logits, labels)
    ref = F.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(lp, ref, rtol=1e-12, atol=1e-12)
    w = torch.randn(3, 5, dtype=torch.float64)
    g, = torch.autograd.grad((lp * w).sum(), logits)
    g_ref, = torch.autograd.grad((ref * w).sum(), logits)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)
    lp32 = logprobs_from_logits(logits.detach().float(), labels)
    torch.testing.assert_close(lp32.double(), ref.detach(), rtol=1e-5, atol=1e-5)


NORMS = [{}, {"global_norm": 37.0, "horizon": 16}]


@pytest.mark.parametrize("norms", NORMS)
@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_ignores_non_finite_values_under_the_mask(mode, poison, norms):
    """NaN/±inf at masked entries: the loss equals the python reduction of the real entries and,
    bit for bit, the loss of a copy with 0 there; the gradient is the same, exactly 0 at masked
    entries. For bool, int and float masks."""
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 0]])
    clean = torch.randn(4, 5, dtype=torch.float64)
    clean[mask == 0] = 0.0
    poisoned = clean.clone()
    poisoned[mask == 0] = poison
    want = python_agg(poisoned.tolist(), mask.tolist(), mode, **norms)  # reads real entries only
    assert math.isfinite(want)
    for m in (mask.bool(), mask, mask.double()):
        x, c = poisoned.clone().requires_grad_(True), clean.clone().requires_grad_(True)
        loss, ref = agg_loss(x, m, mode, **norms), agg_loss(c, m, mode, **norms)
        assert loss.item() == pytest.approx(want, rel=1e-12)
        assert torch.equal(loss, ref)
        (g,), (g_ref,) = torch.autograd.grad(loss, x), torch.autograd.grad(ref, c)
        assert torch.isfinite(g).all() and torch.equal(g, g_ref)
        assert (g[mask == 0] == 0).all() and (g[mask > 0] != 0).all()


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_value_and_gradient_ignore_non_finite_masked_inputs(mode, poison):
    """NaN/±inf at masked entries of vpreds, returns and values (one at a time and together):
    loss, vf_clipfrac and the three gradients equal those of finite numbers there; the gradients
    are finite and exactly 0 under the mask (the inputs are selected before (V − R)²)."""
    values = torch.randn(4, 7, dtype=torch.float64)
    vpreds = values + torch.randn(4, 7, dtype=torch.float64)
    returns = values + torch.randn(4, 7, dtype=torch.float64)
    mask = torch.ones(4, 7, dtype=torch.float64)
    mask[1, 4:], mask[2, 2], mask[3] = 0.0, 0.0, 0.0
    inputs = {"vpreds": vpreds, "returns": returns, "values": values}
    for m in (mask, mask.bool(), mask.long()):
        for norms in NORMS:
            def fn(vpreds, returns, values):
                return compute_value_loss(vpreds, returns, values, m, 0.5, mode, **norms)
            for targets in (None, *([k] for k in inputs)):
                grads = assert_mask_holds(fn, inputs, m, poison, targets)
            assert (grads["vpreds"][mask > 0] != 0).any() and (grads["returns"][mask > 0] != 0).any()

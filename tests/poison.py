"""Plant NaN, +inf and −inf under the mask and check that neither a loss nor its gradient notices.

`assert_mask_holds(fn, inputs, mask, poison)` runs `fn` twice with autograd: once on `inputs` whose
masked entries hold random finite numbers, once with NaN/±inf written there instead (in every
input, or in one; "mixed" cycles NaN, +inf, −inf over the masked positions, shifted per input so
that e.g. a −inf log-prob meets a +inf or a −inf old one). It asserts
  (1) the loss and every metric are torch.equal to the finite version's;
  (2) every gradient is finite and torch.equal to the finite version's;
  (3) every gradient is exactly 0 at the masked entries.
"""

import math

import torch

POISONS = ("nan", "inf", "-inf", "mixed")
_VALUES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def poisoned(x, masked, poison, shift=0):
    """A copy of x with `poison` at the entries where `masked` is True."""
    out = x.detach().clone()
    if poison == "mixed":
        cycle = torch.tensor([math.nan, math.inf, -math.inf], dtype=x.dtype)
        out[masked] = cycle[(torch.arange(int(masked.sum())) + shift) % 3]
    else:
        out[masked] = _VALUES[poison]
    return out


def _run(fn, inputs):
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inputs.items()}
    out = fn(**leaves)
    loss, metrics = out if isinstance(out, tuple) else (out, {})
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return loss, metrics, dict(zip(leaves, grads))


def assert_mask_holds(fn, inputs, mask, poison, targets=None, seed=0):
    """fn(**inputs) -> loss or (loss, metrics); inputs: name -> float tensor of mask's shape;
    targets: the names to poison (default: all). Returns the clean gradients."""
    masked = ~mask.bool()
    assert masked.any() and (~masked).any()
    g = torch.Generator().manual_seed(seed)
    finite = {}
    for k, v in inputs.items():  # the clean version: arbitrary finite numbers under the mask
        v = v.detach().clone()
        v[masked] = (torch.randn(v.shape, generator=g, dtype=torch.float64) * 3).to(v.dtype)[masked]
        finite[k] = v
    bad = {k: poisoned(v, masked, poison, shift=i) if targets is None or k in targets else v
           for i, (k, v) in enumerate(finite.items())}
    assert any(not torch.isfinite(v).all() for v in bad.values())

    loss0, metrics0, grads0 = _run(fn, finite)
    loss, metrics, grads = _run(fn, bad)
    assert torch.isfinite(loss) and torch.equal(loss, loss0), (loss, loss0)
    assert metrics.keys() == metrics0.keys()
    for k, v in metrics.items():
        assert torch.isfinite(v).all() and torch.equal(v, metrics0[k]), k
    for k, gk in grads.items():
        assert torch.isfinite(gk).all(), f"d loss / d {k} is not finite"
        assert torch.equal(gk, grads0[k]), f"d loss / d {k} differs from the finite version's"
        assert (gk[masked] == 0).all(), f"d loss / d {k} is not 0 under the mask"
    return grads0

"""Tests for nanokl/masked.py: masked sum/mean/moments/whiten against numpy, whitening with
the summed moments of a split batch equal to whitening the whole batch, and NaN/±inf under the
mask changing no statistic and no gradient.

How the tests prove it. Every statistic equals numpy over the compressed real entries (holes
included); whitening's σ² equals the two-pass variance of the real entries (masked_var, the tests'
float64 reference, itself checked against numpy), and whitening fewer than 2 of them raises; an
all-masked mean is 0; whitening with the summed moments of a 2-way split equals
whitening the whole batch, and local statistics would differ. With NaN, +inf or −inf written
under the mask, every statistic (sum and mean with and without dim, moments,
whitening's statistics) equals a float64 numpy reference over the real entries and, bit for bit,
the statistic of a copy holding 0 there, for bool, int and float masks; the multiply-based form
Σ m·x really does turn the same inputs into NaN. masked_mean([1, 2, NaN, 4], mask [1, 0, 0, 1])
is 2.5. Backward through every statistic (tests/poison.py) with NaN/±inf under the mask gives
the loss and the gradient of finite numbers there, finite and exactly 0 under the mask; and
selecting only the output of (v − R)², not its inputs, really does give a NaN gradient.
"""

import math

import numpy as np
import pytest
import torch

from nanokl.masked import masked_mean, masked_moments, masked_sum, masked_whiten, zero_masked
from poison import POISONS, assert_mask_holds


def right_padded_mask(lengths, width):
    return torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths], dtype=torch.float64)


def masked_var(values, mask, unbiased=True):
    """The tests' reference for whitening's variance: over all mask==1 positions, two-pass (centre
    first, then square), where masked_whiten takes σ² from the summed moments (S2/n − μ²)."""
    values = zero_masked(values, mask)  # select first: (x − μ)² of a masked inf would send back 0·inf = NaN
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.to(values.dtype).sum()
        if n < 2:
            raise ValueError(f"unbiased masked_var needs at least 2 unmasked values, got {int(n)}")
        var = var * n / (n - 1)
    return var


def np_whiten(x, m, shift_mean=True):
    """Reference whitening in numpy over the mask==1 entries, unbiased variance."""
    sel = x[m > 0]
    mean, var = sel.mean(), sel.var(ddof=1)
    out = (x - mean) / np.sqrt(var + 1e-8)
    return out + mean if not shift_mean else out


def test_masked_stats_match_numpy():
    x = torch.randn(5, 9, dtype=torch.float64) * 3 + 2
    m = right_padded_mask([9, 4, 1, 7, 3], 9)
    m[0, 4] = 0.0  # a hole in the middle
    xn, mn = x.numpy(), m.numpy()
    sel = xn[mn > 0]
    assert masked_sum(x, m).item() == pytest.approx(sel.sum(), rel=1e-12)
    assert masked_mean(x, m).item() == pytest.approx(sel.mean(), rel=1e-12)
    assert masked_var(x, m).item() == pytest.approx(sel.var(ddof=1), rel=1e-12)  # the reference itself
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(sel.var(ddof=0), rel=1e-12)
    row_means = masked_mean(x, m, dim=-1)
    for i in range(5):
        assert row_means[i].item() == pytest.approx(xn[i][mn[i] > 0].mean(), rel=1e-12)
    torch.testing.assert_close(masked_sum(x, m, dim=0), torch.from_numpy((xn * mn).sum(0)))
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0  # empty mask: 0, not NaN
    s1, s2, n = masked_moments(x, m)
    assert (s1.item(), s2.item(), n.item()) == pytest.approx((sel.sum(), (sel**2).sum(), sel.size))
    for shift in (True, False):
        torch.testing.assert_close(masked_whiten(x, m, shift_mean=shift),
                                   torch.from_numpy(np_whiten(xn, mn, shift)))
    # whitening's σ² (from the moments) is the two-pass variance: the whitened real entries have
    # variance σ²/(σ² + 1e-8)
    var = masked_var(x, m)
    assert masked_var(masked_whiten(x, m), m).item() == pytest.approx((var / (var + 1e-8)).item(), rel=1e-12)
    with pytest.raises(ValueError, match="at least 2 unmasked values, got 1"):
        masked_whiten(x, right_padded_mask([1, 0, 0, 0, 0], 9))


def test_whiten_with_global_moments_of_split_batch_equals_whole():
    """Two 'ranks' each hold half the rows; adding their moments (what an all-reduce does)
    and whitening each half with them reproduces whitening the whole batch."""
    x = torch.randn(6, 8, dtype=torch.float64) * 2 + 5
    m = right_padded_mask([8, 3, 5, 2, 7, 1], 8)
    halves = [(x[:3], m[:3]), (x[3:], m[3:])]
    moments = [masked_moments(xi, mi) for xi, mi in halves]
    global_stats = tuple(a + b for a, b in zip(*moments))
    split = torch.cat([masked_whiten(xi, mi, stats=global_stats) for xi, mi in halves])
    torch.testing.assert_close(split, masked_whiten(x, m), rtol=1e-12, atol=1e-12)
    local = torch.cat([masked_whiten(xi, mi) for xi, mi in halves])
    assert not torch.allclose(local, split)  # local statistics really would differ


def test_masked_mean_ignores_nan_under_the_mask():
    x = torch.tensor([1.0, 2.0, float("nan"), 4.0])
    assert masked_mean(x, torch.tensor([1, 0, 0, 1])).item() == 2.5


@pytest.mark.parametrize("mask_kind", [torch.bool, torch.int64, torch.float32])
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_under_the_mask_never_leak(poison, mask_kind):
    """Every statistic of a tensor holding NaN/±inf at its masked entries equals (a) numpy float64
    over the compressed real entries and (b) the same statistic, bit for bit, on a copy whose
    masked entries are 0. The poisoned rows include an empty one and a hole."""
    clean = torch.randn(5, 9, dtype=torch.float64) * 3 + 2
    m = right_padded_mask([9, 4, 0, 7, 3], 9)
    m[0, 4] = 0.0
    clean[m == 0] = 0.0
    x = clean.clone()
    x[m == 0] = poison
    mask = m.to(mask_kind)
    assert torch.isnan((x * m).sum())  # the multiply-based form would be poisoned

    xn, mn = clean.numpy(), m.numpy()
    sel = xn[mn > 0]
    rows = [xn[i][mn[i] > 0] for i in range(5)]
    cols = [xn[:, j][mn[:, j] > 0] for j in range(9)]
    want = {
        "sum": sel.sum(), "mean": sel.mean(),
        "row_sum": [r.sum() for r in rows], "row_mean": [r.mean() if r.size else 0.0 for r in rows],
        "col_sum": [c.sum() for c in cols], "col_mean": [c.mean() if c.size else 0.0 for c in cols],
        "moments": [sel.sum(), (sel**2).sum(), float(sel.size)],
    }

    def stats(v):
        return {
            "sum": masked_sum(v, mask), "mean": masked_mean(v, mask),
            "row_sum": masked_sum(v, mask, dim=-1), "row_mean": masked_mean(v, mask, dim=-1),
            "col_sum": masked_sum(v, mask, dim=0), "col_mean": masked_mean(v, mask, dim=0),
            "moments": torch.stack(masked_moments(v, mask)),
        }

    got, on_zeros = stats(x), stats(clean)
    for k, v in got.items():
        assert torch.isfinite(v).all(), k
        assert torch.equal(v, on_zeros[k]), k
        np.testing.assert_allclose(np.atleast_1d(v.numpy()), np.atleast_1d(want[k]), rtol=1e-12, atol=1e-12,
                                   err_msg=k)

    # Whitening: the values at masked positions may be anything, the statistics must not be.
    real = m > 0
    for shift in (True, False):
        w = masked_whiten(x, mask, shift_mean=shift)
        assert torch.isfinite(w[real]).all()
        torch.testing.assert_close(w[real], torch.from_numpy(np_whiten(xn, mn, shift))[real],
                                   rtol=1e-12, atol=1e-12)
        assert torch.equal(w[real], masked_whiten(clean, mask, shift_mean=shift)[real])


@pytest.mark.parametrize("mask_kind", [torch.bool, torch.int64, torch.float64])
@pytest.mark.parametrize("poison", POISONS)
def test_gradients_ignore_non_finite_values_under_the_mask(poison, mask_kind):
    """Backward through every statistic (sum and mean with and without dim, both whitenings feeding a
    masked sum) with NaN/±inf under the mask: the value and the gradient are
    those of finite numbers there, the gradient is finite and exactly 0 at the masked entries."""
    m = right_padded_mask([9, 4, 0, 7, 3], 9)
    m[0, 4] = 0.0  # a hole
    mask = m.to(mask_kind)
    x = torch.randn(5, 9, dtype=torch.float64) * 3 + 2
    w = torch.randn(5, 9, dtype=torch.float64)  # weights make every per-entry gradient distinct
    stats = {
        "sum": lambda v: masked_sum(v * w, mask),
        "row_sum": lambda v: (masked_sum(v, mask, dim=-1) * w[:, 0]).sum(),
        "col_sum": lambda v: (masked_sum(v, mask, dim=0) * w[0]).sum(),
        "mean": lambda v: masked_mean(v * w, mask),
        "row_mean": lambda v: (masked_mean(v, mask, dim=-1) * w[:, 0]).sum(),
        "col_mean": lambda v: (masked_mean(v, mask, dim=0) * w[0]).sum(),
        "whiten": lambda v: masked_sum(masked_whiten(v, mask) * w, mask),
        "whiten_scale": lambda v: masked_mean(masked_whiten(v, mask, shift_mean=False) * w, mask),
    }
    for name, f in stats.items():
        grads = assert_mask_holds(lambda v: f(v), {"v": x}, mask, poison)
        assert (grads["v"][m > 0] != 0).any(), name


def test_selecting_the_output_is_not_enough_for_the_gradient():
    """The lesson of the module docstring: where(m, (v − R)², 0) hides a padded R = inf from the
    value, but its backward still multiplies the 0 by 2(v − R) = −inf: NaN. Selecting v and R
    first gives the clean gradient."""
    m = torch.tensor([True, True, False])
    v = torch.tensor([0.5, 1.0, 2.0], requires_grad=True)
    r = torch.tensor([1.0, 0.0, math.inf])
    (g,) = torch.autograd.grad(masked_sum((v - r) ** 2, m), v)
    assert torch.isnan(g[2]) and torch.isfinite(g[:2]).all()
    (g,) = torch.autograd.grad(masked_sum((zero_masked(v, m) - zero_masked(r, m)) ** 2, m), v)
    assert g.tolist() == [-1.0, 2.0, 0.0]

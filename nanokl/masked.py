"""Masked statistics: sums, means, variances and whitening over the real tokens only.

Responses are right-padded (and a mask may have holes: tool-output tokens the policy did not
generate), so every statistic is taken where `mask` is 1. A mask *selects*, it does not *weight*:
a padded position may hold ±inf or NaN (the log-prob of a pad token a logit mask forbids is
−inf), and 0·inf = 0·NaN = NaN, so the textbook Σ m·x lets one pad poison the batch. Every
function selects first, zero_masked(x, m) = where(m, x, 0), and sums what is left; for finite x that
is m·x bit for bit (x·1 = x, x·0 = ±0, and adding ±0 never changes a sum).

Gradients too: where sends back an exact 0 where it did not select, but autograd multiplies that 0
by the derivative of what was computed before it (where(m, (x − μ)², 0) at x = inf:
0·2(x − μ) = NaN), so arithmetic on x selects x first (the losses of nanokl/ppo.py); whitening's
statistics are constants.

With n = Σ m:

    masked_sum    = Σ_{m=1} x
    masked_mean   = Σ_{m=1} x / max(n, 1)      all masked: 0, not 0/0; exact for n ≥ 1
    masked_whiten = (x − μ) / sqrt(σ² + 1e-8)  shift_mean=False adds μ back (scale only)

Across ranks, whitening with local statistics would depend on the number of GPUs, so it takes
moments that add up: S1 = Σ_{m=1} x, S2 = Σ_{m=1} x², n (masked_moments; float64, so
S2/n − μ² does not cancel when |μ| ≫ σ). nanokl/engine/dist.py all-reduces them,
masked_whiten takes them back as `stats`: μ = S1/n, σ² = (S2/n − μ²)·n/(n − 1). It whitens
every position; the loss masks.

Mirrors verl's masked_sum, masked_mean and masked_whiten (verl/utils/torch_functional.py; its
masked_var is whitening's σ² here). tests/test_masked.py checks each against numpy on the real
entries and, with NaN/±inf under the mask, bit for bit (gradients too) against zeros there.
Differs from verl: see README, 'Where nanokl differs from verl'.
"""

import torch


def zero_masked(values, mask):
    """values where mask is set, 0 elsewhere: a select, not a product (0·inf and 0·NaN are
    NaN)."""
    return torch.where(mask.bool(), values, 0)


def masked_sum(values, mask, dim=None):
    """Σ of the mask==1 entries, over all elements (dim=None) or along dim."""
    kept = zero_masked(values, mask)
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values, mask, dim=None):
    """Mean over mask==1 positions. Masks are 0/1; an all-zero mask gives 0 (not NaN) because
    the count is clamped to 1, which is exact for any non-empty mask.
    Differs from verl: see README, 'Where nanokl differs from verl'."""
    count = mask.to(values.dtype)
    count = count.sum() if dim is None else count.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_moments(values, mask):
    """(Σ x, Σ x², n) over the mask==1 entries, as float64 0-d tensors; add them across shards
    to get global ones. Detached: whitening treats its statistics as constants."""
    x = zero_masked(values.detach().double(), mask)
    return x.sum(), (x * x).sum(), mask.double().sum()


def masked_whiten(values, mask, shift_mean=True, stats=None):
    """(values − μ)/sqrt(σ² + 1e-8) with μ, unbiased σ² from `stats` = global (S1, S2, n)
    if given, else from this tensor's own masked moments. shift_mean=False adds μ back, so
    only the scale changes. Applied to every position; masked ones are left to the loss mask.
    Differs from verl: see README, 'Where nanokl differs from verl'."""
    s1, s2, n = masked_moments(values, mask) if stats is None else stats
    s1, s2, n = (torch.as_tensor(t, dtype=torch.float64) for t in (s1, s2, n))
    if n < 2:
        raise ValueError(f"masked_whiten needs at least 2 unmasked values, got {int(n)}")
    mean = s1 / n
    var = (s2 / n - mean * mean).clamp(min=0) * n / (n - 1)
    mean = mean.to(device=values.device, dtype=values.dtype)
    inv_std = torch.rsqrt(var + 1e-8).to(device=values.device, dtype=values.dtype)
    whitened = (values - mean) * inv_std
    return whitened + mean if not shift_mean else whitened

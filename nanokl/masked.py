"""MASKED DOCSTRING TODO"""

import torch


def masked_sum(values, mask, dim=None):
    """Σ mask·values, over all elements (dim=None) or along dim."""
    prod = values * mask.to(values.dtype)
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(values, mask, dim=None):
    """Mean over mask==1 positions. Masks are 0/1; an all-zero mask gives 0 (not NaN) because
    the count is clamped to 1, which is exact for any non-empty mask."""
    count = mask.to(values.dtype)
    count = count.sum() if dim is None else count.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values, mask, unbiased=True):
    """Variance over all mask==1 positions (two-pass: centre first, then square)."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.to(values.dtype).sum()
        if n < 2:
            raise ValueError(f"unbiased masked_var needs at least 2 unmasked values, got {int(n)}")
        var = var * n / (n - 1)
    return var


def masked_moments(values, mask):
    """(Σ m·x, Σ m·x², Σ m) as float64 0-d tensors; add them across shards to get global ones.
    Detached: whitening treats its statistics as constants."""
    x = values.detach().double()
    m = mask.double()
    return (x * m).sum(), (x * x * m).sum(), m.sum()


def masked_whiten(values, mask, shift_mean=True, stats=None):
    """(values − μ)/sqrt(σ² + 1e-8) with μ, unbiased σ² from `stats` = global (S1, S2, n)
    if given, else from this tensor's own masked moments. shift_mean=False adds μ back, so
    only the scale changes. Applied to every position; masked ones are left to the loss mask."""
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

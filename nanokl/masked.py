"""Masked statistics: sums, means, variances and whitening over the real tokens only.

The idea
--------
Responses are right-padded to a common length (and a mask may have holes in the middle, e.g.
tool-output tokens the policy did not generate), so every statistic is taken over the tokens
where `mask` is 1 and nowhere else. A mask *selects*; it does not *weight*. The difference
matters because padded positions hold whatever the model computed there, and that can be
±inf or NaN: the log-probability of a pad token that a logit mask forbids is −inf, and a KL
estimate or a squared error built from it is ±inf or NaN. In IEEE arithmetic 0·inf and 0·NaN
are NaN, so Σ m·x, the textbook form, lets a single padded NaN poison the whole batch. Every
function here therefore selects first,

    zero_masked(x, m) = where(m, x, 0)

and sums what is left. For finite x this equals m·x exactly (x·1 = x, x·0 = ±0, and adding a
±0 never changes a sum), so switching from multiply to select changes no bit of a finite
result. Its gradient is the incoming gradient at selected entries and an exact 0 elsewhere.
One caution that no masked statistic can fix: autograd then multiplies that 0 by the local
derivative of whatever came *before* the selection, so a padded entry whose derivative is
infinite (say (v − R)² with R = inf) still sends 0·inf = NaN backwards; select the inputs
themselves when that can happen.

The formulas
------------
With n = Σ m (the number of real tokens):

    masked_sum   = Σ_{m=1} x
    masked_mean  = Σ_{m=1} x / max(n, 1)     an all-masked mean is 0, not 0/0 = NaN; for n ≥ 1
                                              the clamp does nothing, so the mean is exact
    masked_var   = Σ_{m=1} (x − μ)² / (n − 1) the unbiased variance, centred first (two-pass),
                                              or / n with unbiased=False
    masked_whiten = (x − μ)/sqrt(σ² + 1e-8)   mean 0, variance ≈ 1 over the real tokens;
                                              shift_mean=False adds μ back (scale only)

Whitening across ranks. In a distributed run each rank holds a shard of the batch, and
whitening with local statistics would make training depend on the number of GPUs. So the
whitening statistics are built from *moments* that add across shards:

    S1 = Σ_{m=1} x,   S2 = Σ_{m=1} x²,   n = Σ m        (masked_moments)
    μ = S1/n,         σ² = (S2/n − μ²) · n/(n − 1)

nanokl/dist.py all-reduces (S1, S2, n) and masked_whiten takes them back as `stats`; the
whitened result is then the same on 1 or 8 GPUs (nanokl/advantages.py whitens GAE advantages
this way). The moments are accumulated in float64 so that S2/n − μ² does not cancel to noise
when |μ| is large compared with σ. Whitening is applied at every position; the values at masked
positions may be anything (even NaN), and the loss mask ignores them.

Reference: verl's masked_sum, masked_mean, masked_var and masked_whiten
(verl/utils/torch_functional.py). The differences: verl divides a mean by n + 1e-8 where we
divide by max(n, 1) (both give 0 for an all-masked mean; ours is exact for n ≥ 1), and verl
whitens with this tensor's own statistics only, where ours also accept global moments.

How the tests prove it (tests/test_masked.py)
--------------------------------------------
Every statistic equals numpy over the compressed real entries (holes included); an all-masked
mean is 0; whitening with the summed moments of a 2-way split equals whitening the whole batch,
and local statistics would differ. With NaN, +inf or −inf written under the mask, every
statistic (sum and mean with and without dim, variance, moments, whitening's statistics) equals
a float64 numpy reference over the real entries and, bit for bit, the statistic of a copy
holding 0 there, for bool, int and float masks; the multiply-based form Σ m·x really does turn
the same inputs into NaN. masked_mean([1, 2, NaN, 4], mask [1, 0, 0, 1]) is 2.5.
"""

import torch


def zero_masked(values, mask):
    """values where mask is set, 0 elsewhere: a select, not a product (0·inf and 0·NaN are NaN)."""
    return torch.where(mask.bool(), values, 0)


def masked_sum(values, mask, dim=None):
    """Σ of the mask==1 entries, over all elements (dim=None) or along dim."""
    kept = zero_masked(values, mask)
    return kept.sum() if dim is None else kept.sum(dim=dim)


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
    """(Σ x, Σ x², n) over the mask==1 entries, as float64 0-d tensors; add them across shards
    to get global ones. Detached: whitening treats its statistics as constants."""
    x = zero_masked(values.detach().double(), mask)
    return x.sum(), (x * x).sum(), mask.double().sum()


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

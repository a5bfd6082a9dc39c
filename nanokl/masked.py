"""Masked statistics: sums, means, variances and whitening over the real tokens only.

The idea
--------
Responses are right-padded to a common length (and a mask may have holes, e.g. tool-output tokens
the policy did not generate), so every statistic is taken over the tokens where `mask` is 1. A
mask *selects*; it does not *weight*. Padded positions hold whatever the model computed there, and
that can be ±inf or NaN (the log-prob of a pad token a logit mask forbids is −inf). In IEEE
arithmetic 0·inf and 0·NaN are NaN, so Σ m·x, the textbook form, lets one padded NaN poison the
whole batch. Every function here therefore selects first,

    zero_masked(x, m) = where(m, x, 0)

and sums what is left. For finite x this equals m·x exactly (x·1 = x, x·0 = ±0, and adding a ±0
never changes a sum), so no bit of a finite result changes.

Masks hold for gradients too. where's gradient is the incoming one at selected entries and an exact
0 elsewhere, but autograd then multiplies that 0 by the derivative of whatever was computed
*before* the selection: where(m, (x − μ)², 0) with x = inf sends back 0·2(x − μ) = NaN. So a
function that does arithmetic on x selects x itself first (masked_var; the losses of
nanokl/ppo.py select their inputs), and its gradient is finite, exactly 0 under the mask, and the
same as if finite numbers sat there. masked_whiten's statistics are constants, so its gradient is
the incoming one times 1/σ: finite wherever the consumer selects.

The formulas
------------
With n = Σ m (the number of real tokens):

    masked_sum   = Σ_{m=1} x
    masked_mean  = Σ_{m=1} x / max(n, 1)     an all-masked mean is 0, not 0/0; exact for n ≥ 1
    masked_var   = Σ_{m=1} (x − μ)² / (n − 1) the unbiased variance, centred first (two-pass),
                                              or / n with unbiased=False
    masked_whiten = (x − μ)/sqrt(σ² + 1e-8)   mean 0, variance ≈ 1 over the real tokens;
                                              shift_mean=False adds μ back (scale only)

Whitening across ranks. With the batch sharded over ranks, whitening with local statistics would
make training depend on the number of GPUs, so the statistics come from moments that add up:

    S1 = Σ_{m=1} x,   S2 = Σ_{m=1} x²,   n = Σ m        (masked_moments)
    μ = S1/n,         σ² = (S2/n − μ²) · n/(n − 1)

nanokl/dist.py all-reduces (S1, S2, n) and masked_whiten takes them back as `stats`, so the
result is the same on 1 or 8 GPUs (nanokl/advantages.py whitens GAE advantages this way). The
moments are float64 so that S2/n − μ² does not cancel to noise when |μ| ≫ σ. Whitening is applied
at every position; the values at masked positions may be anything (even NaN).

Reference: verl's masked_sum, masked_mean, masked_var and masked_whiten
(verl/utils/torch_functional.py). Differs from verl: see README, 'Where nanokl differs from verl'.
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
    the count is clamped to 1, which is exact for any non-empty mask.
    Differs from verl: see README, 'Where nanokl differs from verl'."""
    count = mask.to(values.dtype)
    count = count.sum() if dim is None else count.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values, mask, unbiased=True):
    """Variance over all mask==1 positions (two-pass: centre first, then square)."""
    values = zero_masked(values, mask)  # select first: (x − μ)² of a masked inf would send back 0·inf = NaN
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

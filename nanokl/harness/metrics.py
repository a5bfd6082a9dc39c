"""Step metrics under verl's names, reduced over all ranks, and the timers of a step.

verl's `compute_data_metrics` reports, for each per-response or per-token quantity of a batch
(scores, rewards, advantages, returns, values, response lengths), its mean, max and min as
`<name>/mean`, `/max`, `/min`; `compute_timing_metrics` reports seconds per phase as
`timing_s/<phase>`. Under data parallelism each rank holds a slice of the batch, so every statistic
here is reduced over ranks (sums and counts for means, max/min for extremes; nanokl/dist.py):
the logged numbers are those of the whole global batch, whatever the world size.

The critic's explained variance, 1 - Var[R - V] / Var[R] over the response tokens, is 1 for a
critic that predicts the returns exactly, 0 for one that predicts their mean, and negative for a
worse one (verl's critic/vf_explained_var). Var[R] is floored at 1e-8, so constant returns give a
finite number. tests/test_metrics.py checks it against numpy at world size 1, padding included.
"""

import math
import time
from contextlib import contextmanager

import torch

from nanokl import dist
from nanokl.masked import masked_moments


def add_stats(metrics, name, values, mask=None):
    """name/mean, /max, /min over the masked entries of all ranks (verl's compute_data_metrics)."""
    mean, hi, lo = dist.global_stats(values, mask)
    if math.isfinite(mean):
        metrics.update({f"{name}/mean": mean, f"{name}/max": hi, f"{name}/min": lo})


def global_var(values, mask=None):
    """Population variance of the masked entries of all ranks (e.g. over the step's responses)."""
    mask = torch.ones_like(values) if mask is None else mask
    s1, s2, n = dist.all_reduce_moments(masked_moments(values.float(), mask))
    return ((s2 / n - (s1 / n) ** 2).clamp(min=0)).item() if n > 0 else float("nan")


def explained_variance(values, returns, mask):
    """1 - Var[R - V] / Var[R] over all ranks' response tokens (critic/vf_explained_var); the
    n/(n-1) of unbiased variances cancels in the ratio."""
    return 1 - global_var(returns - values, mask) / max(global_var(returns, mask), 1e-8)


@contextmanager
def timer(metrics, name, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize()
    metrics[f"timing_s/{name}"] = time.perf_counter() - t

"""Validation beyond mean@1: best@k, worst@k and maj@k over n samples per prompt (verl's names).

With `rollout.val_kwargs.n = n > 1` each held-out prompt gets n sampled responses and n scores.
mean@n (and std@n) summarise them; three more numbers say what k samples of them would give:

    best@k    the best score among k responses     (pass@k for a 0/1 accuracy)
    worst@k   the worst score among k responses    (all k correct)
    maj@k     the score of the majority answer among k responses (self-consistency voting:
              the most frequent extracted answer, ties to the one seen first, scored by the
              first response that gave it)

for k in 2, 4, 8, ... < n, and n. Each is a bootstrap: B = 1000 rows of k indices drawn from the
n responses *with replacement* (seed 42), the statistic per row, then the mean and the population
std over the rows: `best@k/mean`, `best@k/std`. A prompt's numbers are averaged over the prompts
of its data source and named `val-core/<source>/<var>/<metric>` for the core variable (`acc` if
there is one, else `reward`) at the largest k, for mean, maj and best; everything else is
`val-aux/...` (worst@k, std@n, smaller k).

What the bootstrap estimates. Drawing with replacement from the n scores x, the best of k has the
expectation Σ_j x_(j)·((j/n)^k − ((j−1)/n)^k) (x_(j) sorted ascending); with c correct of n that
is 1 − (1 − c/n)^k. That is *not* the unbiased pass@k of Chen et al. 2021, 1 − C(n−c, k)/C(n, k)
(k drawn without replacement): with replacement best@n still misses a lone correct response with
probability (1 − 1/n)^n ≈ 1/e. `replace=False` gives that estimator's bootstrap instead.

Costs. No model work beyond the n samples per prompt (the validation rollout is n times longer);
the bootstrap is numpy on the CPU, B·Σk draws per prompt and variable (maj@k: B·k² compares).
Differences from verl (verl/trainer/ppo/metric_utils.py: bootstrap_metric, calc_maj_val,
process_validation_metrics): the same draws from a local RandomState(seed), so the global numpy
RNG is not reseeded at every call as verl's np.random.seed(seed) does; see README, 'Where nanokl
differs from verl'. Like verl, every prompt and every k reuse the one seed, so all prompts with the
same n are resampled with the same index rows.

Which variables. verl averages every numeric key a reward function returns in a dict (its
reward_extra_info) besides the reward itself (`reward`); `acc`, when returned, is the core one. nanokl
does the same (nanokl/harness/scoring.py: validate): `acc` is the dict's "acc", or the score of a reward
that is a plain number (which verl would name `reward`: nanokl keeps the name its tools read); `reward`,
`score` and the other numeric keys of a dict reward are val-aux. `source_metrics` averages each over the
prompts of its data source, as verl's process_validation_metrics does.
"""

from functools import lru_cache

import numpy as np

CORE_PREFIXES = ("mean", "maj", "best")


def sample_sizes(n: int) -> list[int]:
    """verl's k list: 2, 4, 8, ... below n, then n; none for n ≤ 1."""
    ks, k = [], 2
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n] if n > 1 else []


def metric_names(n: int, with_maj: bool = False) -> list[str]:
    """The per-prompt metric names for n responses, in the order prompt_metrics gives them."""
    names = [f"mean@{n}"] + ([f"std@{n}"] if n > 1 else [])
    for k in sample_sizes(n):
        for stat in ("best", "worst") + (("maj",) if with_maj else ()):
            names += [f"{stat}@{k}/mean", f"{stat}@{k}/std"]
    return names


@lru_cache(maxsize=64)
def bootstrap_indices(n: int, k: int, n_bootstrap: int = 1000, seed: int = 42, replace: bool = True):
    """[n_bootstrap, k] response indices (read-only; the same for every prompt, so cached): verl's
    np.random.seed(seed); np.random.choice(n, (B, k)) with replace=True; uniformly random
    k-subsets (in random order) with replace=False."""
    rng = np.random.RandomState(seed)
    if replace:
        idx = rng.choice(n, size=(n_bootstrap, k), replace=True)
    else:
        idx = rng.random_sample((n_bootstrap, n)).argsort(axis=1)[:, :k]
    idx.setflags(write=False)
    return idx


def majority_scores(scores, answers, idx):
    """For each row of idx: the score of the first response (in row order) whose answer is the most
    frequent in the row; among equally frequent answers, the one seen first wins (verl's calc_maj_val)."""
    code_of = {}
    codes = np.array([code_of.setdefault(a, len(code_of)) for a in answers])[idx]  # [B, k]
    same = codes[:, :, None] == codes[:, None, :]
    count, first = same.sum(-1), same.argmax(-1)  # per position: its answer's count and first position
    top = count == count.max(-1, keepdims=True)
    winner = np.where(top, first, idx.shape[1]).min(-1)  # the winning answer's first position
    return np.asarray(scores, dtype=np.float64)[idx[np.arange(len(idx)), winner]]


def prompt_metrics(scores, answers=None, n_bootstrap: int = 1000, seed: int = 42, replace: bool = True) -> dict:
    """One prompt's n scores (and, for maj@k, its n extracted answers, any hashable, None included)
    -> {metric name: value} with the names of metric_names(n, answers is not None)."""
    x = np.asarray(scores, dtype=np.float64)
    n = len(x)
    if answers is not None and len(answers) != n:
        raise ValueError(f"{len(answers)} answers for {n} scores")
    out = {f"mean@{n}": float(x.mean())}
    if n > 1:
        out[f"std@{n}"] = float(x.std())
    for k in sample_sizes(n):
        idx = bootstrap_indices(n, k, n_bootstrap, seed, replace)
        stats = {"best": x[idx].max(1), "worst": x[idx].min(1)}
        if answers is not None:
            stats["maj"] = majority_scores(x, answers, idx)
        for stat, per_row in stats.items():
            out[f"{stat}@{k}/mean"], out[f"{stat}@{k}/std"] = float(per_row.mean()), float(per_row.std())
    return out


def metric_key(data_source: str, var: str, name: str, n_max: int, core_var: str) -> str:
    """verl's full name: val-core for the core variable's mean / maj / best at k = n_max, else val-aux."""
    k = int(name.split("@")[1].split("/")[0])
    core = var == core_var and name.startswith(CORE_PREFIXES) and k == n_max
    return f"{'val-core' if core else 'val-aux'}/{data_source}/{var}/{name}"


def source_metrics(prompts) -> dict:
    """verl's process_validation_metrics from per-prompt numbers, under its names: `prompts` holds, for every
    held-out prompt, (data source, {variable: prompt_metrics of its n values}); each metric is averaged over
    the prompts of its source (in the order given) and named by metric_key with "acc" the core variable.
    Sources come out sorted, each one's variables and metrics in the order its prompts first gave them."""
    sums = {}  # source -> variable -> metric name -> [sum over prompts, prompts]
    for source, variables in prompts:
        for var, values in variables.items():
            for name, value in values.items():
                total = sums.setdefault(source, {}).setdefault(var, {}).setdefault(name, [0.0, 0])
                total[0] += value
                total[1] += 1
    out = {}
    for source in sorted(sums):
        for var, by_name in sums[source].items():
            n_max = max(int(name.split("@")[1].split("/")[0]) for name in by_name)
            out.update({metric_key(source, var, name, n_max, "acc"): s / count for name, (s, count) in by_name.items()})
    return out

"""Tests for nanokl/harness/val_metrics.py: best@k, worst@k, maj@k and their names, as verl computes them.

How the tests prove it. A naive loop written from verl's description (verl's functions at b178a3c,
not imported: np.random.seed(seed) then np.random.choice(n, (B, k)) on the global RNG, a python
max / min / dict vote per row, math.fsum means and population stds, prompts averaged per data
source, `val-core` by verl's rule "core variable, mean/maj/best, '@n_max' in the name") gives the
same names and values, to 1e-12, for several n, continuous and 0/1 scores, answers with None and
ties, and prompts of unequal n. The closed forms hold as Monte Carlo checks with a stated
tolerance of 5 standard errors (sd/√B for a mean, sqrt((μ4 − σ⁴)/(4σ²B)) for a std, B = 1000
rows): with replacement (verl's draw),
E[best of k] = Σ_j x_(j)((j/n)^k − ((j−1)/n)^k), 1 − (1 − c/n)^k for c correct of n, likewise
worst@k, and maj@k for two answers P(Bin(k, p) > k/2) + ½ P(Bin(k, p) = k/2) (a tie goes to the
answer seen first, which is either with probability ½); without replacement best@k follows
1 − C(n−c, k)/C(n, k) (Chen et al.'s pass@k) and best@n is exactly the max.
"""

import math
import random
from collections import defaultdict

import numpy as np
import pytest

from nanokl.harness.val_metrics import (bootstrap_indices, majority_scores, metric_key, metric_names, prompt_metrics,
                                        sample_sizes)

B, SEED = 1000, 42
MC_TOL = 5  # standard errors


def verl_sizes(n):
    ks, k = [], 2
    while k < n:
        ks.append(k)
        k *= 2
    if n > 1:
        ks.append(n)
    return ks


def verl_draw(n, k, seed):
    """verl's draw: reseed numpy's global RNG and choose with replacement (the global state is put back)."""
    saved = np.random.get_state()
    np.random.seed(seed)
    idx = np.random.choice(n, size=(B, k), replace=True)
    np.random.set_state(saved)
    return idx.tolist()


def vote(pairs):
    """verl's majority vote: answers counted in order of first appearance, the first with the top
    count wins, scored by the first response that gave it."""
    votes = {}
    for score, answer in pairs:
        votes.setdefault(answer, []).append(score)
    return votes[max(votes, key=lambda a: len(votes[a]))][0]


def mean_std(vals):
    mean = math.fsum(vals) / len(vals)
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in vals) / len(vals))


def prompt_loop(scores, answers, seed=SEED):
    out = {f"mean@{len(scores)}": math.fsum(scores) / len(scores)}
    if len(scores) > 1:
        out[f"std@{len(scores)}"] = mean_std(scores)[1]
    for k in verl_sizes(len(scores)):
        rows = verl_draw(len(scores), k, seed)
        per = {"best": [max(scores[j] for j in r) for r in rows], "worst": [min(scores[j] for j in r) for r in rows]}
        if answers is not None:
            per["maj"] = [vote([(scores[j], answers[j]) for j in r]) for r in rows]
        for stat, vals in per.items():
            out[f"{stat}@{k}/mean"], out[f"{stat}@{k}/std"] = mean_std(vals)
    return out


def validation_loop(sources, uids, infos, answers):
    prompts = {}
    for i, key in enumerate(zip(sources, uids)):
        prompts.setdefault(key, []).append(i)
    collected = {}
    for (src, _), rows in prompts.items():
        for var, vals in infos.items():
            got = prompt_loop([vals[i] for i in rows], None if answers is None else [answers[i] for i in rows])
            for name, v in got.items():
                collected.setdefault((src, var), {}).setdefault(name, []).append(v)
    out = {}
    for (src, var), by_name in collected.items():
        core = "acc" if "acc" in infos else "reward"
        n_max = max(int(name.split("@")[-1].split("/")[0]) for name in by_name)
        for name, vals in by_name.items():
            sec = "val-core" if (var == core and name.startswith(("mean", "maj", "best")) and f"@{n_max}" in name) \
                else "val-aux"
            out[f"{sec}/{src}/{var}/{name}"] = math.fsum(vals) / len(vals)
    return out


def validation_metrics(data_sources, uids, infos: dict, answers=None, n_bootstrap: int = 1000, seed: int = 42,
                       replace: bool = True) -> dict:
    """The tests' reference for verl's process_validation_metrics and its naming, in one process, built
    from the module's prompt_metrics and metric_key: the tests here check it against validation_loop,
    tests/test_parts.py checks validate's numbers against it. One entry per response: data_sources, uids
    (the prompt of each response), infos {variable: numbers} (e.g. {"acc": ...}), answers (extracted
    answers, for maj@k) or None. Returns {full metric name: mean over prompts}."""
    rows = defaultdict(list)  # (source, uid) -> its responses, in order
    for i, key in enumerate(zip(data_sources, uids)):
        rows[key].append(i)
    per_prompt = defaultdict(lambda: defaultdict(list))  # (source, var) -> name -> one value per prompt
    for (src, _), members in rows.items():
        votes = None if answers is None else [answers[i] for i in members]
        for var, values in infos.items():
            for name, v in prompt_metrics([values[i] for i in members], votes, n_bootstrap, seed, replace).items():
                per_prompt[src, var][name].append(v)
    out = {}
    for (src, var), by_name in per_prompt.items():
        core_var = "acc" if "acc" in infos else "reward"
        n_max = max(int(name.split("@")[1].split("/")[0]) for name in by_name)
        for name, vals in by_name.items():
            out[metric_key(src, var, name, n_max, core_var)] = float(np.mean(vals))
    return out


def test_sample_sizes_are_verl_list():
    assert [sample_sizes(n) for n in (1, 2, 3, 4, 5, 16, 17)] == \
        [[], [2], [2, 3], [2, 4], [2, 4, 5], [2, 4, 8, 16], [2, 4, 8, 16, 17]]
    assert all(sample_sizes(n) == verl_sizes(n) for n in range(40))


def test_draws_are_verl_draws_and_leave_numpy_global_rng_alone():
    bootstrap_indices.cache_clear()  # draw afresh, not from the cache
    before = np.random.get_state()[1].copy()
    for n, k in [(5, 2), (5, 5), (16, 8)]:
        assert bootstrap_indices(n, k, B, SEED).tolist() == verl_draw(n, k, SEED)
    assert np.array_equal(np.random.get_state()[1], before)


@pytest.mark.parametrize("n", [2, 3, 5, 8, 16])
@pytest.mark.parametrize("kind", ["binary", "continuous"])
def test_prompt_metrics_match_naive_loop(n, kind):
    rng = random.Random(n)
    scores = [float(rng.random() < 0.4) if kind == "binary" else rng.gauss(0, 1) for _ in range(n)]
    answers = [rng.choice(["7", "8", "9", None]) for _ in range(n)]
    for ans in (answers, None):
        got, want = prompt_metrics(scores, ans), prompt_loop(scores, ans)
        assert list(got) == metric_names(n, ans is not None)
        assert set(got) == set(want)
        for name in want:
            assert got[name] == pytest.approx(want[name], rel=1e-12, abs=1e-12), name


def test_validation_metrics_names_and_values_match_naive_loop():
    """Two sources, unequal n (source y has a prompt with 3 responses), acc and reward: the core
    variable is acc, at its largest k; worst@k, std@n and the smaller k are val-aux."""
    rng = random.Random(0)
    sources, uids = [], []
    for src, uid, n in [("x", 0, 4), ("x", 1, 4), ("y", 2, 4), ("y", 3, 3), ("x", 4, 4)]:
        sources += [src] * n
        uids += [uid] * n
    rng.shuffle(order := list(range(len(uids))))  # responses need not be contiguous
    sources, uids = [sources[i] for i in order], [uids[i] for i in order]
    acc = [float(rng.random() < 0.5) for _ in uids]
    infos = {"reward": [a + rng.gauss(0, 0.1) for a in acc], "acc": acc}
    answers = [rng.choice(["1", "2"]) for _ in uids]
    got = validation_metrics(sources, uids, infos, answers)
    want = validation_loop(sources, uids, infos, answers)
    assert set(got) == set(want)
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-12, abs=1e-12), name
    core = sorted(k for k in got if k.startswith("val-core"))
    assert core == [f"val-core/{s}/acc/{m}" for s in "xy" for m in ("best@4/mean", "best@4/std", "maj@4/mean",
                                                                   "maj@4/std", "mean@4")]
    assert "val-aux/y/acc/best@3/mean" in got and "val-aux/x/acc/worst@4/mean" in got
    # without acc the reward is the core variable
    alone = validation_metrics(sources, uids, {"reward": infos["reward"]})
    assert "val-core/x/reward/best@4/mean" in alone and not any("maj@" in k for k in alone)


def test_one_sample_gives_mean_at_1_only():
    assert validation_metrics(["arith"] * 3, [0, 1, 2], {"acc": [1.0, 0.0, 1.0]}) == \
        {"val-core/arith/acc/mean@1": pytest.approx(2 / 3)}


def test_majority_vote_ties_go_to_the_answer_seen_first():
    scores = np.array([0.1, 0.2, 0.3, 0.4, 0.5])
    answers = ["B", "A", "A", "B", None]
    rows = np.array([[0, 1, 2, 3],    # 2-2 tie, B first: B's first score 0.1
                     [1, 0, 3, 2],    # 2-2 tie, A first: 0.2
                     [2, 1, 3, 4],    # A twice: its first response in the row is 2 -> 0.3
                     [4, 4, 0, 1],    # None twice wins: 0.5
                     [3, 3, 3, 3]])   # one answer: 0.4
    assert majority_scores(scores, answers, rows).tolist() == [0.1, 0.2, 0.3, 0.5, 0.4]
    assert [vote([(scores[j], answers[j]) for j in r]) for r in rows.tolist()] == [0.1, 0.2, 0.3, 0.5, 0.4]


def expected_best_worst(x, k):
    """Exact mean and sd of the max and of the min of k draws with replacement from the n values x,
    and the standard error of a sd measured on B rows, sqrt((μ4 − σ⁴) / (4σ²B))."""
    x, n = sorted(x), len(x)
    p_max = [(j / n) ** k - ((j - 1) / n) ** k for j in range(1, n + 1)]
    p_min = [((n - j + 1) / n) ** k - ((n - j) / n) ** k for j in range(1, n + 1)]
    out = []
    for p in (p_max, p_min):
        m1 = math.fsum(pi * xi for pi, xi in zip(p, x))
        var = math.fsum(pi * (xi - m1) ** 2 for pi, xi in zip(p, x))
        mu4 = math.fsum(pi * (xi - m1) ** 4 for pi, xi in zip(p, x))
        out.append((m1, math.sqrt(var), math.sqrt((mu4 - var * var) / (4 * var * B))))
    return out


@pytest.mark.parametrize("seed", [0, 42, 7])
def test_best_and_worst_match_closed_forms_with_replacement(seed):
    rng = random.Random(seed)
    for scores in ([1.0] * 3 + [0.0] * 5, [rng.gauss(0, 1) for _ in range(11)]):
        got = prompt_metrics(scores, seed=seed)
        for k in sample_sizes(len(scores)):
            for stat, (mean, sd, sd_se) in zip(("best", "worst"), expected_best_worst(scores, k)):
                assert abs(got[f"{stat}@{k}/mean"] - mean) <= MC_TOL * sd / math.sqrt(B), (stat, k)
                assert abs(got[f"{stat}@{k}/std"] - sd) <= MC_TOL * sd_se, (stat, k)
    # c of n correct: best@k → 1 − (1 − c/n)^k, worst@k → (c/n)^k
    got, p = prompt_metrics([1.0] * 3 + [0.0] * 5, seed=seed), 3 / 8
    for k in (2, 4, 8):
        for stat, q in (("best", 1 - (1 - p) ** k), ("worst", p ** k)):
            assert abs(got[f"{stat}@{k}/mean"] - q) <= MC_TOL * math.sqrt(q * (1 - q) / B)
            m = got[f"{stat}@{k}/mean"]  # 0/1 values: population std = sqrt(m(1 − m)) exactly
            assert got[f"{stat}@{k}/std"] == pytest.approx(math.sqrt(m * (1 - m)), abs=1e-12)


@pytest.mark.parametrize("seed", [0, 42, 7])
def test_best_without_replacement_is_chen_pass_at_k(seed):
    n, c = 10, 3
    got = prompt_metrics([1.0] * c + [0.0] * (n - c), seed=seed, replace=False)
    for k in sample_sizes(n):
        q = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert abs(got[f"best@{k}/mean"] - q) <= MC_TOL * math.sqrt(q * (1 - q) / B) + 1e-12, k
    assert (got[f"best@{n}/mean"], got[f"best@{n}/std"], got[f"worst@{n}/mean"]) == (1.0, 0.0, 0.0)


@pytest.mark.parametrize("seed", [0, 42, 7])
@pytest.mark.parametrize("n,c", [(5, 3), (8, 3), (16, 9)])
def test_majority_matches_binomial_closed_form(seed, n, c):
    """Answer A (score 1) c times, B (score 0) n − c times: A wins with P(Bin(k, c/n) > k/2) plus
    half the tie probability."""
    rng = random.Random(seed)
    answers = ["A"] * c + ["B"] * (n - c)
    rng.shuffle(answers)
    got = prompt_metrics([float(a == "A") for a in answers], answers, seed=seed)
    p = c / n
    for k in sample_sizes(n):
        pmf = [math.comb(k, j) * p ** j * (1 - p) ** (k - j) for j in range(k + 1)]
        q = math.fsum(pmf[j] for j in range(k + 1) if 2 * j > k) + (0.5 * pmf[k // 2] if k % 2 == 0 else 0.0)
        assert abs(got[f"maj@{k}/mean"] - q) <= MC_TOL * math.sqrt(q * (1 - q) / B), k


def test_source_metrics_is_verls_process_validation_metrics_from_per_prompt_numbers():
    """What validate averages (scoring.py): per-prompt prompt_metrics of every variable, then
    source_metrics; the same names and numbers as the reference loop over responses, for two sources
    (given unsorted), several variables (acc core, the rest val-aux), and maj@k from answers."""
    from nanokl.harness.val_metrics import source_metrics
    rng = random.Random(5)
    n, sources, uids, infos, answers = 4, [], [], {"acc": [], "reward": [], "length": []}, []
    prompts = []
    for p in range(7):
        src = "zeta" if p % 3 else "alpha"
        acc = [float(rng.random() < 0.5) for _ in range(n)]
        values = {"acc": acc, "reward": [2 * a - 1 for a in acc], "length": [float(rng.randint(1, 30)) for _ in range(n)]}
        votes = [rng.choice("ab") for _ in range(n)]
        prompts.append((src, {var: prompt_metrics(v, votes) for var, v in values.items()}))
        sources += [src] * n
        uids += [p] * n
        answers += votes
        for var, v in values.items():
            infos[var] += v
    got, want = source_metrics(prompts), validation_metrics(sources, uids, infos, answers)
    assert list(got) == sorted(got, key=lambda k: k.split("/")[1] != "alpha")  # sources sorted
    assert set(got) == set(want) and all(got[k] == pytest.approx(want[k], abs=1e-12) for k in want)
    assert "val-core/zeta/acc/maj@4/mean" in got and "val-aux/zeta/reward/maj@4/mean" in got
    assert "val-aux/alpha/length/best@4/mean" in got and not any(k.startswith("val-core/alpha/length") for k in got)

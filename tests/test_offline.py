"""Tests for nanokl/offline.py and the is_weights path of nanokl/ppo.py: truncated importance
weights and the decoupled PPO loss against float64 per-token loops, the exact reduction to
ordinary PPO when μ = π_old, the SNIS KL estimate on a categorical toy against the exact KL
(and its truncation bias against the closed-form limit), and the IS metrics.

How the tests check it. The weights equal a float64 loop of min(exp(clamp(old − μ)), C)
(truncation hit and not, NaN under the mask gives 0); the weighted policy loss equals a per-token
loop branch by branch in all four loss_agg_modes, and its gradient the closed form −w·A·ρ
(unclipped) or 0 (clipped); μ = π_old gives weights of exactly 1 and a loss and gradient
torch.equal to the unweighted ones. On a categorical toy (8 tokens, 20000 draws from μ ≠ π) the
SNIS k1 estimate matches the exact KL(π‖π_ref) within 4 delta-method standard errors without
truncation, and the closed-form truncated limit with it (which lies > 10 SE below the KL), while
the plain mean under μ is far off. weighted_kl with weights of 1 equals the online per-response
mean; the IS metrics equal a python loop, and sums of two shards give the metrics of the whole.

Sequences (verl's rollout_is=sequence and rollout_rs at b178a3c): the sequence weights equal a
float64 loop of min(exp(clamp(Σ_t (log π_old − log μ), ±20)), C) on each real token; μ = π_old
gives exactly PPO. rejection_mask equals a loop of every option (k1 = −log r, k2 = ½ log² r,
k3 = r − 1 − log r at token, seq sum, seq mean and seq max level, k1 in a [log lower, log upper]
band, k2/k3 below an upper bound) with thresholds placed between observed values so each option
rejects some and keeps some, alone and chained; the threshold specs parse as verl's; the RS metrics
equal a loop and add across shards. NaN/±inf under the mask change no weight, mask or metric.
"""

import math

import pytest
import torch

from nanokl.masked import masked_mean
from nanokl.offline import (
    IS_LEVELS,
    RS_OPTIONS,
    is_metrics,
    is_metrics_from_sums,
    is_sums,
    rejection_mask,
    rs_metrics_from_sums,
    rs_sums,
    rs_thresholds,
    sequence_is_weights,
    truncated_is_weights,
    weighted_kl,
    weighted_kl_sums,
)
from nanokl.ppo import LOSS_AGG_MODES, compute_policy_loss
from poison import POISONS, poisoned

EPS_LOW, EPS_HIGH, CLIP_C, THRESHOLD = 0.2, 0.28, 3.0, 2.0


def batch(dtype=torch.float64, seed=0, n=6, r=9):
    """Log-probs of π_old, π_θ and μ, advantages and a mask with holes and one empty row, built
    so that every clip branch and the truncation are hit; NaN under the mask."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, r, generator=g, dtype=torch.float64) * 3 - 0.1
    new = old + torch.randn(n, r, generator=g, dtype=torch.float64) * 0.6
    mu = old + torch.randn(n, r, generator=g, dtype=torch.float64) * 1.0
    adv = torch.randn(n, r, generator=g, dtype=torch.float64)
    mask = torch.rand(n, r, generator=g) < 0.8
    mask[2] = False  # an empty response
    mask[0, :3] = True
    new[0, 0], adv[0, 0] = old[0, 0] + 1.5, -1.0  # ρ = e^1.5 > c with A < 0: the dual clip
    for x in (old, new, mu, adv):
        x[~mask] = float("nan")
    return [x.to(dtype) for x in (old, new, mu, adv)] + [mask]


def loop_weight(old, mu, threshold):
    return min(math.exp(min(max(old - mu, -20.0), 20.0)), threshold)


def loop_token_loss(old, new, a):
    """Dual-clip PPO loss of one token, branch by branch; returns (loss, branch)."""
    rho = math.exp(min(max(new - old, -20.0), 20.0))
    unclipped, clipped = -a * rho, -a * min(max(rho, 1 - EPS_LOW), 1 + EPS_HIGH)
    loss = max(unclipped, clipped)
    if a < 0 and loss > -a * CLIP_C:
        return -a * CLIP_C, "dual"
    return loss, "clipped" if clipped > unclipped else "unclipped"


def agg_factor(mode, n_i, n_tok, n_seq, horizon):
    """d loss / d loss_mat[i, t] of each aggregation mode, from its definition."""
    return {"token-mean": 1 / n_tok, "seq-mean-token-sum": 1 / n_seq,
            "seq-mean-token-mean": 1 / (n_i * n_seq), "seq-mean-token-sum-norm": 1 / (horizon * n_seq)}[mode]


def test_weights_equal_a_float64_loop_and_are_detached():
    old, _, mu, _, mask = batch()
    old.requires_grad_(True)
    w = truncated_is_weights(old, mu, mask, THRESHOLD)
    assert not w.requires_grad
    truncated = 0
    for i in range(w.shape[0]):
        for t in range(w.shape[1]):
            want = loop_weight(old[i, t].item(), mu[i, t].item(), THRESHOLD) if mask[i, t] else 0.0
            assert w[i, t].item() == pytest.approx(want, rel=1e-12, abs=0)
            truncated += bool(mask[i, t]) and want == THRESHOLD
    assert 0 < truncated < mask.sum()  # the cap is hit, and not everywhere
    # a huge log-ratio is clamped, not overflowed; the cap then applies
    big = truncated_is_weights(torch.tensor([[500.0, -500.0]]), torch.zeros(1, 2), torch.ones(1, 2), 1e30)
    assert big[0, 0].item() == pytest.approx(math.exp(20.0)) and big[0, 1].item() == pytest.approx(math.exp(-20.0))


@pytest.mark.parametrize("threshold", [0.5, 0.999, float("nan")])
def test_threshold_below_one_is_refused(threshold):
    with pytest.raises(ValueError, match="threshold"):
        truncated_is_weights(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), threshold)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_weighted_policy_loss_and_gradient_equal_per_token_loops(mode):
    old, new, mu, adv, mask = batch()
    w = truncated_is_weights(old, mu, mask, THRESHOLD)
    new = new.clone().requires_grad_(True)
    loss, _ = compute_policy_loss(old, new, adv, mask, EPS_LOW, EPS_HIGH, CLIP_C, loss_agg_mode=mode, is_weights=w)
    loss.backward()

    n_seq, r = mask.shape
    n_tok = int(mask.sum())
    want, branches = 0.0, set()
    for i in range(n_seq):
        n_i = int(mask[i].sum())
        for t in range(r):
            if not mask[i, t]:
                assert new.grad[i, t].item() == 0.0
                continue
            o, p, a = old[i, t].item(), new[i, t].item(), adv[i, t].item()
            wt = loop_weight(o, mu[i, t].item(), THRESHOLD)
            l, branch = loop_token_loss(o, p, a)
            branches.add(branch)
            f = agg_factor(mode, n_i, n_tok, n_seq, r)
            want += f * wt * l
            # unclipped: d(−w·A·ρ)/d log π_θ = −w·A·ρ; the clipped branches are constant in θ
            g = -wt * a * math.exp(p - o) if branch == "unclipped" else 0.0
            assert new.grad[i, t].item() == pytest.approx(f * g, rel=1e-10, abs=1e-14)
    assert branches == {"unclipped", "clipped", "dual"}
    assert loss.item() == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_mu_equal_old_gives_weight_one_and_exactly_the_ppo_loss(mode):
    old, new, _, adv, mask = batch(dtype=torch.float32, seed=1)
    w = truncated_is_weights(old, old.clone(), mask, THRESHOLD)
    assert torch.equal(w, mask.float())  # exactly 1 on real tokens, 0 under the mask
    grads, outs = [], []
    for weights in (None, w):
        p = new.clone().requires_grad_(True)
        loss, metrics = compute_policy_loss(old, p, adv, mask, EPS_LOW, EPS_HIGH, CLIP_C,
                                            loss_agg_mode=mode, is_weights=weights)
        loss.backward()
        outs.append((loss.detach(), metrics))
        grads.append(p.grad)
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(outs[0][1][k], outs[1][1][k]) for k in outs[0][1])
    assert torch.equal(grads[0], grads[1])
    assert torch.isfinite(grads[0]).all() and grads[0].abs().sum() > 0


def test_weighted_kl_sums_equal_a_loop_and_weights_one_give_the_online_kl():
    old, _, mu, _, mask = batch()
    kl = old - mu  # any per-token values; NaN under the mask
    w = truncated_is_weights(old, mu, mask, THRESHOLD)
    num = den = 0.0
    for i in range(mask.shape[0]):
        toks = [t for t in range(mask.shape[1]) if mask[i, t]]
        if not toks:
            den += 1.0  # an empty response: weight of an empty product, no KL
            continue
        num += sum(w[i, t].item() * kl[i, t].item() for t in toks) / len(toks)
        den += sum(w[i, t].item() for t in toks) / len(toks)
    assert weighted_kl_sums(kl, w, mask).tolist() == pytest.approx([num, den], rel=1e-12)
    assert weighted_kl(kl, w, mask).item() == pytest.approx(num / den, rel=1e-12)

    # weights of 1 on the real tokens: the online definition (empty row included as a 0)
    ones = mask.to(torch.float32)
    kl32 = kl.float()
    online = masked_mean(kl32, mask, dim=-1).mean()
    assert torch.allclose(weighted_kl(kl32, ones, mask).float(), online, rtol=1e-6, atol=1e-7)

    # two shards whose sums are added (as an all-reduce would) give the whole batch's estimate
    half = 3
    other = weighted_kl_sums(kl[half:], w[half:], mask[half:])
    split = weighted_kl(kl[:half], w[:half], mask[:half], reduce=lambda s: s + other)
    assert split.item() == pytest.approx(weighted_kl(kl, w, mask).item(), rel=1e-12)


# A categorical toy: one position, 8 tokens. μ (the behaviour policy) differs from π and π_ref.
PI = torch.tensor([0.30, 0.22, 0.15, 0.12, 0.08, 0.06, 0.04, 0.03], dtype=torch.float64)
REF = torch.tensor([0.10, 0.12, 0.14, 0.14, 0.14, 0.12, 0.12, 0.12], dtype=torch.float64)
MU = torch.tensor([0.16, 0.16, 0.14, 0.14, 0.12, 0.10, 0.10, 0.08], dtype=torch.float64)


def snis_k1(threshold, m=20000, seed=0):
    """SNIS k1 estimate from m draws of μ, and its delta-method standard error for a ratio
    estimator: SE² = Σ w_i² (k_i − est)² / (Σ w_i)²."""
    idx = torch.multinomial(MU, m, replacement=True, generator=torch.Generator().manual_seed(seed))
    old, ref, mu = PI.log()[idx, None], REF.log()[idx, None], MU.log()[idx, None]  # [m, 1]: one token a row
    mask = torch.ones(m, 1, dtype=torch.bool)
    w = truncated_is_weights(old, mu, mask, threshold)
    k1 = old - ref
    est = weighted_kl(k1, w, mask).item()
    se = math.sqrt(float((w.square() * (k1 - est).square()).sum())) / float(w.sum())
    return est, se, w, k1


def truncated_limit(pi, mu, ref, threshold):
    """Σ_v μ min(π/μ, C) k1 / Σ_v μ min(π/μ, C): where the truncated SNIS estimate converges."""
    g = torch.clamp(pi / mu, max=threshold)
    return float((mu * g * (pi / ref).log()).sum() / (mu * g).sum())


def test_snis_kl_on_a_categorical_toy_without_truncation_is_the_exact_kl():
    exact = float((PI * (PI / REF).log()).sum())
    est, se, w, k1 = snis_k1(threshold=10.0)
    assert (w < 10.0).all()  # max π/μ = 1.875: the cap never acts
    assert abs(est - exact) < 4 * se
    # the plain mean under μ estimates Σ μ log(π/π_ref) (negative here), not the KL
    plain, plain_se = k1.mean().item(), k1.std().item() / math.sqrt(k1.numel())
    mu_mean = float((MU * (PI / REF).log()).sum())
    assert abs(plain - mu_mean) < 4 * plain_se
    assert abs(plain - exact) > 10 * abs(est - exact) and abs(plain - exact) > 40 * plain_se


def test_snis_kl_with_truncation_converges_to_the_biased_limit():
    exact = float((PI * (PI / REF).log()).sum())
    limit = truncated_limit(PI, MU, REF, 1.2)
    est, se, w, _ = snis_k1(threshold=1.2)
    assert (w == 1.2).any() and (w < 1.2).any()
    assert abs(est - limit) < 4 * se
    assert exact - limit > 10 * se  # the bias is real, and low for this toy
    # μ = π_ref with k1: the truncated limit never exceeds the KL (docstring, bias (b))
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        pi, ref = (torch.softmax(torch.randn(8, generator=g, dtype=torch.float64) * 1.5, 0) for _ in range(2))
        kl = float((pi * (pi / ref).log()).sum())
        for c in (1.0, 1.5, 2.0, 5.0):
            assert truncated_limit(pi, ref, ref, c) <= kl + 1e-12


def test_is_metrics_equal_a_loop_and_add_across_shards():
    old, _, mu, _, mask = batch(seed=2)
    w = truncated_is_weights(old, mu, mask, THRESHOLD)
    vals = [w[i, t].item() for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    n, s1, s2 = len(vals), sum(vals), sum(v * v for v in vals)
    m = is_metrics(w, mask, THRESHOLD)
    assert set(m) == {"is_mean", "is_clipfrac", "is_ess"}
    assert m["is_mean"].item() == pytest.approx(s1 / n, rel=1e-12)
    assert m["is_clipfrac"].item() == pytest.approx(sum(v >= THRESHOLD for v in vals) / n, rel=1e-12)
    assert 0 < m["is_clipfrac"].item() < 1
    assert m["is_ess"].item() == pytest.approx(s1 * s1 / (n * s2), rel=1e-12)
    shards = is_sums(w[:3], mask[:3], THRESHOLD) + is_sums(w[3:], mask[3:], THRESHOLD)
    whole = is_metrics_from_sums(shards)
    assert all(whole[k].item() == pytest.approx(m[k].item(), rel=1e-12) for k in m)
    empty = is_metrics(w, torch.zeros_like(mask), THRESHOLD)
    assert all(v.item() == 0.0 for v in empty.values())


# ---- sequence-level weights and rejection sampling (verl's rollout_is=sequence, rollout_rs) ------

def loop_seq_weight(old_row, mu_row, mask_row, threshold):
    total = sum(o - m for o, m, k in zip(old_row, mu_row, mask_row) if k)
    return min(math.exp(min(max(total, -20.0), 20.0)), threshold)


def test_sequence_weights_equal_a_float64_loop():
    old, _, mu, _, mask = batch(r=5)  # short rows, so some products stay under the cap
    mu[1, :] = old[1, :] + 30.0  # a huge negative log-ratio sum: clamped at −20, not underflowed
    w = sequence_is_weights(old.requires_grad_(True), mu, mask, THRESHOLD)
    assert not w.requires_grad and IS_LEVELS["sequence"] is sequence_is_weights
    assert IS_LEVELS["token"] is truncated_is_weights
    capped = 0
    for i in range(mask.shape[0]):
        want = loop_seq_weight(old[i].tolist(), mu[i].tolist(), mask[i].tolist(), THRESHOLD)
        capped += want == THRESHOLD and bool(mask[i].any())
        for t in range(mask.shape[1]):
            assert w[i, t].item() == pytest.approx(want if mask[i, t] else 0.0, rel=1e-12, abs=0)
    assert 0 < capped < int(mask.any(-1).sum())
    assert mask[1].any() and w[1][mask[1]].eq(math.exp(-20.0)).all()
    with pytest.raises(ValueError, match="threshold"):
        sequence_is_weights(old, mu, mask, 0.5)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_sequence_weights_with_mu_equal_old_are_exactly_ppo(mode):
    old, new, _, adv, mask = batch(dtype=torch.float32, seed=1)
    w = sequence_is_weights(old, old.clone(), mask, THRESHOLD)
    assert torch.equal(w, mask.float())
    a = compute_policy_loss(old, new, adv, mask, EPS_LOW, EPS_HIGH, CLIP_C, mode)[0]
    b = compute_policy_loss(old, new, adv, mask, EPS_LOW, EPS_HIGH, CLIP_C, mode, is_weights=w)[0]
    assert torch.equal(a, b)


def rs_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    n, r = 12, 8
    old = -torch.rand(n, r, generator=g, dtype=torch.float64) * 3
    mu = old + torch.randn(n, r, generator=g, dtype=torch.float64) * 0.5
    mask = torch.rand(n, r, generator=g) < 0.85
    mask[3] = False  # an empty response
    mask[0] = True
    return old, mu, mask


def loop_stats(old, mu, mask, option):
    """(per-unit statistic, the units): tokens (i, t) for token_*, rows i for seq_* (empty rows too)."""
    level, est = option.rsplit("_", 1)

    def k(o, m):
        lr = min(max(o - m, -20.0), 20.0)
        return {"k1": -lr, "k2": 0.5 * lr * lr, "k3": math.exp(lr) - 1 - lr}[est]
    n, r = mask.shape
    if level == "token":
        return {(i, t): k(old[i, t].item(), mu[i, t].item()) for i in range(n) for t in range(r) if mask[i, t]}
    stats = {}
    for i in range(n):
        vals = [k(old[i, t].item(), mu[i, t].item()) for t in range(r) if mask[i, t]]
        if level == "seq_sum":
            stats[i] = sum(vals)
        elif level == "seq_mean":
            stats[i] = sum(vals) / len(vals) if vals else 0.0
        else:
            stats[i] = max(vals) if vals else 0.0
    return stats


def between(sorted_vals, q):
    """A threshold halfway between two neighbouring observed values near quantile q (no ties at it)."""
    j = max(1, min(len(sorted_vals) - 1, int(q * len(sorted_vals))))
    return 0.5 * (sorted_vals[j - 1] + sorted_vals[j])


def spec_for(option, stats):
    vals = sorted(set(stats.values()))
    if option.endswith("k1"):  # a band in log space: lower_upper as ratios
        return f"{math.exp(between(vals, 0.2))!r}_{math.exp(between(vals, 0.8))!r}"
    return repr(between(vals, 0.6))


def loop_keep(old, mu, mask, specs):
    """A token survives iff it is real and passes every option (sequence options judge its row)."""
    n, r = mask.shape
    keep = [[bool(mask[i, t]) for t in range(r)] for i in range(n)]
    for option, spec in specs.items():
        stats = loop_stats(old, mu, mask, option)
        if option.endswith("k1"):
            lo, hi = (float(x) for x in spec.split("_")) if "_" in spec else (1 / float(spec), float(spec))
            ok = {u: math.log(lo) <= v <= math.log(hi) for u, v in stats.items()}
        else:
            ok = {u: v <= float(spec) for u, v in stats.items()}
        for i in range(n):
            for t in range(r):
                unit = (i, t) if option.startswith("token") else i
                keep[i][t] = keep[i][t] and ok[unit]
    return keep


@pytest.mark.parametrize("option", RS_OPTIONS)
def test_each_rejection_option_equals_a_float64_loop(option):
    old, mu, mask = rs_batch()
    spec = spec_for(option, loop_stats(old, mu, mask, option))
    got = rejection_mask(old, mu, mask.long(), option, spec)
    want = loop_keep(old, mu, mask, {option: spec})
    assert got.dtype == torch.long and got.tolist() == [[int(x) for x in row] for row in want]
    rejected = mask & (got == 0)
    assert 0 < int(rejected.sum()) < int(mask.sum())  # the threshold bites, and not everywhere
    if option.startswith("seq"):  # a sequence option keeps or drops whole rows
        for i in range(mask.shape[0]):
            assert len({int(got[i, t]) for t in range(mask.shape[1]) if mask[i, t]}) <= 1


def test_k1_with_one_number_is_the_band_from_its_reciprocal_and_options_chain():
    old, mu, mask = rs_batch(seed=1)
    one = rejection_mask(old, mu, mask, "token_k1", 1.4)
    assert torch.equal(one, rejection_mask(old, mu, mask, "token_k1", f"{1 / 1.4!r}_1.4"))
    assert one.dtype == torch.bool
    specs = {"seq_mean_k1": "0.85_1.2", "token_k2": "0.3", "seq_max_k3": "0.5"}
    got = rejection_mask(old, mu, mask.float(), "seq_mean_k1, token_k2,seq_max_k3,token_k2", "0.85_1.2,0.3,0.5")
    assert got.tolist() == [[float(x) for x in row] for row in loop_keep(old, mu, mask, specs)]
    shared = rejection_mask(old, mu, mask, "token_k2,seq_max_k2", "0.2")  # one spec for every option
    assert shared.tolist() == loop_keep(old, mu, mask, {"token_k2": "0.2", "seq_max_k2": "0.2"})
    # μ = π_old: every statistic is 0, inside any band that holds ratio 1
    assert torch.equal(rejection_mask(old, old.clone(), mask, ",".join(RS_OPTIONS), "2.0"), mask)


@pytest.mark.parametrize("rs,spec", [
    ("token_k4", "2"), ("", "2"), (None, "2"), ("token_k2", "0.5_2"), ("token_k2,token_k3", "1,2,3"),
    ("token_k1", None), ("token_k1", "0_2"), ("token_k2", "-1"), ("token_k1", "abc"), ("seq_max_k1", "2"),
])
def test_bad_rejection_specs_are_refused(rs, spec):
    with pytest.raises(ValueError, match="rollout_rs"):
        rs_thresholds(rs, spec)


def test_rs_thresholds_parse_as_verls():
    assert rs_thresholds("token_k1,seq_sum_k3", "0.5_2.0,3") == {"token_k1": (0.5, 2.0), "seq_sum_k3": (None, 3.0)}
    assert rs_thresholds("seq_mean_k1", 2.0) == {"seq_mean_k1": (0.5, 2.0)}
    assert rs_thresholds("token_k2,token_k2", "0.1") == {"token_k2": (None, 0.1)}


def test_rs_metrics_equal_a_loop_and_add_across_shards():
    old, mu, mask = rs_batch(seed=2)
    kept = rejection_mask(old, mu, mask, "token_k2,seq_sum_k1", "0.08,0.5_2.0")
    real = [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    rej = [(i, t) for i, t in real if not kept[i, t]]
    m = rs_metrics_from_sums(rs_sums(kept, mask))
    assert m["rs_masked_fraction"].item() == pytest.approx(len(rej) / len(real), rel=1e-12)
    assert m["rs_seq_masked_fraction"].item() == pytest.approx(len({i for i, _ in rej}) / mask.shape[0], rel=1e-12)
    assert 0 < m["rs_masked_fraction"].item() < 1
    whole = rs_metrics_from_sums(rs_sums(kept[:5], mask[:5]) + rs_sums(kept[5:], mask[5:]))
    assert all(whole[k].item() == pytest.approx(m[k].item(), rel=1e-12) for k in m)
    empty = rs_metrics_from_sums(rs_sums(torch.zeros_like(mask), torch.zeros_like(mask)))
    assert all(v.item() == 0.0 for v in empty.values())


@pytest.mark.parametrize("poison", POISONS)
def test_sequence_weights_and_rejection_ignore_non_finite_masked_inputs(poison):
    """NaN/±inf under the mask in π_old and μ: weights, kept masks and metrics equal those with
    finite numbers there, and the loss weighted by them keeps a finite gradient."""
    old, mu, mask = rs_batch(seed=3)
    bad_old, bad_mu = poisoned(old, ~mask, poison), poisoned(mu, ~mask, poison, shift=1)
    w, w_bad = sequence_is_weights(old, mu, mask, 3.0), sequence_is_weights(bad_old, bad_mu, mask, 3.0)
    assert torch.equal(w, w_bad) and torch.isfinite(w_bad).all()
    assert torch.equal(is_sums(w, mask, 3.0), is_sums(w_bad, mask, 3.0))
    for option in RS_OPTIONS:
        spec = spec_for(option, loop_stats(old, mu, mask, option))
        a, b = rejection_mask(old, mu, mask, option, spec), rejection_mask(bad_old, bad_mu, mask, option, spec)
        assert torch.equal(a, b) and torch.equal(rs_sums(a, mask), rs_sums(b, mask))
    new = (old + 0.1).requires_grad_(True)
    adv = torch.randn(old.shape, dtype=torch.float64)
    loss, _ = compute_policy_loss(bad_old, new, adv, mask, EPS_LOW, EPS_HIGH, CLIP_C, is_weights=w_bad)
    (g,) = torch.autograd.grad(loss, new)
    assert torch.isfinite(g).all() and (g[~mask] == 0).all()


def test_a_nan_at_a_real_token_is_rejected():
    old, mu, mask = rs_batch(seed=4)
    mu[0, 2] = float("nan")
    assert not rejection_mask(old, mu, mask, "token_k2", "100")[0, 2]
    assert not rejection_mask(old, mu, mask, "seq_mean_k3", "100")[0].any()

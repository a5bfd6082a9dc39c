"""Tests for nanokl/advantages.py: GAE against a per-sequence float64 loop, world-size independent
whitening, and the outcome estimators against per-group python lists.

How the tests prove it. GAE equals a float64 per-sequence python loop that first compresses each
row to its real tokens; with γ = λ = 1, returns equal the Monte Carlo return-to-go; whitening with
the summed moments of a 2-way split equals whitening the whole batch; GRPO equals a per-group
manual computation with python lists, including a group of size one and norm_adv_by_std=False;
RLOO equals a per-group python loop over the other responses' scores.

REINFORCE++, REINFORCE++-baseline, ReMax and GRPO pass@k each equal a float64 python loop written
from verl's formula (verl's function at b178a3c, not imported): REINFORCE++ with verl's reset of
the running return at masked positions on right-padded masks, and with the return chained around
holes where nanokl departs from verl (the test shows verl's loop would differ there). Both
REINFORCE++ variants whiten the same on a 2-way split with summed moments as on the whole batch.
Every outcome estimator, called through the table, gives finite results equal to the clean ones
when NaN and ±inf sit under the mask, and exact zeros there.
"""

import functools
import math

import numpy as np

import pytest
import torch

from nanokl.advantages import compute_gae_advantage_return, compute_grpo_outcome_advantage
from test_masked import np_whiten


def right_padded_mask(lengths, width):
    return torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths], dtype=torch.float64)


def gae_reference(rewards, values, mask, gamma, lam):
    """Float64 per-sequence loop: compress each row to its real tokens, run textbook GAE with
    a 0 bootstrap, scatter back; a masked position takes the advantage of the next real token
    to its right (0 after the last one). Returns raw (un-whitened) advantages and returns."""
    B, T = len(rewards), len(rewards[0])
    adv = np.zeros((B, T))
    for i in range(B):
        idx = [t for t in range(T) if mask[i][t] > 0]
        a_real = [0.0] * len(idx)
        running = 0.0
        for k in reversed(range(len(idx))):
            v_next = values[i][idx[k + 1]] if k + 1 < len(idx) else 0.0
            delta = rewards[i][idx[k]] + gamma * v_next - values[i][idx[k]]
            running = delta + gamma * lam * running
            a_real[k] = running
        for t in range(T):
            later = [k for k, tt in enumerate(idx) if tt >= t]
            adv[i][t] = a_real[later[0]] if later else 0.0
    return adv, adv + np.array(values)


def gae_inputs():
    B, T = 5, 10
    rewards = torch.randn(B, T, dtype=torch.float64)
    values = torch.randn(B, T, dtype=torch.float64)
    mask = right_padded_mask([10, 6, 1, 8, 3], T)
    mask[0, 3] = mask[0, 4] = 0.0  # holes in the middle of a sequence
    mask[3, 2] = 0.0
    return rewards, values, mask


def test_gae_matches_reference_loop_with_padding_and_holes():
    rewards, values, mask = gae_inputs()
    gamma, lam = 0.99, 0.95
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(ret, torch.from_numpy(ref_ret), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(adv, torch.from_numpy(np_whiten(ref_adv, mask.numpy())),
                               rtol=1e-10, atol=1e-10)
    # padding contents are irrelevant to real tokens
    garbage = (1 - mask) * 100.0
    adv2, ret2 = compute_gae_advantage_return(rewards + garbage, values - garbage, mask, gamma, lam)
    real = mask > 0
    torch.testing.assert_close(adv2[real], adv[real])
    torch.testing.assert_close(ret2[real], ret[real])


def test_gae_lambda_one_gives_monte_carlo_return():
    """γ = λ = 1: A_t + V_t telescopes to Σ_{t'≥t} r_t' over the real tokens."""
    rewards, values, mask = gae_inputs()
    _, ret = compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0)
    r, m = rewards.tolist(), mask.tolist()
    for i in range(len(r)):
        for t in range(len(r[i])):
            if m[i][t] > 0:
                mc = math.fsum(r[i][u] for u in range(t, len(r[i])) if m[i][u] > 0)
                assert ret[i, t].item() == pytest.approx(mc, rel=1e-10, abs=1e-12)


def test_gae_whiten_stats_hook_makes_split_equal_whole():
    """Simulate 2 data-parallel ranks: pass 1 records each shard's moments, pass 2 hands each
    shard their sum (an all-reduce); the advantages equal the whole-batch ones."""
    rewards, values, mask = gae_inputs()
    whole_adv, whole_ret = compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95)
    shards = [slice(0, 2), slice(2, 5)]
    recorded = []
    for s in shards:
        compute_gae_advantage_return(rewards[s], values[s], mask[s], 0.99, 0.95,
                                     whiten_stats=lambda st: recorded.append(st) or st)
    total = tuple(a + b for a, b in zip(*recorded))
    outs = [compute_gae_advantage_return(rewards[s], values[s], mask[s], 0.99, 0.95,
                                         whiten_stats=lambda st: total) for s in shards]
    torch.testing.assert_close(torch.cat([o[0] for o in outs]), whole_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([o[1] for o in outs]), whole_ret)


def grpo_reference(scores, index, norm, eps):
    groups = {}
    for s, k in zip(scores, index):
        groups.setdefault(k, []).append(s)
    out = []
    for s, k in zip(scores, index):
        g = groups[k]
        if len(g) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(g) / len(g)
            std = math.sqrt(sum((v - mean) ** 2 for v in g) / (len(g) - 1))
        out.append((s - mean) / (std + eps) if norm else s - mean)
    return out


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("index_type", ["list", "numpy", "tensor"])
def test_grpo_matches_per_group_computation(norm, index_type):
    B, T = 9, 6
    rewards = torch.zeros(B, T, dtype=torch.float64)
    mask = right_padded_mask([6, 2, 4, 5, 1, 3, 6, 6, 2], T)
    lengths = mask.sum(-1).long()
    rewards[torch.arange(B), lengths - 1] = torch.randn(B, dtype=torch.float64)  # outcome reward
    rewards[0, 0] = 0.5  # a dense reward too: the score is the row sum
    ids = ["a", "b", "a", "c", "b", "a", "b", "d", "a"]  # a:4, b:3, c:1, d:1
    index = {"list": ids, "numpy": np.array(ids, dtype=object),
             "tensor": torch.tensor([ord(c) for c in ids])}[index_type]
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std=norm, eps=1e-6)
    expected = grpo_reference(rewards.sum(-1).tolist(), ids, norm, 1e-6)
    for i in range(B):
        for t in range(T):
            want = expected[i] if mask[i, t] > 0 else 0.0
            assert adv[i, t].item() == pytest.approx(want, rel=1e-10, abs=1e-12)
    assert torch.equal(adv, ret)
    # the lone responses (groups c and d) keep their own score as advantage
    for i in (3, 7):
        assert adv[i, 0].item() == pytest.approx(rewards[i].sum().item() / (1 + 1e-6 if norm else 1))


def test_grpo_identical_scores_give_zero_advantage():
    rewards = torch.ones(4, 3)
    adv, _ = compute_grpo_outcome_advantage(rewards, torch.ones(4, 3), [0, 0, 1, 1])
    assert torch.equal(adv, torch.zeros(4, 3))


def test_estimator_table_calls_each_function_with_one_signature():
    """train_ppo.py calls every estimator as fn(rewards, mask, values, index, alg, whiten_stats):
    through the table, GAE and GRPO give exactly what their direct calls give."""
    from types import SimpleNamespace

    from nanokl.advantages import ESTIMATORS, compute_advantage
    B, T = 6, 5
    mask = right_padded_mask([5, 2, 4, 5, 1, 3], T)
    rewards, values = torch.randn(B, T, dtype=torch.float64) * mask, torch.randn(B, T, dtype=torch.float64)
    index = torch.tensor([0, 0, 1, 1, 2, 2])
    alg = SimpleNamespace(gamma=0.9, lam=0.8, norm_adv_by_std_in_grpo=False)
    direct = {"gae": compute_gae_advantage_return(rewards, values, mask, 0.9, 0.8),
              "grpo": compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std=False)}
    for name, (want_adv, want_ret) in direct.items():
        est = ESTIMATORS[name]
        adv, ret = compute_advantage(name, rewards, mask, values if est.needs_critic else None, index, alg, None)
        assert torch.equal(adv, want_adv) and torch.equal(ret, want_ret), name
    assert ESTIMATORS["gae"].needs_critic and not ESTIMATORS["gae"].grouped
    assert not ESTIMATORS["grpo"].needs_critic and ESTIMATORS["grpo"].grouped


def rloo_reference(scores, ids):
    """Python loop: each score minus the plain mean of the other scores of its group (a lone
    response keeps its score)."""
    out = []
    for i, (s, g) in enumerate(zip(scores, ids)):
        others = [scores[j] for j in range(len(scores)) if ids[j] == g and j != i]
        out.append(s - sum(others) / len(others) if others else s)
    return out


def test_rloo_matches_leave_one_out_loop():
    from types import SimpleNamespace

    from nanokl.advantages import ESTIMATORS, compute_advantage, compute_rloo_outcome_advantage
    B, T = 9, 6
    rewards = torch.zeros(B, T, dtype=torch.float64)
    mask = right_padded_mask([6, 2, 4, 5, 1, 3, 6, 6, 2], T)
    lengths = mask.sum(-1).long()
    rewards[torch.arange(B), lengths - 1] = torch.randn(B, dtype=torch.float64)
    rewards[0, 0] = 0.5  # a dense reward too: the score is the row sum
    ids = ["a", "b", "a", "c", "b", "a", "b", "d", "a"]  # a:4, b:3, c:1, d:1
    adv, ret = compute_rloo_outcome_advantage(rewards, mask, ids)
    expected = rloo_reference(rewards.sum(-1).tolist(), ids)
    for i in range(B):
        for t in range(T):
            want = expected[i] if mask[i, t] > 0 else 0.0
            assert adv[i, t].item() == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert torch.equal(adv, ret)
    # through the table, with the one signature train_ppo uses; no critic, grouped by prompt
    est = ESTIMATORS["rloo"]
    assert not est.needs_critic and est.grouped
    adv2, _ = compute_advantage("rloo", rewards, mask, None, ids, SimpleNamespace(), None)
    assert torch.equal(adv, adv2)
    # k/(k-1) times GRPO's un-normalised advantage, for the groups of size > 1
    grpo, _ = compute_grpo_outcome_advantage(rewards, mask, ids, norm_adv_by_std=False)
    for i, k in enumerate([4, 3, 4, 1, 3, 4, 3, 1, 4]):
        if k > 1:
            assert adv[i, 0].item() == pytest.approx(k / (k - 1) * grpo[i, 0].item(), rel=1e-12)


# ---------------------------------------------------------------------------------------------
# REINFORCE++, REINFORCE++-baseline, ReMax, GRPO pass@k: float64 loops written from verl's formulas
# ---------------------------------------------------------------------------------------------

IDS = ["a", "b", "a", "c", "b", "a", "b", "c", "a"]  # a:4, b:3, c:2


def outcome_inputs(holes=False):
    """Dense random rewards on the real tokens, 0 under the mask (as the reward and the KL
    penalty leave them); right padding, plus holes in the middle when asked."""
    B, T = 9, 7
    mask = right_padded_mask([7, 2, 4, 5, 1, 3, 7, 6, 2], T)
    if holes:
        mask[0, 2] = mask[0, 3] = mask[3, 1] = mask[6, 5] = 0.0
    rewards = torch.randn(B, T, dtype=torch.float64) * mask
    return rewards, mask


def verl_reinforce_pp_loop(rewards, mask, gamma):
    """verl's REINFORCE++ returns: G = r_t + γ G from the right, stored, then reset to 0 after a
    masked position."""
    out = []
    for r, m in zip(rewards, mask):
        row, running = [0.0] * len(r), 0.0
        for t in reversed(range(len(r))):
            running = r[t] + gamma * running
            row[t] = running
            if m[t] == 0:
                running = 0.0
        out.append(row)
    return np.array(out)


def chained_returns_loop(rewards, mask, gamma):
    """Returns-to-go over each row's real tokens only (masked positions skipped), 0 under the mask."""
    out = np.zeros((len(rewards), len(rewards[0])))
    for i, (r, m) in enumerate(zip(rewards, mask)):
        real = [t for t in range(len(r)) if m[t] > 0]
        for k, t in enumerate(real):
            out[i][t] = math.fsum(gamma ** j * r[u] for j, u in enumerate(real[k:]))
    return out


def whitened_masked(x, mask):
    m = np.array(mask)
    return np.where(m > 0, np_whiten(np.array(x), m), 0.0)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_verl_loop_on_right_padding(gamma):
    from nanokl.advantages import compute_reinforce_plus_plus_outcome_advantage
    rewards, mask = outcome_inputs()
    rewards = rewards + torch.randn_like(rewards) * (1 - mask)  # finite junk under the mask: verl's reset drops it
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma)
    want_ret = verl_reinforce_pp_loop(rewards.tolist(), mask.tolist(), gamma)
    real = mask > 0
    torch.testing.assert_close(ret[real], torch.from_numpy(want_ret)[real], rtol=1e-12, atol=1e-12)
    assert torch.equal(ret[~real], torch.zeros_like(ret[~real]))
    torch.testing.assert_close(adv, torch.from_numpy(whitened_masked(want_ret, mask.tolist())),
                               rtol=1e-10, atol=1e-10)


def test_reinforce_plus_plus_chains_returns_around_holes_where_verl_cuts_them():
    from nanokl.advantages import compute_reinforce_plus_plus_outcome_advantage
    rewards, mask = outcome_inputs(holes=True)
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, 0.9)
    want = chained_returns_loop(rewards.tolist(), mask.tolist(), 0.9)
    torch.testing.assert_close(ret, torch.from_numpy(want), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(adv, torch.from_numpy(whitened_masked(want, mask.tolist())), rtol=1e-10, atol=1e-10)
    # verl's loop resets at a hole: row 0's first two tokens would not see the rewards after it
    verl = verl_reinforce_pp_loop(rewards.tolist(), mask.tolist(), 0.9)
    assert abs(verl[0][0] - want[0][0]) > 1e-3 and verl[0][4] == pytest.approx(want[0][4], rel=1e-12)


def test_reinforce_plus_plus_baseline_matches_verl_loop():
    from nanokl.advantages import compute_reinforce_plus_plus_baseline_outcome_advantage
    rewards, mask = outcome_inputs(holes=True)
    ids = IDS[:-2] + ["d", "e"]  # two lone responses keep their score (verl's mean 0)
    adv, ret = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, ids)
    scores = [math.fsum(r) for r in rewards.tolist()]
    groups = {}
    for s, k in zip(scores, ids):
        groups.setdefault(k, []).append(s)
    centred = [s - (sum(groups[k]) / len(groups[k]) if len(groups[k]) > 1 else 0.0) for s, k in zip(scores, ids)]
    tiled = [[c * m for m in row] for c, row in zip(centred, mask.tolist())]
    torch.testing.assert_close(adv, torch.from_numpy(whitened_masked(tiled, mask.tolist())), rtol=1e-10, atol=1e-10)
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_reinforce_plus_plus_whitens_over_all_ranks(name):
    """Two simulated ranks (whole groups on each) with summed moments give the whole batch's result."""
    from types import SimpleNamespace

    from nanokl.advantages import ESTIMATORS, compute_advantage
    rewards, mask = outcome_inputs(holes=True)
    ids = ["a", "a", "b", "b", "c", "c", "c", "d", "d"]
    alg, fn = SimpleNamespace(gamma=0.95), functools.partial(compute_advantage, name)
    whole = fn(rewards, mask, None, ids, alg, None)
    shards, recorded = [slice(0, 4), slice(4, 9)], []
    for s in shards:
        fn(rewards[s], mask[s], None, ids[s], alg, lambda st: recorded.append(st) or st)
    total = tuple(a + b for a, b in zip(*recorded))
    outs = [fn(rewards[s], mask[s], None, ids[s], alg, lambda st: total) for s in shards]
    for j in (0, 1):
        torch.testing.assert_close(torch.cat([o[j] for o in outs]), whole[j], rtol=1e-12, atol=1e-12)


def test_remax_matches_returns_minus_greedy_baseline_loop():
    from types import SimpleNamespace

    from nanokl.advantages import ESTIMATORS, compute_advantage, compute_remax_outcome_advantage
    rewards, mask = outcome_inputs(holes=True)
    baselines = torch.randn(len(rewards), dtype=torch.float64)
    adv, ret = compute_remax_outcome_advantage(rewards, mask, baselines)
    want_ret = chained_returns_loop(rewards.tolist(), mask.tolist(), 1.0)  # verl: no discount
    want_adv = [[(g - b) if m else 0.0 for g, m in zip(row, mrow)]
                for row, mrow, b in zip(want_ret, mask.tolist(), baselines.tolist())]
    torch.testing.assert_close(ret, torch.from_numpy(want_ret), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(adv, torch.tensor(want_adv, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # through the table: the step passes the greedy scores as `baselines`; without them it refuses
    est = ESTIMATORS["remax"]
    assert est.needs_greedy_baseline and not est.needs_critic and not est.grouped
    got = compute_advantage("remax", rewards, mask, None, IDS, SimpleNamespace(gamma=0.5), None, baselines=baselines.tolist())
    assert torch.equal(got[0], adv) and torch.equal(got[1], ret)
    with pytest.raises(ValueError, match="greedy"):
        compute_advantage("remax", rewards, mask, None, IDS, SimpleNamespace(), None)
    with pytest.raises(ValueError, match="one baseline per response"):
        compute_remax_outcome_advantage(rewards, mask, baselines[:-1])


def passk_loop(scores, ids, norm, eps):
    """Per group: the first highest score gets (max − second max), ÷ (sample std + eps) if norm."""
    out = [0.0] * len(scores)
    for g in dict.fromkeys(ids):
        rows = [i for i, k in enumerate(ids) if k == g]
        vals = [scores[i] for i in rows]
        order = sorted(range(len(vals)), key=lambda j: -vals[j])
        gap = vals[order[0]] - vals[order[1]]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
        out[rows[order[0]]] = gap / (std + eps) if norm else gap
    return out


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_matches_verl_loop(norm):
    from types import SimpleNamespace

    from nanokl.advantages import ESTIMATORS, compute_advantage, compute_grpo_passk_outcome_advantage
    rewards, mask = outcome_inputs(holes=True)
    adv, ret = compute_grpo_passk_outcome_advantage(rewards, mask, IDS, norm_adv_by_std=norm, eps=1e-6)
    want = passk_loop([math.fsum(r) for r in rewards.tolist()], IDS, norm, 1e-6)
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float64)[:, None] * mask, rtol=1e-12, atol=1e-12)
    assert torch.equal(adv, ret) and (adv.abs().sum(-1) > 0).sum() == 3  # one response per group moves
    est = ESTIMATORS["grpo_passk"]
    assert est.grouped and not est.needs_critic
    assert torch.equal(compute_advantage("grpo_passk", rewards, mask, None, IDS, SimpleNamespace(norm_adv_by_std_in_grpo=norm), None)[0], adv)


def test_grpo_passk_tied_best_and_lone_response():
    from nanokl.advantages import compute_grpo_passk_outcome_advantage
    rewards = torch.tensor([[1.0], [0.0], [1.0], [0.0], [1.0]])  # group 0: two correct of three
    adv, _ = compute_grpo_passk_outcome_advantage(rewards, torch.ones(5, 1), [0, 0, 0, 1, 1])
    assert adv[:3].abs().sum() == 0  # the best is tied: nobody moves
    assert adv[4, 0].item() == pytest.approx(1 / (math.sqrt(0.5) + 1e-6)) and adv[3, 0] == 0
    with pytest.raises(ValueError, match="at least 2"):
        compute_grpo_passk_outcome_advantage(rewards, torch.ones(5, 1), [0, 0, 0, 1, 2])


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                  "remax", "grpo_passk"])
def test_outcome_estimators_ignore_nan_and_inf_under_the_mask(name):
    """NaN, +inf and −inf under the mask: finite results, equal to those of a clean batch, and 0 there."""
    from types import SimpleNamespace

    from nanokl.advantages import ESTIMATORS, compute_advantage
    rewards, mask = outcome_inputs(holes=True)
    poison = torch.tensor([math.nan, math.inf, -math.inf], dtype=torch.float64)
    masked = (mask == 0).nonzero()
    dirty = rewards.clone()
    dirty[masked[:, 0], masked[:, 1]] = poison[torch.arange(len(masked)) % 3]
    alg = SimpleNamespace(gamma=0.9, norm_adv_by_std_in_grpo=True)
    baselines = torch.randn(len(rewards), dtype=torch.float64)
    fn = functools.partial(compute_advantage, name)
    clean = fn(rewards, mask, None, IDS, alg, None, baselines=baselines)
    got = fn(dirty, mask, None, IDS, alg, None, baselines=baselines)
    for c, g in zip(clean, got):
        assert torch.isfinite(g).all()
        assert torch.equal(g, c)
        assert torch.equal(g[mask == 0], torch.zeros_like(g[mask == 0]))


def test_estimator_table_lists_verl_names():
    from nanokl.advantages import ESTIMATORS, compute_advantage
    assert list(ESTIMATORS) == ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                "remax", "grpo_passk"]
    assert [n for n, e in ESTIMATORS.items() if e.needs_greedy_baseline] == ["remax"]
    assert [n for n, e in ESTIMATORS.items() if e.grouped] == ["grpo", "rloo", "reinforce_plus_plus_baseline",
                                                              "grpo_passk"]


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus"])
def test_a_batch_rejection_emptied_has_zero_advantages(name):
    """rollout_rs may reject every token of a step (tests/test_train_offline.py runs one): the estimators that
    whiten over the batch's real tokens have none to whiten over, and give advantages of exactly 0 (no
    signal) instead of raising; one kept token is no better (its variance is undefined)."""
    from types import SimpleNamespace

    from nanokl.advantages import ESTIMATORS, compute_advantage
    rewards = torch.tensor([[0.0, 1.0, 0.5], [0.2, 0.0, 1.0]])
    values = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    cfg = SimpleNamespace(gamma=1.0, lam=0.95, norm_adv_by_std_in_grpo=True)
    for kept in (torch.zeros(2, 3), torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])):
        adv, ret = compute_advantage(name, rewards, kept, values, torch.arange(2), cfg, None)
        assert torch.equal(adv, torch.zeros_like(adv)) and torch.isfinite(ret).all()
    adv, _ = compute_advantage(name, rewards, torch.ones(2, 3), values, torch.arange(2), cfg, None)
    assert adv.abs().sum() > 0  # with tokens to whiten over, the same call gives a signal: the test can fail

"""Tests for nanokl/advantages.py: GAE against a per-sequence float64 loop, world-size independent
whitening, and GRPO against per-group python lists.

How the tests prove it. GAE equals a float64 per-sequence python loop that first compresses each
row to its real tokens; with γ = λ = 1, returns equal the Monte Carlo return-to-go; whitening with
the summed moments of a 2-way split equals whitening the whole batch; GRPO equals a per-group
manual computation with python lists, including a group of size one and norm_adv_by_std=False;
RLOO equals a per-group python loop over the other responses' scores.
"""

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

    from nanokl.advantages import ESTIMATORS
    B, T = 6, 5
    mask = right_padded_mask([5, 2, 4, 5, 1, 3], T)
    rewards, values = torch.randn(B, T, dtype=torch.float64) * mask, torch.randn(B, T, dtype=torch.float64)
    index = torch.tensor([0, 0, 1, 1, 2, 2])
    alg = SimpleNamespace(gamma=0.9, lam=0.8, norm_adv_by_std_in_grpo=False)
    direct = {"gae": compute_gae_advantage_return(rewards, values, mask, 0.9, 0.8),
              "grpo": compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std=False)}
    for name, (want_adv, want_ret) in direct.items():
        est = ESTIMATORS[name]
        adv, ret = est.fn(rewards, mask, values if est.needs_critic else None, index, alg, None)
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

    from nanokl.advantages import ESTIMATORS, compute_rloo_outcome_advantage
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
    adv2, _ = est.fn(rewards, mask, None, ids, SimpleNamespace(), None)
    assert torch.equal(adv, adv2)
    # k/(k-1) times GRPO's un-normalised advantage, for the groups of size > 1
    grpo, _ = compute_grpo_outcome_advantage(rewards, mask, ids, norm_adv_by_std=False)
    for i, k in enumerate([4, 3, 4, 1, 3, 4, 3, 1, 4]):
        if k > 1:
            assert adv[i, 0].item() == pytest.approx(k / (k - 1) * grpo[i, 0].item(), rel=1e-12)

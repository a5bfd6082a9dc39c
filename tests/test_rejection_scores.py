"""A response whose last token rollout_rs rejected keeps its score in the advantages (issue 39, item 2).

The score sits on a response's last token (nanokl/rewards.py). When rejection (rollout_rs, nanokl/offline.py)
takes that token out of response_mask, verl's outcome estimators still see the score: they sum
token_level_rewards over the whole row and use the mask only to place the advantage on tokens
(verl/trainer/ppo/core_algos.py at b178a3c). ppo_step's step 5 passes the rollout's mask as `score_mask`
beside the kept mask, so nanokl does the same.

How the tests prove it.
- The issue's example, called as step 5 calls the estimator: one prompt, three 2-token responses scored
  1, 0, 1; log π_old − log μ = 1.0 on response 0's last token, 0 elsewhere; rollout_rs=token_k1 with
  threshold 0.5_2.0 keeps log 0.5 ≤ k1 ≤ log 2, and k1 = −1 there, so offline.rejection_mask drops that
  token alone. Each estimator's advantages equal closed forms of verl's formula in float64 on the
  scores (1, 0, 1): GRPO (1/3)/(1/√3 + 1e-6) = +0.57735 on response 0's kept token (the code before the
  fix gave −0.57735), RLOO +0.5 (was −0.5), REINFORCE++-baseline (2/5)/√(3/10 + 1e-8) = +0.73030 (was
  −0.73030), pass@k 0 everywhere (the best score is tied; was 1/(1/√3 + 1e-6) = 1.73205 on response 2);
  and pass@k with scores 1, 0, 0 gives response 0 1/(1/√3 + 1e-6) (was 0). The rejected token gets 0.
- GAE, REINFORCE++ and ReMax, called the same way, equal verl's loops on the same batch: their returns
  run over the kept tokens, so, as in verl, the reward on the rejected last token is dropped.
- Through train_ppo.ppo_step itself (GRPO config, real `rejection` part with μ shifted by 1 on the
  last token of each group's first response, scores 1, 0, 1, 0 per group): the advantages step 5
  computes equal verl's formulas on the row sums of the rewards, for GRPO, RLOO, REINFORCE++-baseline
  and pass@k, with the rejected tokens at 0.
"""

import math
import statistics
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nanokl.advantages import compute_advantage
from nanokl.offline import rejection_mask
from nanokl.rewards import token_level_scores
from test_advantages import verl_reinforce_pp_loop

ROOT = Path(__file__).resolve().parents[1]
EPS = 1e-6  # verl's epsilon in the GRPO-style estimators
STD = math.sqrt(1 / 3)  # the unbiased std of (1, 0, 1), of (0, 0, 1) and of (1, 0, 0)


# ---- verl's outcome formulas (core_algos.py at b178a3c), float64 python over lists ----------------

def _groups(index):
    groups = {}
    for i, k in enumerate(index):
        groups.setdefault(k, []).append(i)
    return groups


def verl_grpo(rewards, mask, index, norm=True):
    scores = [math.fsum(r) for r in rewards]  # token_level_rewards.sum(dim=-1): the whole row
    adv = [0.0] * len(scores)
    for rows in _groups(index).values():
        s = [scores[i] for i in rows]
        mean, std = (0.0, 1.0) if len(s) == 1 else (statistics.fmean(s), statistics.stdev(s))
        for i in rows:
            adv[i] = (scores[i] - mean) / (std + EPS) if norm else scores[i] - mean
    return np.array(adv)[:, None] * np.array(mask)


def verl_rloo(rewards, mask, index):
    scores = [math.fsum(r) for r in rewards]
    adv = list(scores)
    for rows in _groups(index).values():
        n = len(rows)
        if n > 1:
            mean = statistics.fmean(scores[i] for i in rows)
            for i in rows:
                adv[i] = scores[i] * n / (n - 1) - mean * n / (n - 1)
    return np.array(adv)[:, None] * np.array(mask)


def verl_reinforce_pp_baseline(rewards, mask, index):
    scores = [math.fsum(r) for r in rewards]
    centred = list(scores)
    for rows in _groups(index).values():
        mean = 0.0 if len(rows) == 1 else statistics.fmean(scores[i] for i in rows)
        for i in rows:
            centred[i] = scores[i] - mean
    m = np.array(mask)
    x = np.array(centred)[:, None] * m
    n = m.sum()
    mu = (x * m).sum() / n
    var = (((x - mu) ** 2) * m).sum() / n * n / (n - 1)  # verl's masked_var, unbiased
    return (x - mu) / math.sqrt(var + 1e-8) * m


def verl_grpo_passk(rewards, mask, index, norm=True):
    scores = [math.fsum(r) for r in rewards]
    adv = [0.0] * len(scores)
    for rows in _groups(index).values():
        s = [scores[i] for i in rows]
        order = sorted(range(len(s)), key=lambda j: -s[j])
        gap = s[order[0]] - s[order[1]]
        adv[rows[order[0]]] = gap / (statistics.stdev(s) + EPS) if norm else gap
    return np.array(adv)[:, None] * np.array(mask)


VERL = {"grpo": verl_grpo, "rloo": verl_rloo, "reinforce_plus_plus_baseline": verl_reinforce_pp_baseline,
        "grpo_passk": verl_grpo_passk}


# ---- the issue's example, through the estimator table as step 5 calls it ---------------------------

def issue_batch(scores=(1.0, 0.0, 1.0)):
    """(rewards, rollout mask, kept mask): three 2-token responses to one prompt, each score on its last
    token; log π_old − log μ = 1.0 on response 0's last token, 0 elsewhere; token_k1 in [0.5, 2.0]."""
    mask = torch.ones(3, 2)
    old = torch.tensor([[-0.7, -0.2], [-1.1, -0.4], [-0.3, -0.9]])
    mu = old.clone()
    mu[0, 1] = old[0, 1] - 1.0
    kept = rejection_mask(old, mu, mask, "token_k1", "0.5_2.0")
    assert kept.tolist() == [[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]]  # k1 = −1 < log 0.5: that token alone
    return token_level_scores(list(scores), mask), mask, kept


def step5(name, rewards, rollout_mask, kept, values=None, baselines=None, gamma=1.0, lam=1.0, norm=True):
    """The call of ppo_step's step 5: the kept mask, the rollout's as score_mask, one prompt."""
    alg = SimpleNamespace(gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm)
    index = torch.arange(1).repeat_interleave(3)
    return compute_advantage(name, rewards, kept, values, index, alg, None, baselines=baselines, score_mask=rollout_mask)


# closed forms of verl's formulas on scores (1, 0, 1), response 0's second token rejected
A, B = (1 / 3) / (STD + EPS), (-2 / 3) / (STD + EPS)  # GRPO: (s − 2/3)/(1/√3 + eps)
W = math.sqrt(3 / 10 + 1e-8)  # REINFORCE++-baseline: centred (1/3, −2/3, 1/3) on the 5 kept tokens have
#                               mean −1/15 and unbiased variance 3/10: (2/5, −3/5)/√(3/10 + 1e-8)
ISSUE = {
    ("grpo", True): [[A, 0.0], [B, B], [A, A]],  # +0.5773403, −1.1546806
    ("grpo", False): [[1 / 3, 0.0], [-2 / 3, -2 / 3], [1 / 3, 1 / 3]],
    ("rloo", True): [[0.5, 0.0], [-1.0, -1.0], [0.5, 0.5]],  # s − mean of the others
    ("reinforce_plus_plus_baseline", True): [[0.4 / W, 0.0], [-0.6 / W, -0.6 / W], [0.4 / W, 0.4 / W]],  # ±0.7303
    ("grpo_passk", True): [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]],  # responses 0 and 2 tie for best: gap 0
}


@pytest.mark.parametrize("name,norm", list(ISSUE))
def test_the_issue_example_keeps_the_rejected_responses_score(name, norm):
    rewards, mask, kept = issue_batch()
    adv, ret = step5(name, rewards, mask, kept, norm=norm)
    want = np.array(ISSUE[name, norm])
    np.testing.assert_allclose(adv.double().numpy(), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(want, VERL[name](rewards.double().tolist(), kept.tolist(), [0, 0, 0],
                                                *([norm] if name in ("grpo", "grpo_passk") else [])),
                               rtol=1e-12, atol=1e-15)  # the closed form is verl's formula
    assert adv[0, 1] == 0 and torch.equal(ret, adv)
    if name in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        assert adv[0, 0] > 0  # a right answer is pushed up, however many of its tokens were rejected


def test_passk_the_rejected_response_can_still_be_the_best():
    """Scores 1, 0, 0: the response whose scored token was rejected is the group's only right answer:
    1/(1/√3 + 1e-6) = 1.7320477 on its kept token (the code before the fix saw 0, 0, 0 and gave 0)."""
    rewards, mask, kept = issue_batch((1.0, 0.0, 0.0))
    adv, _ = step5("grpo_passk", rewards, mask, kept)
    want = np.array([[1 / (STD + EPS), 0.0], [0.0, 0.0], [0.0, 0.0]])
    np.testing.assert_allclose(adv.double().numpy(), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(want, verl_grpo_passk(rewards.double().tolist(), kept.tolist(), [0, 0, 0]), rtol=1e-12)


# ---- the token-level estimators: verl drops a rejected token's reward, and so does nanokl -----------

def verl_gae_loop(rewards, values, mask, gamma, lam):
    """verl's compute_gae_advantage_return loop (a masked step keeps nextvalues and lastgaelam), and
    its masked_whiten over the mask; float64."""
    B, T = len(rewards), len(rewards[0])
    adv = np.zeros((B, T))
    for i in range(B):
        nextvalue, lastgaelam = 0.0, 0.0
        for t in reversed(range(T)):
            delta = rewards[i][t] + gamma * nextvalue - values[i][t]
            new = delta + gamma * lam * lastgaelam
            if mask[i][t] > 0:
                nextvalue, lastgaelam = values[i][t], new
            adv[i, t] = lastgaelam
    returns = adv + np.array(values)
    m = np.array(mask)
    n = m.sum()
    mu = (adv * m).sum() / n
    var = (((adv - mu) ** 2) * m).sum() / n * n / (n - 1)
    return (adv - mu) / math.sqrt(var + 1e-8), returns


def test_gae_drops_the_rejected_last_tokens_reward_as_verl_does():
    """verl's GAE skips a masked step's TD error: response 0's kept token sees r_0 − V_0 and a 0
    bootstrap, not its score. nanokl's GAE, given the kept mask, equals that loop on the kept tokens."""
    rewards, mask, kept = issue_batch()
    values = torch.tensor([[0.3, 0.6], [0.2, -0.1], [0.5, 0.4]])
    adv, ret = step5("gae", rewards, mask, kept, values=values, gamma=0.9, lam=0.8)
    want_adv, want_ret = verl_gae_loop(rewards.double().tolist(), values.double().tolist(), kept.tolist(), 0.9, 0.8)
    real = kept.bool().numpy()
    np.testing.assert_allclose(adv.double().numpy()[real], want_adv[real], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ret.double().numpy()[real], want_ret[real], rtol=1e-6, atol=1e-6)
    assert ret[0, 0].item() == pytest.approx(0.0, abs=1e-7)  # A + V = r_0 = 0: the score is not in it


def test_reinforce_plus_plus_and_remax_drop_the_rejected_last_tokens_reward_as_verl_does():
    rewards, mask, kept = issue_batch()
    adv, ret = step5("reinforce_plus_plus", rewards, mask, kept, gamma=0.9)
    want_ret = verl_reinforce_pp_loop(rewards.double().tolist(), kept.tolist(), 0.9)
    real = kept.bool().numpy()
    np.testing.assert_allclose(ret.double().numpy()[real], want_ret[real], atol=1e-7)
    assert ret[0, 0] == 0  # verl resets the running return at the rejected token: its score is gone
    b = torch.tensor([0.25, 0.25, 0.25])
    adv, ret = step5("remax", rewards, mask, kept, baselines=b)
    r, m = rewards.double().numpy(), kept.double().numpy()
    verl_ret = np.flip(np.cumsum(np.flip(r * m, -1), -1), -1)  # (token_level_rewards * response_mask) ...
    np.testing.assert_allclose(ret.double().numpy(), verl_ret, atol=1e-7)
    np.testing.assert_allclose(adv.double().numpy(), verl_ret - 0.25 * m, atol=1e-7)


# ---- through ppo_step ------------------------------------------------------------------------------

def test_ppo_step_advantages_keep_the_scores_rejection_masked(sft_dir, tmp_path, monkeypatch):
    """ppo_step with rollout_rs (the real `rejection` part), μ shifted by 1 on the last real token of
    each group's first response, scores 1, 0, 1, 0 in every group: the advantages step 5 computes equal
    verl's formulas on the row sums of the rewards, 0 on the rejected tokens; for each grouped estimator."""
    import train_ppo
    from nanokl.harness import scoring
    from nanokl.harness.config.load import parse_cli
    from nanokl.harness.run import setup
    rc = "algorithm.rollout_correction."
    run = setup(parse_cli(["--config", str(ROOT / "configs" / "grpo_arith.yaml"), "data.num_train=16", "data.num_val=0",
                           "data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
                           "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.max_response_length=16",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "trainer.logger=[jsonl]",
                           "trainer.val_before_train=false", f"{rc}bypass_mode=false", f"{rc}rollout_rs=token_k1",
                           f"{rc}rollout_rs_threshold='0.5_2.0'", f"actor_rollout_ref.model.path={sft_dir}",
                           f"trainer.default_local_dir={tmp_path}"]))
    assert not run.cfg.algorithm.use_kl_in_reward  # the rewards are the scores: their row sums are the scores
    seen = {}

    def shifted_correct(correct):
        def part(batch, rollout_log_probs):
            mask = batch["response_mask"]
            last = mask.sum(-1).long() - 1
            rows = torch.arange(0, len(mask), 4)
            mu = rollout_log_probs.clone()
            mu[rows, last[rows]] -= 1.0  # log π_old − log μ ≈ 1 there: k1 ≈ −1 < log 0.5, rejected
            w, kept, metrics = correct(batch, mu)
            seen["rollout_mask"], seen["kept"] = mask, kept
            return w, kept, metrics
        return part

    def scripted_scores(tok, out, examples, cfg, *a, **k):
        _, _, rule = scoring.score_batch(tok, out, examples, cfg, *a, **k)
        seq = torch.tensor([1.0, 0.0, 1.0, 0.0]).repeat(len(rule) // 4)
        return token_level_scores(seq, out.response_mask), seq, rule

    def spy(name):
        def call(_, rewards, mask, *a, **k):  # the estimator under test, whatever the config names
            result = compute_advantage(name, rewards, mask, *a, **k)
            seen["rewards"], seen["index"], seen["adv"] = rewards, a[1], result[0]
            return result
        return call

    monkeypatch.setattr(train_ppo, "score_batch", scripted_scores)
    run.rollout_correction = shifted_correct(run.rollout_correction)
    for name in VERL:
        monkeypatch.setattr(train_ppo, "compute_advantage", spy(name))
        train_ppo.ppo_step(run, 0)
        rollout_mask, kept = seen["rollout_mask"], seen["kept"]
        rejected = rollout_mask.bool() & ~kept.bool()
        last = rollout_mask.sum(-1).long() - 1
        assert rejected.sum() == 4 and rejected[torch.arange(0, 16, 4), last[::4]].all()  # those tokens alone
        want = VERL[name](seen["rewards"].double().tolist(), kept.tolist(), seen["index"].tolist())
        np.testing.assert_allclose(seen["adv"].double().numpy(), want, rtol=1e-5, atol=1e-6, err_msg=name)
        assert (seen["adv"][rejected] == 0).all()
        if name != "grpo_passk":  # (pass@k: responses 0 and 2 tie for best, so nobody moves)
            assert (seen["adv"][0, :last[0]] > 0).all(), name  # response 0's right answer is pushed up

"""Advantages: which tokens deserve more probability? GAE (with a critic), and six estimators
without.

Every estimator turns the per-token rewards of a batch of responses into per-token advantages
(what the policy loss pushes on) and returns (what the critic regresses on, when there is one).
They differ in the baseline they subtract. `ESTIMATORS`, at the bottom, maps each name that
`algorithm.adv_estimator` accepts to a function with one signature and says whether it needs a
critic, whether it groups responses by prompt and whether it needs a greedy baseline rollout;
train_ppo.py and the config read only that table, so a new estimator is one function and one
table entry here, plus its test.

| adv_estimator                | baseline                 | whitened     | costs beyond         |
|                              |                          |              | the rollout          |
|------------------------------|--------------------------|--------------|----------------------|
| gae                          | a learned critic V(s_t)  | batch tokens | a critic             |
|                              |                          |              | (forward + update)   |
| grpo                         | group mean (÷ group std) | no           | rollout.n ≥ 2        |
| rloo                         | mean of the group's      | no           | rollout.n ≥ 2        |
|                              | other scores             |              |                      |
| reinforce_plus_plus          | none: whitening centres  | batch tokens | nothing              |
| reinforce_plus_plus_baseline | group mean               | batch tokens | rollout.n ≥ 2        |
| remax                        | the greedy response's    | no           | a 2nd (greedy)       |
|                              | score                    |              | rollout per step     |
| grpo_passk                   | the group's second-best  | no           | rollout.n ≥ 2        |
|                              | score                    |              |                      |

Each mirrors verl's function of the same name (compute_<name>_advantage_return or
compute_<name>_outcome_advantage, verl/trainer/ppo/core_algos.py). Outcome estimators score a
response by Σ_t r_t over its real tokens, selected (nanokl/masked.py), so a NaN or inf under the
mask cannot leak; every estimator but GAE returns exact zeros under the mask. Where they differ
from verl: README, 'Where nanokl differs from verl'.

Two masks. Rejection (rollout_rs, nanokl/offline.py) takes tokens out of response_mask, possibly
the last one, which carries the response's score. verl's outcome estimators (GRPO, RLOO,
REINFORCE++-baseline, pass@k) sum token_level_rewards over the whole row and use the mask only to
place the advantage on tokens, so a response keeps its score whatever was rejected. Here the step
passes the rollout's mask as `score_mask`: the score is Σ_t r_t over those tokens, the advantage
lands on response_mask's (kept) tokens, and REINFORCE++-baseline whitens over the kept tokens, as
verl. GAE, REINFORCE++ and ReMax run over response_mask alone, as verl's do: the reward on a
rejected token is dropped (a rejected last token's score too: the kept tokens before it see a
return without it, as the episode ended there). Without rejection the two masks are equal.

Whitening across ranks. GAE whitens its advantages over the batch. In a distributed run each rank
holds a shard, and whitening with local statistics would make training depend on the number of
GPUs, so GAE and both REINFORCE++ variants whiten with moments (Σx, Σx², n) summed over ranks
(`whiten_stats`, nanokl/masked.py explains the moments; nanokl/engine/dist.py sums them).

GAE (Schulman et al. 2015, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation", arXiv:1506.02438)
----------------------------------------------------------------------------------------
Each response token is an action; the critic predicts V_t. The TD error
δ_t = r_t + γ V_{t+1} − V_t says how much better the step went than predicted, and the
advantage is an exponentially weighted sum of future TD errors:

    A_t = Σ_{l≥0} (γλ)^l δ_{t+l}  computed backwards as  A_t = δ_t + γλ A_{t+1}

λ = 0 gives the one-step TD error (low variance, biased by the critic); λ = 1 gives the Monte
Carlo return minus V_t (unbiased, high variance). The critic's regression target is
returns = A + V (computed *before* whitening). The bootstrap after the last real token is 0:
the episode ends there. A position with mask 0 is skipped: the running V_{t+1} and A_{t+1}
are carried through it unchanged, so right padding never affects real tokens and a mask with
holes in the middle (e.g. tool-output tokens the policy did not generate) chains the real
tokens around them. A masked position itself carries the advantage of the next real token to
its right (0 after the last one); like verl we leave it there and rely on the loss mask.
This mirrors verl's `compute_gae_advantage_return` (verl/trainer/ppo/core_algos.py), which
whitens the advantages with `masked_whiten`.

GRPO (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300, §4.1.2)
----------------------------------------------------------------
No critic: sample G responses per prompt and use the group as the baseline. With score
s_i = Σ_t r_{i,t}, the advantage of every token of response i is

    A_i = (s_i − mean_g(s)) / (std_g(s) + ε)     or   s_i − mean_g(s)  (norm_adv_by_std=False,
                                                                      Dr. GRPO, arXiv:2503.20783)

with the unbiased standard deviation (torch.std's default, as verl). A group of size one gets
mean 0 and std 1 (verl's convention), so its advantage is its own score. Mirrors verl's
`compute_grpo_outcome_advantage`; the returns are the advantages. In a distributed run every
response of a group must live on the same rank.

RLOO (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
Learning from Human Feedback in LLMs", arXiv:2402.14740; Kool et al. 2019)
---------------------------------------------------------------------------
Also no critic, and a baseline that cannot see the sample it judges: each response is compared
with the mean score of the *other* k − 1 responses to its prompt,

    A_i = s_i − (1/(k−1)) Σ_{j≠i} s_j  =  k/(k−1) · (s_i − mean_g(s))

Leaving i out keeps the baseline independent of the action, so the policy gradient stays
unbiased (GRPO's group mean includes s_i, which shrinks every advantage by (k−1)/k, and its
division by the std rescales prompts by how much their scores vary). There is no std
normalisation. A group of size one has no other response: its advantage is its own score (verl's
`compute_rloo_outcome_advantage` does the same). Like GRPO, the returns are the advantages.

REINFORCE++ (Hu 2025, arXiv:2501.03262)
---------------------------------------
No critic and no group: the return-to-go G_t = r_t + γ G_{t+1} over the real tokens, whitened
over all the batch's real tokens (on every rank together); the returns are G. The whitening is
the baseline: it centres every token on the batch's mean return. verl resets the running return
at every masked position, which for right padding only keeps the padding out; a hole in the
middle of a mask (tool output) would also cut the rewards after it off the tokens before it, so
here masked positions are skipped and carry G through, as GAE's are.

REINFORCE++-baseline (same paper): the score minus its group's mean (a lone response keeps its
score, as in GRPO) is every token's value, and is then whitened over the batch's real tokens, so
a long response weighs more in the mean and std than a short one. There is no discount: verl
broadcasts the score, it does not take returns-to-go.

ReMax (Li et al. 2023, arXiv:2310.10505)
----------------------------------------
The baseline is the score b of the *greedy* response to the same prompt: A_t = G_t − b with
G_t = Σ_{t'≥t} r_t' (no discount, as verl). It is unbiased (b does not depend on the sampled
response) and costs a second, greedy rollout per step plus its scoring. The step supplies b
(one per row: the prompt's greedy score, repeated over its rollout.n rows) as `baselines`.

GRPO pass@k (arXiv:2503.19595, the paper verl cites)
---------------------------------------------------
Only the best response of each group moves: it gets r_max − r_second (÷ (std_g + ε) with
norm_adv_by_std_in_grpo), all others 0. With tied best scores that is 0 for everyone, so which
of the tied responses "is" the best does not matter. A group needs ≥ 2 responses.
"""

from typing import NamedTuple

import torch

from nanokl.masked import masked_moments, masked_sum, masked_whiten, zero_masked


@torch.no_grad()
def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam,
                                 whiten_stats=None):
    """GAE advantages (whitened) and returns (un-whitened A + V), both [batch, response_len].

    whiten_stats: None to whiten with this batch's own moments; or a function that receives
        this shard's masked_moments of the raw advantages and returns the global ones
        (dist.py passes an all-reduce), making the result independent of world size.
    """
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        m = mask[:, t]
        # Real token: take the new values. Masked: carry the running ones through unchanged.
        next_value = torch.where(m > 0, values[:, t], next_value)
        next_adv = torch.where(m > 0, adv_t, next_adv)
        advantages[:, t] = next_adv
    return whitened(advantages, response_mask, whiten_stats), advantages + values


def sequence_scores(token_level_rewards, response_mask):
    """Each response's score Σ_t r_t over its real tokens, [batch] (selected: nothing under the
    mask counts)."""
    return masked_sum(token_level_rewards, response_mask, dim=-1)


def whitened(x, response_mask, whiten_stats=None):
    """x whitened with the moments of its real tokens, summed over ranks by `whiten_stats` (None:
    this batch's own); all zeros when the whole batch has fewer than 2 real tokens (rejection,
    rollout_rs, can leave that few): nothing to whiten, no signal."""
    stats = masked_moments(x, response_mask)
    if whiten_stats is not None:
        stats = whiten_stats(stats)
    if stats[2] < 2:
        return torch.zeros_like(x)
    return masked_whiten(x, response_mask, stats=stats)


def whiten_real_tokens(x, response_mask, whiten_stats=None):
    """`whitened`, and exactly 0 under the mask."""
    return zero_masked(whitened(x, response_mask, whiten_stats), response_mask)


def group_stats(index, scores):
    """Per prompt group: (the group number of each row [N], the group's size [G], the sum of its
    scores [G]), from one hashable prompt id per row (a list, numpy array or tensor). Every outcome
    estimator's baseline is made of these."""
    keys = index.tolist() if hasattr(index, "tolist") else list(index)
    if len(keys) != scores.shape[0]:
        raise ValueError(f"index has {len(keys)} ids for {scores.shape[0]} responses")
    group_of = {}
    gid = torch.tensor([group_of.setdefault(k, len(group_of)) for k in keys], device=scores.device)
    zeros = scores.new_zeros(len(group_of))
    return gid, zeros.index_add(0, gid, torch.ones_like(scores)), zeros.index_add(0, gid, scores)


@torch.no_grad()
def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index,
                                   norm_adv_by_std=True, eps=1e-6, score_mask=None):
    """GRPO group-relative advantages [batch, response_len]; returns == advantages.

    index: one hashable prompt id per row (list, numpy array or tensor); rows with equal ids
        form a group.
    score_mask: the tokens whose rewards sum to each score (the rollout's mask, before rejection);
        None: response_mask. The advantages sit on response_mask's tokens.
    """
    scores = sequence_scores(token_level_rewards,
                             response_mask if score_mask is None else score_mask)
    gid, count, total = group_stats(index, scores)
    mean = total / count
    sq_dev = torch.zeros_like(count).index_add(0, gid, (scores - mean[gid]) ** 2)
    std = (sq_dev / (count - 1).clamp(min=1)).sqrt()
    # verl's convention for a lone response: mean 0, std 1, i.e. the advantage is the score.
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)

    adv = scores - mean[gid]
    if norm_adv_by_std:
        adv = adv / (std[gid] + eps)
    advantages = adv.unsqueeze(-1) * response_mask.to(scores.dtype)
    return advantages, advantages


@torch.no_grad()
def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, score_mask=None):
    """RLOO advantages [batch, response_len]: score minus the mean score of the other responses to
    the same prompt (`index`: one id per row); a lone response keeps its score.
    returns == advantages. score_mask: as in GRPO."""
    scores = sequence_scores(token_level_rewards,
                             response_mask if score_mask is None else score_mask)
    gid, count, total = group_stats(index, scores)
    count, total = count[gid], total[gid]
    others_mean = (total - scores) / (count - 1).clamp(min=1)
    adv = torch.where(count > 1, scores - others_mean, scores)
    advantages = adv.unsqueeze(-1) * response_mask.to(scores.dtype)
    return advantages, advantages


@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma,
                                                  whiten_stats=None):
    """REINFORCE++: returns-to-go G_t = r_t + γ G_{t+1} over the real tokens (a masked position
    carries G through), and advantages = G whitened over the real tokens; both
    [batch, response_len]."""
    mask = response_mask.bool()
    rewards = zero_masked(token_level_rewards, mask)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    returns = zero_masked(returns, mask)
    return whiten_real_tokens(returns, mask, whiten_stats), returns


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask,
                                                           index, whiten_stats=None,
                                                           score_mask=None):
    """REINFORCE++-baseline: (score − its group's mean; a lone response keeps its score) on every
    real token, whitened over the real tokens. returns == advantages. score_mask: as in GRPO (the
    whitening reads response_mask)."""
    scores = sequence_scores(token_level_rewards,
                             response_mask if score_mask is None else score_mask)
    gid, count, total = group_stats(index, scores)
    mean = torch.where(count > 1, total / count, 0.0)
    centred = (scores - mean[gid]).unsqueeze(-1).expand(response_mask.shape)
    advantages = whiten_real_tokens(centred, response_mask, whiten_stats)
    return advantages, advantages


@torch.no_grad()
def compute_remax_outcome_advantage(token_level_rewards, response_mask, baselines):
    """ReMax: returns G_t = Σ_{t'≥t} r_t' over the real tokens (no discount) and advantages
    G_t − b, with b = `baselines` [batch], the score of the greedy response to the row's
    prompt."""
    if baselines is None:
        raise ValueError("remax needs `baselines`: the scores of a greedy rollout "
                         "of each row's prompt")
    mask = response_mask.bool()
    returns = zero_masked(zero_masked(token_level_rewards, mask).flip(-1).cumsum(-1).flip(-1), mask)
    b = torch.as_tensor(baselines, dtype=returns.dtype, device=returns.device)
    if b.shape != returns.shape[:1]:
        raise ValueError(f"remax needs one baseline per response: {tuple(b.shape)} for "
                         f"{returns.shape[0]} responses")
    return zero_masked(returns - b.unsqueeze(-1), mask), returns


@torch.no_grad()
def compute_grpo_passk_outcome_advantage(token_level_rewards, response_mask, index,
                                         norm_adv_by_std=True, eps=1e-6, score_mask=None):
    """GRPO pass@k: the best response of each group gets r_max − r_second (÷ (std + eps) with
    norm_adv_by_std, unbiased std), the others 0. returns == advantages. score_mask: as in GRPO."""
    scores = sequence_scores(token_level_rewards,
                             response_mask if score_mask is None else score_mask)
    gid, count, _ = group_stats(index, scores)
    adv = torch.zeros_like(scores)
    for g in range(len(count)):
        rows = (gid == g).nonzero().squeeze(-1)
        if len(rows) < 2:
            raise ValueError(f"grpo_passk needs at least 2 responses per prompt, got {len(rows)}")
        group = scores[rows]
        top, arg = group.topk(2)
        gap = top[0] - top[1]
        adv[rows[arg[0]]] = gap / (group.std() + eps) if norm_adv_by_std else gap
    advantages = adv.unsqueeze(-1) * response_mask.to(scores.dtype)
    return advantages, advantages


def compute_advantage(name, token_level_rewards, response_mask, values, index, alg,
                      whiten_stats=None, baselines=None, score_mask=None):
    """verl's compute_advantage: (advantages, returns) by the estimator `name`
    (algorithm.adv_estimator), each given what it reads. response_mask: the tokens the advantages
    (and GAE, REINFORCE++, ReMax) run over, after rejection; values: the critic's [N, R] (gae);
    index: the prompt id of each row; alg: the config's `algorithm` section (gamma, lam,
    norm_adv_by_std_in_grpo); whiten_stats: the cross-rank moment reduction; baselines: [N], the
    score of a greedy response to each row's prompt (remax); score_mask: the rollout's mask, whose
    tokens' rewards sum to each score in the outcome estimators ('Two masks')."""
    if name == "gae":
        return compute_gae_advantage_return(token_level_rewards, values, response_mask, alg.gamma,
                                            alg.lam, whiten_stats)
    if name == "grpo":
        return compute_grpo_outcome_advantage(token_level_rewards, response_mask, index,
                                              alg.norm_adv_by_std_in_grpo, score_mask=score_mask)
    if name == "rloo":
        return compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, score_mask)
    if name == "reinforce_plus_plus":
        return compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask,
                                                             alg.gamma, whiten_stats)
    if name == "reinforce_plus_plus_baseline":
        return compute_reinforce_plus_plus_baseline_outcome_advantage(
            token_level_rewards, response_mask, index, whiten_stats, score_mask)
    if name == "remax":
        return compute_remax_outcome_advantage(token_level_rewards, response_mask, baselines)
    if name == "grpo_passk":
        return compute_grpo_passk_outcome_advantage(token_level_rewards, response_mask, index,
                                                    alg.norm_adv_by_std_in_grpo,
                                                    score_mask=score_mask)
    raise ValueError(f"unknown adv_estimator {name!r}; valid: {', '.join(ESTIMATORS)}")


class Estimator(NamedTuple):
    """What the rest of the run must know of an estimator: whether it needs a critic; whether it
    compares the responses to one prompt (then rollout.n > 1 and a prompt's responses stay on one
    rank); whether the step must roll out greedily for its `baselines`."""
    needs_critic: bool
    grouped: bool
    needs_greedy_baseline: bool = False


# the names compute_advantage knows (the config validates algorithm.adv_estimator against them)
ESTIMATORS = {
    "gae": Estimator(needs_critic=True, grouped=False),
    "grpo": Estimator(needs_critic=False, grouped=True),
    "rloo": Estimator(needs_critic=False, grouped=True),
    "reinforce_plus_plus": Estimator(needs_critic=False, grouped=False),
    "reinforce_plus_plus_baseline": Estimator(needs_critic=False, grouped=True),
    "remax": Estimator(needs_critic=False, grouped=False, needs_greedy_baseline=True),
    "grpo_passk": Estimator(needs_critic=False, grouped=True),
}

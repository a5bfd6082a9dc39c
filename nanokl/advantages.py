"""Advantages: which tokens deserve more probability? GAE (with a critic), GRPO and RLOO (without).

Every estimator turns the per-token rewards of a batch of responses into per-token advantages
(what the policy loss pushes on) and returns (what the critic regresses on, when there is one).
They differ in the baseline they subtract: a learned critic V(s_t) (GAE), or the other responses
to the same prompt (GRPO). `ESTIMATORS`, at the bottom, maps each name that
`algorithm.adv_estimator` accepts to a function with one signature and says whether it needs a
critic and whether it groups responses by prompt; train_ppo.py and the config read only that
table, so a new estimator is one function and one table entry here, plus its test.

Whitening across ranks. GAE whitens its advantages over the batch. In a distributed run each rank
holds a shard, and whitening with local statistics would make training depend on the number of
GPUs, so GAE whitens with moments (Σx, Σx², n) summed over ranks (`whiten_stats`, nanokl/masked.py
explains the moments; nanokl/dist.py sums them).

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
"""

from typing import Callable, NamedTuple

import torch

from nanokl.masked import masked_moments, masked_whiten


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
    returns = advantages + values

    stats = masked_moments(advantages, response_mask)
    if whiten_stats is not None:
        stats = whiten_stats(stats)
    advantages = masked_whiten(advantages, response_mask, stats=stats)
    return advantages, returns


def group_ids(index, scores):
    """(a group number per row as a tensor, the number of groups) from one hashable prompt id per
    row (a list, numpy array or tensor); the outcome estimators' baselines are per group."""
    keys = index.tolist() if hasattr(index, "tolist") else list(index)
    if len(keys) != scores.shape[0]:
        raise ValueError(f"index has {len(keys)} ids for {scores.shape[0]} responses")
    group_of = {}
    gid = torch.tensor([group_of.setdefault(k, len(group_of)) for k in keys], device=scores.device)
    return gid, len(group_of)


@torch.no_grad()
def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index,
                                   norm_adv_by_std=True, eps=1e-6):
    """GRPO group-relative advantages [batch, response_len]; returns == advantages.

    index: one hashable prompt id per row (list, numpy array or tensor); rows with equal ids
        form a group.
    """
    scores = token_level_rewards.sum(dim=-1)
    gid, n_groups = group_ids(index, scores)
    zeros = scores.new_zeros(n_groups)
    count = zeros.index_add(0, gid, torch.ones_like(scores))
    mean = zeros.index_add(0, gid, scores) / count
    sq_dev = zeros.index_add(0, gid, (scores - mean[gid]) ** 2)
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


# ---------------------------------------------------------------------------------------------
# The table train_ppo.py reads: name -> how to call it, whether it needs a critic, whether it
# compares the responses to one prompt (then rollout.n > 1 and a prompt's responses stay on one
# rank). Every entry is called the same way:
#     fn(token_level_rewards, response_mask, values, index, alg, whiten_stats) -> (advantages, returns)
# values: the critic's [N, R] (None without one); index: the prompt id of each row; alg: the
# config's `algorithm` section; whiten_stats: the cross-rank moment reduction (GAE's whitening).
# ---------------------------------------------------------------------------------------------

class Estimator(NamedTuple):
    fn: Callable
    needs_critic: bool
    grouped: bool


def _gae(token_level_rewards, response_mask, values, index, alg, whiten_stats=None):
    return compute_gae_advantage_return(token_level_rewards, values, response_mask, alg.gamma, alg.lam, whiten_stats)


def _grpo(token_level_rewards, response_mask, values, index, alg, whiten_stats=None):
    return compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, alg.norm_adv_by_std_in_grpo)


@torch.no_grad()
def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index):
    """RLOO advantages [batch, response_len]: score minus the mean score of the other responses to
    the same prompt (`index`: one id per row); a lone response keeps its score. returns == advantages."""
    scores = token_level_rewards.sum(dim=-1)
    gid, n_groups = group_ids(index, scores)
    zeros = scores.new_zeros(n_groups)
    count = zeros.index_add(0, gid, torch.ones_like(scores))[gid]
    total = zeros.index_add(0, gid, scores)[gid]
    others_mean = (total - scores) / (count - 1).clamp(min=1)
    adv = torch.where(count > 1, scores - others_mean, scores)
    advantages = adv.unsqueeze(-1) * response_mask.to(scores.dtype)
    return advantages, advantages


def _rloo(token_level_rewards, response_mask, values, index, alg, whiten_stats=None):
    return compute_rloo_outcome_advantage(token_level_rewards, response_mask, index)


ESTIMATORS = {
    "gae": Estimator(_gae, needs_critic=True, grouped=False),
    "grpo": Estimator(_grpo, needs_critic=False, grouped=True),
    "rloo": Estimator(_rloo, needs_critic=False, grouped=True),
}

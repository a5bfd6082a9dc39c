"""Rewards for a language model: a score per response becomes a reward per token, minus the KL.

Two facts make RL *for language models* different from RL on a game.

1. The environment scores a whole response, once. A rule (is the answer right?) or a reward model
   reads the finished text and returns one scalar per response. PPO wants a reward per action,
   and an action is a token, so the scalar is put on the response's last real token and every
   other token gets 0 (`token_level_scores`, verl's name). Responses are right-padded, so the last
   real token is at position sum(mask) − 1; an empty response has no token to carry it. GAE then
   credits the whole response through the discounted returns (nanokl/advantages.py). A response
   cut off by the length limit before its EOS may pay `missing_eos_penalty` (TRL's name): without
   it a policy learns that rambling past the limit is safe.

2. The policy must stay near the reference it started from. RLHF maximises

       J(π) = E_{y~π}[ score(x, y) ] − β · KL(π ‖ π_ref)        (Ziegler et al. 2019, §2)

   and KL(π‖π_ref) of a response is the sum over its tokens of the per-token KL, so the penalty
   splits over tokens like a reward does. Each token's reward is

       r_t = score_t − β · KL_t,        KL_t = k(log π_old(y_t), log π_ref(y_t))

   with k one of the estimators of nanokl/kl.py (k1 = log π_old − log π_ref by default),
   evaluated at the tokens the rollout sampled (verl's `apply_kl_penalty`). β is steered by a
   controller (nanokl/kl_ctrl.py) that reads one number per step: the per-token KL of each response,
   averaged over the batch's responses (`mean_kl`; verl's `current_kl`). Under torchrun the sums
   are added over ranks (`reduce`), so every rank reads the same KL.

DAPO's overlong reward shaping (Yu et al. 2025, arXiv:2503.14476, §3.4; verl's
`reward_model.overlong_buffer` keys enable, len, penalty_factor). A response cut at the length
limit L_max is usually unfinished, and a hard penalty there punishes sound reasoning that was only
long. DAPO softens it over the last `len` tokens before the limit: with L the response's length,

    penalty(L) = min(−(L − (L_max − len)) / len · penalty_factor, 0)

0 up to L_max − len, then falling linearly to −penalty_factor at L = L_max (and further past it,
never capped), added to the score before it is placed on the last token (`overlong_penalty`).

Two variants replace the sampled estimate:
- the exact per-token KL Σ_v π(v)(log π(v) − log π_ref(v)) from both models' logits
  (`algorithm.kl_penalty=full`; computed micro-batch by micro-batch in nanokl/forwards.py):
  `apply_kl_penalty` takes it as `kl=` instead of two log-probs;
- on responses another policy μ sampled (offline, nanokl/offline.py), the controller reads the
  importance-weighted estimate of the KL under π instead of the plain mean (`offline.weighted_kl`;
  the step's `run.read_kl`, chosen in nanokl/harness/variants.py).
"""

import torch

from nanokl.kl import kl_penalty
from nanokl.masked import masked_mean, zero_masked


def _same(t):
    return t


def token_level_scores(scores, response_mask: torch.Tensor, missing_eos=None,
                       missing_eos_penalty: float = 0.0) -> torch.Tensor:
    """[N, R] float tensor: score_i (minus the penalty if row i has no EOS) at its last real
    token."""
    mask = response_mask.bool()
    scores = torch.as_tensor(scores, dtype=torch.float32, device=mask.device).clone()
    if missing_eos is not None:
        missing = torch.as_tensor(missing_eos, dtype=torch.bool, device=mask.device)
        scores = scores - missing_eos_penalty * missing.float()
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    last = mask.sum(-1) - 1  # -1 for an empty response: it has no token to carry a score
    rows = (last >= 0).nonzero(as_tuple=True)[0]
    out[rows, last[rows]] = scores[rows]
    return out


def mean_kl(kl, response_mask, reduce=_same) -> float:
    """The KL the controller reads: each response's per-token mean, averaged over the responses of
    all ranks (`reduce` sums a tensor over ranks; nan when there are none)."""
    per_response = masked_mean(kl, response_mask, dim=-1).float()
    total = reduce(torch.stack([per_response.sum(),
                                torch.tensor(float(per_response.numel()), device=kl.device)]))
    return (total[0] / total[1]).item() if total[1] > 0 else float("nan")


def apply_kl_penalty(scores, old_log_prob, ref_log_prob, response_mask, beta, kind="kl",
                     reduce=_same, kl=None):
    """verl's apply_kl_penalty: KL_t = kl_penalty(old_log_prob, ref_log_prob, kind) at each sampled
    token, r_t = score_t − β·KL_t (train_ppo.ppo_step's step 4 writes the same lines out).
    `scores`: the [N, R] token-level scores (`token_level_scores`). Returns (token_level_rewards,
    kl per token (0 under the mask), current_kl). `kl`: the per-token KL when it cannot come from
    two log-probs (kind `full`: from both models' whole distributions, forwards.compute_full_kl)."""
    if kl is None:
        kl = kl_penalty(old_log_prob, ref_log_prob, kind)
    kl = zero_masked(kl, response_mask)
    return scores - beta * kl, kl, mean_kl(kl, response_mask, reduce)


def overlong_penalty(response_lengths, max_len, buffer_len, penalty_factor):
    """DAPO's soft length penalty per response (float64 [N]):
    min(−(L − (max_len − buffer_len)) / buffer_len · penalty_factor, 0); add it to the scores
    (verl's DAPO reward manager)."""
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong_buffer.len must be in (0, max_len={max_len}], got {buffer_len}")
    lengths = torch.as_tensor(response_lengths, dtype=torch.float64)
    exceed = lengths - (max_len - buffer_len)
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)

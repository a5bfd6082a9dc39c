"""PPO losses: clipped policy losses (PPO, GSPO, CISPO), the clipped value loss, and how to
average them.

Clipped policy loss (Schulman et al. 2017, "Proximal Policy Optimization Algorithms",
arXiv:1707.06347, eq. 7)
-----------------------------------------------------------------------------------------
The batch was sampled by the old policy; we take several gradient steps on it. The importance
ratio ρ = π_θ(a)/π_old(a) = exp(log_prob − old_log_prob) corrects for the drift, and clipping
removes the incentive to drift far:

    loss = −min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A) = max(−ρA, −clip(ρ)A)

For A > 0 the gain stops at ρ = 1 + ε_high; for A < 0 at ρ = 1 − ε_low. Separate
ε_low/ε_high ("clip-higher", DAPO arXiv:2503.14476) let rare tokens grow faster than they shrink.
For A < 0 and ρ ≫ 1 the loss −ρA is still unbounded, so one stale token can own the step;
dual-clip PPO (Ye et al. 2020, arXiv:1912.09729) caps it:

    A < 0:  loss = min(max(−ρA, −clip(ρ)A), −c·A)      with c = clip_ratio_c > 1

The log-ratio is clamped to [−20, 20] before the exponential so ρ stays finite. Diagnostics, as
in verl's `compute_policy_loss_vanilla`: pg_clipfrac (clipping active), pg_clipfrac_lower (the dual
clip active) and ppo_kl = mean of −log ρ, an estimate of KL(π_old‖π_θ): how far the epochs
have walked from the sampler. With `is_weights` (responses another policy μ sampled,
nanokl/offline.py) each token's loss is multiplied by w = min(π_old/μ, C) first; μ = π_old gives
w = 1, the loss above.

Two more policy losses, one signature (`POLICY_LOSSES`, verl's `actor.policy_loss.loss_mode`)
---------------------------------------------------------------------------------------------
GSPO (Zheng et al. 2025, arXiv:2507.18071) clips a *sequence's* ratio: one response is one action,
its likelihood ratio normalised by its length, s_i = (π_θ(y_i)/π_old(y_i))^(1/|y_i|) =
exp(mean_t log ρ_it). A token-level ratio lets a single noisy token leave the band while its
neighbours stay; s_i moves the whole response in or out together. As in verl's
`compute_policy_loss_gspo`, each token carries s_it = sg[s_i]·π_θ(y_it)/sg[π_θ(y_it)]: its
value is s_i, its gradient s_i·∇log π_θ(y_it), so with A_it = A_i the seq-mean-token-mean
gradient is GSPO's s_i·A_i·mean_t ∇log π_θ(y_it). The loss is
max(−A·s, −A·clip(s, 1 − ε_low, 1 + ε_high)), no dual clip, log s clamped to ≤ 10
(not below), and verl always aggregates it seq-mean-token-mean, whatever loss_agg_mode says: so
does nanokl (the config sets it, with a start-up note), since `global_norm` must then count
sequences. old_log_prob gets no gradient (it only enters through sg[s_i]).

CISPO (MiniMax-M1, arXiv:2506.13585) never drops a token's gradient: PPO's clip zeroes it outside
the band, CISPO clips the *weight* and keeps the REINFORCE term, loss = −sg[clip(ρ, 1 − ε_low,
1 + ε_high)]·A·log π_θ, so d loss/d log π_θ = −clip(ρ)·A everywhere (verl's
`compute_policy_loss_cispo`; any loss_agg_mode). Its value holds log π_θ itself, so only its
gradient means anything. Both report pg_clipfrac (GSPO: the tokens where the clipped term wins;
CISPO: where ρ leaves the band), pg_clipfrac_lower = 0 and ppo_kl as above (GSPO's unclamped).

Clipped value loss (verl's `compute_value_loss`, from OpenAI baselines' ppo2)
---------------------------------------------------------------------------
vclip = V_old + clamp(V − V_old, ±cliprange_value) and
loss = ½·max((V − R)², (vclip − R)²); vf_clipfrac counts the tokens where the clipped error
is strictly larger. Inside the band vclip is V itself: V_old + (V − V_old) rounds to a
neighbouring float and would count as clipped.

Aggregating a [batch, len] loss matrix (verl's `agg_loss`)
---------------------------------------------------------
    token-mean               Σ m·l / N_tok               every token weighs the same
    seq-mean-token-sum       Σ_i (Σ_t m·l) / N_seq        every sequence's sum weighs the same
    seq-mean-token-mean      Σ_i (Σ_t m·l / n_i) / N_seq  every sequence weighs the same (GRPO)
    seq-mean-token-sum-norm  Σ_i (Σ_t m·l / H) / N_seq    Dr. GRPO (arXiv:2503.20783): a
                                                          constant H removes the length bias
N_tok = the mask's sum, N_seq = the rows (an empty row counts and adds 0), H = the mask's width.
Split into micro-batches (or ranks), each part would divide by its own count: pass `global_norm`,
the mini-batch's token or sequence count, and the parts' gradients add up to the mini-batch mean
(times W if it counts all W ranks, since DDP averages: verl's `* dp_size`). Pass `horizon` so H
does not follow each micro-batch's padding. Metrics are detached 0-d tensors (no sync per metric).

Masks select, inputs first
--------------------------
"m·l" reads "l where m" (nanokl/masked.py): a padded entry may hold ±inf or NaN (a −inf
log-prob), and 0·inf = NaN. Selecting the loss matrix keeps it out of the value, but the backward
would still multiply the mask's 0 by the padded entry's derivative (2(V − R) with R = inf). So
both losses select their *inputs* (log-probs, advantages, weights, values, returns) before any
arithmetic: padded entries hold 0, get a gradient of exactly 0, and the real entries are untouched,
bit for bit.

Log-probabilities and entropy from logits
-----------------------------------------
log π(y) = z_y − logsumexp(z): log_softmax(z).gather(y) would keep a [B, T, V] tensor alive for
the backward, gathering z_y keeps nothing beyond the logits. Entropy H = −Σ p log p =
logsumexp(z) − Σ softmax(z)·z. Both compute in the logits' dtype (pass float32 for float32).
"""


import torch

from nanokl.masked import masked_mean, zero_masked

# How agg_loss may reduce a loss matrix (the config validates loss_agg_mode against this list).
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                  "seq-mean-token-sum-norm")


def agg_loss(loss_mat, loss_mask, loss_agg_mode, global_norm=None, horizon=None):
    """Reduce a [batch, len] loss matrix to a scalar; see the module docstring for each mode.

    The mask selects: inf/NaN at masked entries never reach the loss, and their gradient is 0.
    An all-masked call returns 0. Differs from verl: see README, 'Where nanokl differs from verl'.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid modes are "
                         f"{', '.join(LOSS_AGG_MODES)}")
    mask = loss_mask.to(loss_mat.dtype)
    token_sums = zero_masked(loss_mat, loss_mask).sum(dim=-1)
    if loss_agg_mode == "token-mean":
        norm = mask.sum().clamp(min=1) if global_norm is None else global_norm
        return token_sums.sum() / norm

    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = token_sums
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_losses = token_sums / mask.sum(dim=-1).clamp(min=1)
    else:  # seq-mean-token-sum-norm
        seq_losses = token_sums / (loss_mask.shape[-1] if horizon is None else horizon)
    norm = loss_mat.shape[0] if global_norm is None else global_norm
    return seq_losses.sum() / norm


def compute_policy_loss(old_log_prob, log_prob, advantages, response_mask,
                        clip_ratio_low, clip_ratio_high, clip_ratio_c=3.0,
                        loss_agg_mode="token-mean", global_norm=None, horizon=None,
                        is_weights=None):
    """Dual-clip PPO policy loss. Returns (loss, {pg_clipfrac, pg_clipfrac_lower, ppo_kl}).

    is_weights: optional [N, R] per-token importance weights (no grad) for responses another
    policy μ sampled (nanokl/offline.py); each token's loss is multiplied by its weight before
    aggregation. None leaves the loss exactly as it was.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for the dual clip, got {clip_ratio_c}")
    # Select the inputs before any arithmetic, so a padded inf/NaN never meets the mask's 0 in the
    # backward.
    old_log_prob, log_prob, advantages = (zero_masked(x, response_mask)
                                          for x in (old_log_prob, log_prob, advantages))
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = torch.minimum(loss_ppo, -advantages * clip_ratio_c)
    negative = advantages < 0
    loss_mat = torch.where(negative, loss_dual, loss_ppo)
    if is_weights is not None:
        loss_mat = zero_masked(is_weights, response_mask) * loss_mat

    loss = agg_loss(loss_mat, response_mask, loss_agg_mode, global_norm, horizon)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(loss_mat.dtype),
                                       response_mask),
            "pg_clipfrac_lower": masked_mean(
                (negative & (loss_ppo > -advantages * clip_ratio_c)).to(loss_mat.dtype),
                response_mask
            ),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
        }
    return loss, {k: v.detach() for k, v in metrics.items()}


def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask,
                             clip_ratio_low, clip_ratio_high, clip_ratio_c=3.0,
                             loss_agg_mode="seq-mean-token-mean", global_norm=None, horizon=None,
                             is_weights=None):
    """GSPO's sequence-ratio clipped loss (verl's `gspo`). compute_policy_loss's signature and
    metrics; clip_ratio_c and horizon are unused (no dual clip; always seq-mean-token-mean)."""
    if loss_agg_mode != "seq-mean-token-mean":
        raise ValueError(f"gspo aggregates seq-mean-token-mean (as verl does, whatever "
                         f"loss_agg_mode says); set loss_agg_mode to it, got {loss_agg_mode!r}")
    old_log_prob, log_prob, advantages = (zero_masked(x, response_mask)
                                          for x in (old_log_prob, log_prob, advantages))
    # 0 on padded tokens, so the row sum is the sum over real ones
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = (log_ratio.sum(dim=-1)
                     / response_mask.to(log_ratio.dtype).sum(dim=-1).clamp(min=1))
    # value log s_i, gradient d/d log π_θ(y_it) = 1: sg[s_i]·π_θ/sg[π_θ] in log space
    log_seq_ratio = torch.clamp(log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1),
                                max=10.0)
    seq_ratio = torch.exp(log_seq_ratio)

    loss_unclipped = -advantages * seq_ratio
    loss_clipped = -advantages * torch.clamp(seq_ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    if is_weights is not None:
        loss_mat = zero_masked(is_weights, response_mask) * loss_mat

    loss = agg_loss(loss_mat, response_mask, loss_agg_mode, global_norm, horizon)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(loss_mat.dtype),
                                       response_mask),
            "pg_clipfrac_lower": loss_mat.new_zeros(()),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
        }
    return loss, {k: v.detach() for k, v in metrics.items()}


def compute_policy_loss_cispo(old_log_prob, log_prob, advantages, response_mask,
                              clip_ratio_low, clip_ratio_high, clip_ratio_c=3.0,
                              loss_agg_mode="token-mean", global_norm=None, horizon=None,
                              is_weights=None):
    """CISPO's clipped-weight REINFORCE loss −sg[clip(ρ)]·A·log π_θ (verl's `cispo`).
    compute_policy_loss's signature and metrics; clip_ratio_c is unused (no dual clip)."""
    old_log_prob, log_prob, advantages = (zero_masked(x, response_mask)
                                          for x in (old_log_prob, log_prob, advantages))
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    # a weight, not a path
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high).detach()
    loss_mat = -clipped_ratio * advantages * log_prob
    if is_weights is not None:
        loss_mat = zero_masked(is_weights, response_mask) * loss_mat

    loss = agg_loss(loss_mat, response_mask, loss_agg_mode, global_norm, horizon)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((ratio != clipped_ratio).to(loss_mat.dtype), response_mask),
            "pg_clipfrac_lower": loss_mat.new_zeros(()),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
        }
    return loss, {k: v.detach() for k, v in metrics.items()}


# actor.policy_loss.loss_mode -> loss; one signature: (old_log_prob, log_prob, advantages,
# response_mask, clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode, global_norm, horizon,
# is_weights)
POLICY_LOSSES = {
    "vanilla": compute_policy_loss,
    "gspo": compute_policy_loss_gspo,
    "cispo": compute_policy_loss_cispo,
}


def compute_value_loss(vpreds, returns, values, response_mask, cliprange_value,
                       loss_agg_mode="token-mean", global_norm=None, horizon=None):
    """Clipped value loss ½·max((V − R)², (V_clip − R)²). Returns (loss, {vf_clipfrac})."""
    vpreds, returns, values = (zero_masked(x, response_mask)
                               for x in (vpreds, returns, values))  # select first
    delta = vpreds - values
    outside = delta.abs() > cliprange_value
    vpred_clipped = torch.where(outside, values + delta.clamp(-cliprange_value, cliprange_value),
                                vpreds)
    err_unclipped = (vpreds - returns) ** 2
    err_clipped = (vpred_clipped - returns) ** 2
    loss_mat = torch.maximum(err_unclipped, err_clipped)
    loss = 0.5 * agg_loss(loss_mat, response_mask, loss_agg_mode, global_norm, horizon)
    with torch.no_grad():
        clipfrac = masked_mean((err_clipped > err_unclipped).to(loss_mat.dtype), response_mask)
    return loss, {"vf_clipfrac": clipfrac.detach()}


def entropy_from_logits(logits):
    """Entropy of softmax(logits) over the last dim: logsumexp(z) − Σ softmax(z)·z."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


def logprobs_from_logits(logits, labels):
    """log softmax(logits)[labels] as z_label − logsumexp(z), without a [.., V] log-softmax."""
    label_logits = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return label_logits - torch.logsumexp(logits, dim=-1)

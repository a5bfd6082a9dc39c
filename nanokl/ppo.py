"""PPO losses: the clipped policy loss, the clipped value loss, and how to average them.

Clipped policy loss (Schulman et al. 2017, "Proximal Policy Optimization Algorithms",
arXiv:1707.06347, eq. 7)
-----------------------------------------------------------------------------------------
The batch was sampled by the old policy; we take several gradient steps on it. The
importance ratio ρ = π_θ(a)/π_old(a) = exp(log_prob − old_log_prob) corrects for the drift,
and clipping removes the incentive to drift far:

    loss = −min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A) = max(−ρA, −clip(ρ)A)

For A > 0 the gain stops at ρ = 1 + ε_high; for A < 0 it stops at ρ = 1 − ε_low. Separate
ε_low/ε_high ("clip-higher", DAPO arXiv:2503.14476) let rare tokens grow faster than they
shrink. One hole remains: for A < 0 and ρ ≫ 1 the loss −ρA grows without bound, so a single
stale token can dominate the step. Dual-clip PPO (Ye et al. 2020, arXiv:1912.09729) caps it:

    A < 0:  loss = min(max(−ρA, −clip(ρ)A), −c·A)      with c = clip_ratio_c > 1

Before the exponential the log-ratio is clamped to [−20, 20] so ρ stays finite.

Diagnostics, as in verl's `compute_policy_loss_vanilla` (verl/trainer/ppo/core_algos.py):
pg_clipfrac = fraction of tokens where the clipped term is strictly larger (clipping active);
pg_clipfrac_lower = fraction where the dual clip is active (A < 0 and the clipped loss exceeds
−c·A); ppo_kl = masked mean of −(log_prob − old_log_prob) (the clamped log-ratio), an
estimate of KL(π_old‖π_θ) that tells how far the epochs have walked from the sampler.

Clipped value loss (verl's `compute_value_loss`, from OpenAI baselines' ppo2)
---------------------------------------------------------------------------
The critic is kept near its old predictions the same way:
vclip = V_old + clamp(V − V_old, −cliprange_value, +cliprange_value) and
loss = ½·max((V − R)², (vclip − R)²). vf_clipfrac is the fraction of tokens where the clipped
error is strictly larger. Inside the band vclip is V itself, not V_old + (V − V_old): that sum
rounds to a neighbouring float, and its error, a hair above (V − R)², would count as clipped — a
count that then depends on how the batch happened to be split.

Aggregating a [batch, len] loss matrix (verl's `agg_loss`)
---------------------------------------------------------
    token-mean               Σ m·l / N_tok               every token weighs the same
    seq-mean-token-sum       Σ_i (Σ_t m·l) / N_seq        every sequence's sum weighs the same
    seq-mean-token-mean      Σ_i (Σ_t m·l / n_i) / N_seq  every sequence weighs the same (GRPO)
    seq-mean-token-sum-norm  Σ_i (Σ_t m·l / H) / N_seq    Dr. GRPO (arXiv:2503.20783): a
                                                          constant H removes the length bias
Defaults: N_tok = mask sum of this call, N_seq = rows of this call (empty rows included, they
contribute 0), H = loss_mask.shape[-1]. A row with n_i = 0 contributes 0 (n_i clamped to 1).
"m·l" is read as "l where m": the mask selects (nanokl/masked.py's `zero_masked`), so a padded
position holding inf or NaN (a −inf log-prob, a KL estimate built from it) adds nothing to the
loss and gets a gradient of exactly 0, where a product would give 0·inf = NaN.
With micro-batching or data parallelism the local denominators are wrong: each micro-batch
would be normalized by its own count. Pass `global_norm` (the token count for token-mean, the
sequence count for seq-mean-*, of the whole mini-batch) and the function divides by exactly
that number; summing the micro-batch gradients then gives the mini-batch mean. DDP's all-reduce
*averages* gradients over W ranks, so when global_norm counts all ranks multiply the loss by W
(verl's `* dp_size`). Pass `horizon` (e.g. the configured max response length) so H does not
change with the padding of each micro-batch. `global_norm`/`horizon` may be numbers or 0-d
tensors; the returned metrics are always plain local masked means.

Where nanokl differs from verl's agg_loss (verl/trainer/ppo/core_algos.py):
  * seq-mean-token-sum-norm divides by the number of sequences N_seq as well as by H: a mean
    over responses of Σ_t m·l / H, the Dr. GRPO objective. The verl agg_loss quoted in verl
    issue #3741 divides Σ_i Σ_t m·l by H only, so its loss and gradient grow with the batch
    size (newer verl also divides by the global batch size).
  * Empty rows (all-masked responses) count in the seq-mean-* denominator N_seq: they
    contribute 0 and are counted. verl, when it counts the sequences itself, leaves fully
    masked ones out.
  * An all-masked call returns 0, not NaN: N_tok is clamped to 1 and N_seq counts the empty
    rows, where verl's local counts are 0 and 0/0 = NaN. A global_norm passed in is used as
    given, so a global_norm of 0 still divides by 0.

Metric type: every metric is a detached 0-d tensor on the loss's device; the caller decides
when to `.item()` (one sync per step instead of one per metric per micro-batch).

Responses another policy sampled (decoupled PPO)
-----------------------------------------------
When the batch was sampled by a behaviour policy μ rather than by π_old (logged responses, an
inference engine whose numerics differ), `is_weights` multiplies each token's loss by a
truncated importance weight w_t = min(π_old(y_t)/μ(y_t), C) before aggregation; the clip stays
relative to π_old. nanokl/offline.py derives it and computes the weights; μ = π_old gives
w = 1 and exactly the loss above.

Log-probabilities and entropy from logits
-----------------------------------------
log π(y) = z_y − logsumexp(z). Computing it as log_softmax(z).gather(y) keeps the whole
[B, T, V] log-softmax alive until backward (its gradient is built from its output); gathering
z_y and subtracting logsumexp keeps nothing of size V beyond the logits, which the model holds
anyway. Entropy H = −Σ p log p = logsumexp(z) − Σ softmax(z)·z (since log p = z − logsumexp).
Both compute in the dtype of the logits; pass float32 logits for float32 precision.

How the tests prove it (tests/test_ppo.py)
-----------------------------------------
The policy loss equals a per-token python reference written branch by branch, on inputs built
to hit every clip branch (each branch asserted hit); the three metrics equal their definitions;
the gradient in the unclipped region equals −A·ρ per token (token-mean times the token count)
and is 0 where clipped. Value loss and vf_clipfrac likewise; all four agg_loss modes (with and
without global_norm/horizon) equal python-loop reductions; entropy and logprobs equal float64
−Σp log p and log_softmax-gather. With NaN, +inf or −inf under the mask, every agg_loss mode
equals the python reduction of the real entries, with a gradient of exactly 0 at the masked
ones; a padded −inf log-prob (alone, or against a −inf old log-prob: a NaN log-ratio) leaves
the policy loss, its metrics and its gradient finite and equal to those with a 0 there, and
an infinite padded value prediction leaves the value loss finite.
"""

import torch

from nanokl.masked import masked_mean, zero_masked

# How agg_loss may reduce a loss matrix (the config validates loss_agg_mode against this list).
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(loss_mat, loss_mask, loss_agg_mode, global_norm=None, horizon=None):
    """Reduce a [batch, len] loss matrix to a scalar; see the module docstring for each mode.

    The mask selects: inf/NaN at masked entries never reach the loss, and their gradient is 0.
    Unlike verl: seq-mean-token-sum-norm divides by the number of sequences too (Dr. GRPO;
    verl issue #3741), all-masked rows count in the seq-mean-* denominators, and an
    all-masked call returns 0, not NaN.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid modes are {', '.join(LOSS_AGG_MODES)}")
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
                        loss_agg_mode="token-mean", global_norm=None, horizon=None, is_weights=None):
    """Dual-clip PPO policy loss. Returns (loss, {pg_clipfrac, pg_clipfrac_lower, ppo_kl}).

    is_weights: optional [N, R] per-token importance weights (no grad) for responses another
    policy μ sampled (nanokl/offline.py); each token's loss is multiplied by its weight before
    aggregation. None leaves the loss exactly as it was.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for the dual clip, got {clip_ratio_c}")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)

    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = torch.minimum(loss_ppo, -advantages * clip_ratio_c)
    negative = advantages < 0
    loss_mat = torch.where(negative, loss_dual, loss_ppo)
    if is_weights is not None:  # the mask still selects in agg_loss: a 0 weight times a NaN never leaks
        loss_mat = is_weights * loss_mat

    loss = agg_loss(loss_mat, response_mask, loss_agg_mode, global_norm, horizon)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(loss_mat.dtype), response_mask),
            "pg_clipfrac_lower": masked_mean(
                (negative & (loss_ppo > -advantages * clip_ratio_c)).to(loss_mat.dtype), response_mask
            ),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
        }
    return loss, {k: v.detach() for k, v in metrics.items()}


def compute_value_loss(vpreds, returns, values, response_mask, cliprange_value,
                       loss_agg_mode="token-mean", global_norm=None, horizon=None):
    """Clipped value loss ½·max((V − R)², (V_clip − R)²). Returns (loss, {vf_clipfrac})."""
    delta = vpreds - values
    outside = delta.abs() > cliprange_value
    vpred_clipped = torch.where(outside, values + delta.clamp(-cliprange_value, cliprange_value), vpreds)
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

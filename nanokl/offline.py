"""Offline PPO: learning from responses another policy sampled, with truncated importance weights.

The offline setting
-------------------
Offline ("logged") RLHF trains from (prompt, response) pairs that a behaviour policy μ sampled
earlier (the warm start, an older checkpoint, a vLLM rollout with its log-probs) and samples
nothing in the loop. The PPO step is unchanged but for whose expectation the loss estimates.

The decoupled objective (Hilton, Cobbe, Schulman 2021, "Batch size-invariance for policy
optimization", arXiv:2110.00641)
-------------------------------------------------------------------------------------------
Each step recomputes the current policy's log-probs on the logged tokens: that is π_old, the
*proximal* policy, as in verl. PPO's surrogate is an expectation under π_old; the data come from
μ. Importance sampling rewrites

    E_{y~π_old}[ Σ_t f_t ] = E_{y~μ}[ Σ_t (Π_{s≤t} π_old(y_s)/μ(y_s)) f_t ],

and keeping only token t's own ratio (see bias (c) below) gives decoupled PPO:

    J(θ) = E_{y~μ}[ Σ_t w_t · min(ρ_t A_t, clip(ρ_t, 1 − ε, 1 + ε) A_t) ],
    ρ_t = π_θ(y_t)/π_old(y_t),     w_t = min(π_old(y_t)/μ(y_t), C).

ρ is the trust region: the clip keeps π_θ near π_old whatever μ was. w, the off-policy correction,
is a constant within the step (no gradient), so the clip alone bounds the epochs; with π_θ/μ inside
one clip, a μ far from π would put every token outside the band. At θ = θ_old the gradient is
Σ_t w_t A_t ∇log π_θ(y_t). Per token and truncated: the product of t ratios has a variance that
grows exponentially with the length, the per-token ratio a bounded one where π_old ≈ μ, and
capping it at C (truncated IS, Ionides 2008, J. Comput. Graph. Stat. 17(2); verl's
rollout_is=token, rollout_is_threshold=2.0) bounds every weight, biased where π_old/μ > C.

Ordinary PPO is μ = π_old: exp(0) = 1 and min(1, C) = 1 for C ≥ 1 (C < 1 is refused), so w = 1 and
the loss and gradient are bit for bit PPO's. Without logged log-probs take μ = π_ref: the SFT model
that usually wrote the responses is the reference, whose log-probs are computed anyway, and w = 1
at step 0. If the responses came from elsewhere every weight is off by μ_true/π_ref; truncation
caps what one token can contribute. Log the behaviour log-probs when you can.

The KL the controller sees
--------------------------
On logged tokens the per-token estimates k(log π_old, log π_ref) of nanokl/kl.py average to a KL
under μ, not π: a plain mean of k1 estimates Σ μ log(π/π_ref), not a divergence at all. We reweight
with the same truncated weights, self-normalised (SNIS):

    num = Σ_i (1/n_i) Σ_t w_it k_it,    den = Σ_i (1/n_i) Σ_t w_it,    KL ≈ num / den,

n_i the token count of response i. With w ≡ 1 this is the online definition, the mean over
responses of per-token means; an empty response adds 0 to num and 1 to den, as it adds a 0 to the
online mean. The sums add across ranks (all-reduce (num, den), then divide). Its biases:
  (a) self-normalisation: a ratio of unbiased sums; consistent, O(1/N) bias.
  (b) truncation: at one position the estimate tends to
          Σ_v μ(v) min(π(v)/μ(v), C) k(v) / Σ_v μ(v) min(π(v)/μ(v), C) = E_π[g k] / E_π[g],
      g = min(1, Cμ/π), a bias of Cov_π(k, g)/E_π[g]: low when the tokens π now favours over μ
      (small g) are the high-KL ones, the usual case; for μ = π_ref and k1 always, since
      g = min(1, C·e^{−k1}) decreases with k1.
  (c) prefixes: a per-token weight corrects which token is drawn at a logged prefix, not which
      prefixes (nor lengths) π would reach, which needs the exploding product of ratios; its sign
      depends on whether π's own prefixes diverge from π_ref more or less than μ's.
For kl_penalty='full' (the exact KL over the vocabulary) no token is sampled for the estimate:
pass weights of 1 on the real tokens; only (c) remains. Differs from verl: see README, 'Where
nanokl differs from verl'.
"""

import torch

from nanokl.masked import masked_sum, zero_masked


def truncated_is_weights(old_log_prob, behaviour_log_prob, response_mask, threshold=2.0):
    """[N, R] weights min(π_old/μ, threshold) on real tokens, 0 under the mask; detached.

    The log-ratio is clamped to [−20, 20] before exp, as in the PPO ratio. threshold >= 1, so
    that μ = π_old gives weights of exactly 1 (ordinary PPO)."""
    if not threshold >= 1.0:
        raise ValueError(f"rollout_is_threshold must be >= 1 (so that mu = pi_old gives weight 1), got {threshold}")
    log_ratio = torch.clamp(old_log_prob.detach() - behaviour_log_prob.detach(), min=-20.0, max=20.0)
    return zero_masked(torch.clamp(torch.exp(log_ratio), max=threshold), response_mask)


def is_sums(weights, response_mask, threshold):
    """float64 tensor [n, Σw, Σw², #(w >= threshold)] over the real tokens; add across ranks."""
    w = zero_masked(weights.detach().double(), response_mask)
    truncated = zero_masked(w >= threshold, response_mask)
    return torch.stack([response_mask.double().sum(), w.sum(), (w * w).sum(), truncated.double().sum()])


def is_metrics_from_sums(sums):
    """{is_mean, is_clipfrac, is_ess} from (possibly all-reduced) is_sums: the mean weight, the
    fraction of tokens truncated, and the effective sample size fraction (Σw)²/(n·Σw²) in (0, 1]."""
    n, s1, s2, k = sums.unbind()
    tiny = torch.finfo(sums.dtype).tiny  # an all-masked batch gives 0s, not NaN
    return {"is_mean": s1 / n.clamp(min=1), "is_clipfrac": k / n.clamp(min=1), "is_ess": s1 * s1 / (n * s2).clamp(min=tiny)}


def is_metrics(weights, response_mask, threshold):
    """The IS metrics of this batch alone (is_metrics_from_sums of is_sums)."""
    return is_metrics_from_sums(is_sums(weights, response_mask, threshold))


def weighted_kl_sums(kl, weights, response_mask):
    """float64 tensor [num, den] of the SNIS KL estimate: num = Σ_i (1/n_i) Σ_t w_it k_it,
    den = Σ_i (1/n_i) Σ_t w_it, with an empty response counting 1 in den (see the docstring)."""
    n = response_mask.double().sum(dim=-1)
    w = weights.detach().double()
    num = masked_sum(w * kl.detach().double(), response_mask, dim=-1) / n.clamp(min=1)
    den = torch.where(n > 0, masked_sum(w, response_mask, dim=-1) / n.clamp(min=1), 1.0)
    return torch.stack([num.sum(), den.sum()])


def weighted_kl(kl, weights, response_mask, reduce=lambda s: s):
    """SNIS estimate of the per-token KL under π from tokens μ sampled: num/den of
    reduce(weighted_kl_sums(...)); pass reduce=dist.all_reduce to sum over ranks. A 0-d tensor."""
    num, den = reduce(weighted_kl_sums(kl, weights, response_mask)).unbind()
    return num / den.clamp(min=torch.finfo(den.dtype).tiny)


def behaviour_log_probs(rollout_log_probs, ref_log_probs):
    """μ's log-prob of each token: the sampler's where it is known, the reference's where it is NaN
    (a logged file without log-probs: μ = π_ref, as the docstring argues)."""
    return torch.where(torch.isnan(rollout_log_probs), ref_log_probs, rollout_log_probs)

"""Offline PPO: learning from responses another policy sampled, with truncated importance weights.

The offline setting
-------------------
Online PPO samples every batch from the policy it trains. Offline ("logged") RLHF trains from a
file of (prompt, response) pairs that some behaviour policy μ sampled earlier (the warm start,
an older checkpoint, a vLLM rollout that dumped its per-token log-probs) and samples nothing in
the loop. The rest of the PPO step is unchanged: score, forwards, the KL in the reward, the
advantages, the clipped update. What changes is whose expectation the loss estimates.

The decoupled objective (Hilton, Cobbe, Schulman 2021, "Batch size-invariance for policy
optimization", arXiv:2110.00641)
-------------------------------------------------------------------------------------------
At the start of each step the trainer recomputes the log-probs of the current policy on the
logged tokens: that is π_old, the *proximal* policy, as in verl. PPO's surrogate is an
expectation over responses of π_old; the data come from μ. Importance sampling rewrites

    E_{y~π_old}[ Σ_t f_t ] = E_{y~μ}[ Σ_t (Π_{s≤t} π_old(y_s)/μ(y_s)) f_t ],

and keeping only the ratio of token t itself (see bias (c) below) gives decoupled PPO:

    J(θ) = E_{y~μ}[ Σ_t w_t · min(ρ_t A_t, clip(ρ_t, 1 − ε, 1 + ε) A_t) ],
    ρ_t = π_θ(y_t)/π_old(y_t),     w_t = min(π_old(y_t)/μ(y_t), C).

Two ratios, two jobs. ρ is the trust region: the clip keeps π_θ near π_old whatever μ was. w is
the off-policy correction: how much more (or less) likely π_old makes this token than μ did.
w is computed from π_old, not π_θ: it is a constant within the step (no gradient flows through
it), so the clip alone still bounds how far the epochs move. Put π_θ/μ inside one clip instead
and, with μ far from π, every token would sit outside the band and nothing would learn. At θ =
θ_old the gradient is Σ_t w_t A_t ∇log π_θ(y_t): the policy gradient under π_old, estimated
from μ's samples.

Why per token, why truncated. The exact weight of token t is the product of t ratios; its
variance grows exponentially with the length, so one long response would own the batch. The
per-token ratio alone has bounded variance where π_old and μ are close, and capping it at C
(truncated importance sampling, Ionides 2008, J. Comput. Graph. Stat. 17(2); verl's
algorithm.rollout_correction.rollout_is=token with rollout_is_threshold, default 2.0) bounds
every weight, and so the variance, at the price of a bias on tokens where π_old/μ > C.

When it is ordinary PPO. With μ = π_old the log-ratio is exactly 0, exp(0) = 1 exactly, and
min(1, C) = 1 for C ≥ 1 (hence C < 1 is refused): w = 1 on every real token and 1·x = x, so
the loss and its gradient are bit for bit today's. Online nanokl with μ = the rollout's own
log-probs is this case up to the inference engine's numerics, which the weights then correct.

No logged log-probs: μ = π_ref. The logged responses of RLHF usually come from the SFT model,
and that model is the reference; its log-probs are computed each step anyway (the ref forward),
so the weight costs nothing, and at step 0 (π_old = π_ref) it is exactly 1. If the responses
came from elsewhere, every weight is off by the factor μ_true/π_ref; truncation at C caps what
one token can contribute. Log the behaviour log-probs when you can.

The KL the controller sees
--------------------------
On logged tokens, the per-token estimates k(log π_old, log π_ref) of nanokl/kl.py (k1 = log π_old
− log π_ref, k3, ...) average to a KL under μ, not under π: a plain mean of k1 estimates
Σ μ log(π/π_ref), which is not a divergence at all (it can be negative). We reweight with the
same truncated weights and normalise by their sum (self-normalised importance sampling, SNIS):

    num = Σ_i (1/n_i) Σ_t w_it k_it,    den = Σ_i (1/n_i) Σ_t w_it,    KL ≈ num / den,

n_i the token count of response i. With w ≡ 1 this is the online definition, the mean over
responses of each response's per-token mean; an empty response (n_i = 0) has no tokens and
the weight of an empty product, 1, so it adds 0 to num and 1 to den, as it adds a 0 to the
online mean. The sums add across ranks, so the caller all-reduces (num, den) and divides. Its
biases, honestly:
  (a) self-normalisation: num/den is a ratio of unbiased sums; consistent, O(1/N) bias.
  (b) truncation: at one position the estimate tends to
          Σ_v μ(v) min(π(v)/μ(v), C) k(v) / Σ_v μ(v) min(π(v)/μ(v), C)
      = E_π[g k] / E_π[g]  with g = min(1, Cμ/π),
      so its bias is Cov_π(k, g)/E_π[g]. It is biased low when the tokens π now favours much
      more than μ did (small g) are the high-KL ones, which is the usual case; for μ = π_ref
      and k1 it is always so, since g = min(1, C·e^{−k1}) decreases with k1 (a covariance of
      an increasing and a decreasing function of one variable is ≤ 0).
  (c) prefixes: a per-token weight corrects which token is drawn at a logged prefix, not which
      prefixes (nor which lengths n_i) π would have reached; that needs the product of the
      ratios along the prefix, whose variance explodes with the length. The sign of this bias
      is not fixed in general: it depends on whether π's own prefixes are more or less
      divergent from π_ref than μ's.
For kl_penalty='full' (the exact KL over the vocabulary at each position) no token is sampled
for the estimate, so no token weight is needed: pass weights of 1 on the real tokens; only (c)
remains.

How the tests check it (tests/test_offline.py)
---------------------------------------------
The weights equal a float64 loop of min(exp(clamp(old − μ)), C) (truncation hit and not, NaN
under the mask gives 0); the weighted policy loss equals a per-token loop branch by branch in
all four loss_agg_modes, and its gradient the closed form −w·A·ρ (unclipped) or 0 (clipped);
μ = π_old gives weights of exactly 1 and a loss and gradient torch.equal to the unweighted
ones. On a categorical toy (8 tokens, 20000 draws from μ ≠ π) the SNIS k1 estimate matches the
exact KL(π‖π_ref) within 4 delta-method standard errors without truncation, and the closed-form
truncated limit with it (which lies > 10 SE below the KL), while the plain mean under μ is far
off. weighted_kl with weights of 1 equals the online per-response mean; the IS metrics equal a
python loop, and sums of two shards give the metrics of the whole.
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

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

ρ is the trust region: the clip keeps π_θ near π_old whatever μ was. w, the off-policy
correction, is a constant within the step (no gradient), so the clip alone bounds the epochs; with
π_θ/μ inside one clip, a μ far from π would put every token outside the band. At θ = θ_old
the gradient is Σ_t w_t A_t ∇log π_θ(y_t). Per token and truncated: the product of t ratios
has a variance that grows exponentially with the length, the per-token ratio a bounded one where
π_old ≈ μ, and capping it at C (truncated IS, Ionides 2008, J. Comput. Graph. Stat. 17(2);
verl's rollout_is=token, rollout_is_threshold=2.0) bounds every weight, biased where π_old/μ > C.

Ordinary PPO is μ = π_old: exp(0) = 1 and min(1, C) = 1 for C ≥ 1 (C < 1 is refused), so w = 1
and the loss and gradient are bit for bit PPO's. Without logged log-probs take μ = π_ref: the SFT
model that usually wrote the responses is the reference, whose log-probs are computed anyway, and
w = 1 at step 0. If the responses came from elsewhere every weight is off by μ_true/π_ref;
truncation caps what one token can contribute. Log the behaviour log-probs when you can.

Whole responses: sequence weights and rejection (verl's rollout_is=sequence, rollout_rs)
----------------------------------------------------------------------------------------
The correction that bias (c) below asks for is the whole product: rollout_is=sequence weighs every
token of response i by

    w_i = min(Π_t π_old(y_it)/μ(y_it), C) = min(exp(clamp(Σ_t log π_old/μ, ±20)), C),

unbiased but for the cap, with a variance that grows exponentially with the length; hence the cap.
(This is verl's sum of log-ratios; GSPO's length-normalised exp(mean_t) is a different number, used
below as a band.) Instead of reweighting, rejection sampling (rollout_rs) removes the samples that
left a trust region: their response_mask becomes 0, so they weigh nothing anywhere downstream.
With log r_t = clamp(log π_old − log μ, ±20) at each real token, the three KL(μ‖π_old)
estimators of nanokl/kl.py read k1 = −log r, k2 = ½(log r)², k3 = r − 1 − log r; an option
names one and where it is taken: token_k* (each token alone), seq_sum_k*, seq_mean_k*,
seq_max_k2/k3 (the response's sum, mean or max, which keeps or drops the whole response). k2 and k3
keep ≤ an upper bound; k1 keeps log(lower) ≤ k1 ≤ log(upper), a band on μ/π_old (note: not
on the weight π_old/μ; it is the same band when lower = 1/upper, the default). seq_mean_k1 is the
geometric-mean band ("Geo-RS"). `rollout_rs` may list several options ("token_k1,seq_max_k2"): a
token survives only if all pass; `rollout_rs_threshold` gives one spec for all or one each
("0.5_2.0" = lower_upper, "2.0" = upper with lower 1/upper for k1). A NaN log-prob at a real token
fails every test and is rejected.

The KL the controller sees
--------------------------
On logged tokens the per-token estimates k(log π_old, log π_ref) of nanokl/kl.py average to a KL
under μ, not π: a plain mean of k1 estimates Σ μ log(π/π_ref), not a divergence at all. We
reweight with the same truncated weights, self-normalised (SNIS):

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

import math

import torch

from nanokl.masked import masked_sum, zero_masked


def truncated_is_weights(old_log_prob, behaviour_log_prob, response_mask, threshold=2.0):
    """[N, R] weights min(π_old/μ, threshold) on real tokens, 0 under the mask; detached.

    The log-ratio is clamped to [−20, 20] before exp, as in the PPO ratio. threshold >= 1, so
    that μ = π_old gives weights of exactly 1 (ordinary PPO)."""
    if not threshold >= 1.0:
        raise ValueError("rollout_is_threshold must be >= 1 (so that mu = pi_old gives weight 1), "
                         f"got {threshold}")
    log_ratio = torch.clamp(old_log_prob.detach() - behaviour_log_prob.detach(),
                            min=-20.0, max=20.0)
    return zero_masked(torch.clamp(torch.exp(log_ratio), max=threshold), response_mask)


def sequence_is_weights(old_log_prob, behaviour_log_prob, response_mask, threshold=2.0):
    """[N, R] weights min(Π_t π_old/μ, threshold) of each response on its real tokens, 0 under
    the mask; detached. The row's log-ratio sum is clamped to [−20, 20] before exp;
    threshold >= 1."""
    if not threshold >= 1.0:
        raise ValueError("rollout_is_threshold must be >= 1 (so that mu = pi_old gives weight 1), "
                         f"got {threshold}")
    log_ratio = zero_masked(old_log_prob.detach() - behaviour_log_prob.detach(), response_mask)
    seq = torch.clamp(log_ratio.sum(dim=-1, keepdim=True), min=-20.0, max=20.0)
    return zero_masked(torch.clamp(torch.exp(seq), max=threshold).expand_as(log_ratio),
                       response_mask)


# algorithm.rollout_correction.rollout_is -> weights; is_sums/is_metrics read either (per token).
IS_LEVELS = {"token": truncated_is_weights, "sequence": sequence_is_weights}

# algorithm.rollout_correction.rollout_rs options: where the statistic is taken, and which
# estimator.
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def rs_thresholds(rollout_rs, rollout_rs_threshold):
    """{option: (lower or None, upper)} from verl's rollout_rs / rollout_rs_threshold specs."""
    options = list(dict.fromkeys(o.strip() for o in str(rollout_rs or "").split(",") if o.strip()))
    unknown = [o for o in options if o not in RS_OPTIONS]
    if not options or unknown:
        raise ValueError(f"rollout_rs must list options among {', '.join(RS_OPTIONS)}, "
                         f"got {rollout_rs!r}")
    spec_text = "" if rollout_rs_threshold is None else str(rollout_rs_threshold)
    specs = [x.strip() for x in spec_text.split(",") if x.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold needs one spec or one per option ({len(options)}), "
                         f"got {rollout_rs_threshold!r}")
    out = {}
    for option, spec in zip(options, specs * len(options) if len(specs) == 1 else specs):
        try:
            if option.endswith("k1"):  # "lower_upper", or "upper" with lower = 1/upper
                lower, upper = spec.split("_", 1) if "_" in spec else (None, spec)
                upper = float(upper)
                lower = 1.0 / upper if lower is None else float(lower)
            elif "_" in spec:
                raise ValueError("k2/k3 take an upper bound only")
            else:
                lower, upper = None, float(spec)
        except (ValueError, ZeroDivisionError) as e:
            raise ValueError(f"rollout_rs_threshold {spec!r} for {option}: {e}") from None
        if not (upper > 0 and (lower is None or lower > 0)):
            raise ValueError(f"rollout_rs_threshold {spec!r} for {option}: bounds must be positive")
        out[option] = (lower, upper)
    return out


def rejection_mask(old_log_prob, behaviour_log_prob, response_mask, rollout_rs,
                   rollout_rs_threshold):
    """The response_mask with every token rejected by rollout_rs set to 0 (same dtype): a token
    stays only if it is real and passes every option (a sequence option keeps or drops its row)."""
    mask = response_mask.bool()
    # float64 and selected first: padded NaN/inf never reach a statistic, k3 does not cancel
    log_r = torch.clamp(
        zero_masked(old_log_prob.detach().double() - behaviour_log_prob.detach().double(), mask),
        min=-20.0, max=20.0)
    k = {"k1": -log_r, "k2": 0.5 * log_r * log_r, "k3": torch.expm1(log_r) - log_r}
    n = mask.double().sum(dim=-1)
    keep = mask.clone()
    for option, (lower, upper) in rs_thresholds(rollout_rs, rollout_rs_threshold).items():
        level, est = option.rsplit("_", 1)
        stat = zero_masked(k[est], mask)
        if level == "seq_sum":
            stat = stat.sum(dim=-1, keepdim=True)
        elif level == "seq_mean":
            stat = stat.sum(dim=-1, keepdim=True) / n.clamp(min=1).unsqueeze(-1)
        elif level == "seq_max":
            # k2, k3 >= 0, so the zeros under the mask never win; an empty row gives 0
            stat = stat.amax(dim=-1, keepdim=True)
        ok = ((stat >= math.log(lower)) & (stat <= math.log(upper)) if lower is not None
              else stat <= upper)
        keep &= ok  # broadcasts a row's verdict to its tokens
    return keep.to(response_mask.dtype)


def rs_sums(kept_mask, response_mask):
    """float64 [real tokens, rejected tokens, responses, responses with a rejected token]; add
    across ranks."""
    real = response_mask.bool()
    rejected = real & ~kept_mask.bool()
    return torch.stack([real.double().sum(), rejected.double().sum(),
                        torch.tensor(float(real.shape[0]), dtype=torch.float64, device=real.device),
                        rejected.any(dim=-1).double().sum()])


def rs_metrics_from_sums(sums):
    """{rs_masked_fraction, rs_seq_masked_fraction}: the fraction of real tokens rejected, and of
    responses that lost at least one token (verl's rollout_rs_masked_fraction, ..._seq_...)."""
    n_tok, rej_tok, n_seq, rej_seq = sums.unbind()
    return {"rs_masked_fraction": rej_tok / n_tok.clamp(min=1),
            "rs_seq_masked_fraction": rej_seq / n_seq.clamp(min=1)}


def is_sums(weights, response_mask, threshold):
    """float64 tensor [n, Σw, Σw², #(w >= threshold)] over the real tokens; add across ranks."""
    w = zero_masked(weights.detach().double(), response_mask)
    truncated = zero_masked(w >= threshold, response_mask)
    return torch.stack([response_mask.double().sum(), w.sum(), (w * w).sum(),
                        truncated.double().sum()])


def is_metrics_from_sums(sums):
    """{is_mean, is_clipfrac, is_ess} from (possibly all-reduced) is_sums: the mean weight, the
    fraction of tokens truncated, and the effective sample size fraction
    (Σw)²/(n·Σw²) in (0, 1]."""
    n, s1, s2, k = sums.unbind()
    tiny = torch.finfo(sums.dtype).tiny  # an all-masked batch gives 0s, not NaN
    return {"is_mean": s1 / n.clamp(min=1), "is_clipfrac": k / n.clamp(min=1),
            "is_ess": s1 * s1 / (n * s2).clamp(min=tiny)}


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


# ---------------------------------------------------------------------------------------------
# The step's parts: what train_ppo.ppo_step calls as run.rollout_correction (step 3: the weights,
# the rejection) and run.read_kl (step 4: the KL the controller reads), bound to the config's
# algorithm.rollout_correction (`rc`) and to a sum over ranks (`reduce`) by harness/variants.py


def _same(t):
    return t


def no_correction(batch, rollout_log_probs, rc=None, reduce=_same):
    """Online: π_old sampled the responses; no weights, nothing rejected."""
    return None, batch["response_mask"], {}


def token_weights(batch, rollout_log_probs, rc, reduce=_same):
    """Truncated per-token weights min(π_old/μ, C) (verl's rollout_is=token):
    (weights, response_mask, rollout_corr/* metrics)."""
    mask, mu = (batch["response_mask"],
                behaviour_log_probs(rollout_log_probs, batch["ref_log_probs"]))
    w = truncated_is_weights(batch["old_log_probs"], mu, mask, rc.rollout_is_threshold)
    return w, mask, _is_step_metrics(w, mask, rc.rollout_is_threshold, reduce)


def sequence_weights(batch, rollout_log_probs, rc, reduce=_same):
    """The response's truncated product min(Π_t π_old/μ, C) on each of its tokens (verl's
    rollout_is=sequence)."""
    mask, mu = (batch["response_mask"],
                behaviour_log_probs(rollout_log_probs, batch["ref_log_probs"]))
    w = sequence_is_weights(batch["old_log_probs"], mu, mask, rc.rollout_is_threshold)
    return w, mask, _is_step_metrics(w, mask, rc.rollout_is_threshold, reduce)


def _is_step_metrics(w, mask, threshold, reduce):
    sums = reduce(is_sums(w, mask, threshold))
    return {f"rollout_corr/{k}": v for k, v in is_metrics_from_sums(sums).items()}


def rejection(batch, rollout_log_probs, rc, reduce=_same, weigh=no_correction):
    """`weigh` (one of the three above), then verl's rejection sampling (rollout_rs): every token
    whose statistic of log π_old/μ leaves its bounds, or whose response's does, leaves
    response_mask (`rejection_mask`): it weighs nothing in the losses, as in verl, nor in the KL
    penalty and the KL its controller reads (verl applies the KL penalty before rejection:
    README, 'Where nanokl differs from verl'). ppo_step places the advantages on the kept
    tokens, but the outcome estimators (grpo, rloo, reinforce_plus_plus_baseline, grpo_passk)
    still sum each response's score over the rollout's mask (`score_mask`), as verl sums the
    whole row, so a rejected last token takes no score away; GAE, REINFORCE++ and ReMax run
    over the kept tokens alone and, as in verl, drop the reward on a rejected token
    (nanokl/advantages.py, 'Two masks')."""
    w, mask, metrics = weigh(batch, rollout_log_probs, rc, reduce)
    mu = behaviour_log_probs(rollout_log_probs, batch["ref_log_probs"])
    kept = rejection_mask(batch["old_log_probs"], mu, mask, rc.rollout_rs, rc.rollout_rs_threshold)
    sums = reduce(rs_sums(kept, mask))
    rs = {f"rollout_corr/rollout_{k}": v for k, v in rs_metrics_from_sums(sums).items()}
    return w, kept, {**metrics, **rs}


def logged_kl(batch, kl, current, metrics, exact=False, reduce=_same):
    """The KL the controller reads: the step's plain mean `current` online (no weights); on
    responses μ sampled, the self-normalised importance-weighted estimate of the KL under π
    (`weighted_kl`, above), the plain mean kept as rollout_corr/kl_unweighted. For the exact KL
    (`exact`: kl_penalty full) no token was sampled for it: weights of 1 on the real tokens."""
    weights = batch["is_weights"]
    if weights is None:
        return current
    if exact:
        weights = torch.where(batch["response_mask"].bool(), 1.0, 0.0)
    metrics["rollout_corr/kl_unweighted"] = current
    return weighted_kl(kl, weights, batch["response_mask"], reduce=reduce).item()

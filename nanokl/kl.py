"""KL estimators: how far has the policy drifted from the reference model?

The idea
--------
RLHF keeps the tuned policy π close to the frozen reference π_ref by paying a price for the
divergence KL(π‖π_ref) = E_{x~π}[log π(x) − log π_ref(x)]. Over a vocabulary of V tokens we
could sum this exactly, but in the reward we only have, for each sampled token x, the two
numbers logprob = log π(x) and ref_logprob = log π_ref(x). A *KL estimator* is a function of
those two numbers whose average over tokens sampled from π approximates the KL.
Write Δ = log π(x) − log π_ref(x) and r = π_ref(x)/π(x) = exp(−Δ). Following John
Schulman's note "Approximating KL Divergence" (2020, http://joschu.net/blog/kl-approx.html):

    k1 = Δ                  unbiased, since E_π[Δ] = KL by definition; but a single sample
                            is negative whenever π_ref(x) > π(x), so it is noisy.
    k2 = ½Δ²                biased, always ≥ 0. It is the f-divergence with f(r) = ½(log r)²,
                            which matches KL to second order around π = π_ref. Its bias
                            follows from Σπ·r = 1: expanding E_π[e^{−Δ}] = 1 gives
                            KL = ½E[Δ²] − ⅙E[Δ³] + O(Δ⁴), so E[k2] − KL = ⅙E_π[Δ³] + O(Δ⁴).
    k3 = r − log r − 1      unbiased, since E_π[r] = Σ π_ref = 1 so E[k3] = E[−log r] = KL; and
       = e^{−Δ} + Δ − 1     ≥ 0 for every sample (log r ≤ r − 1), so its variance is smaller
                            than k1's when π ≈ π_ref. k1 plus a control variate (r − 1) of
                            mean zero. DeepSeekMath (GRPO, 2024) uses it as the KL loss.
    abs = |Δ|               a heuristic used by some RLHF codebases; neither unbiased nor smooth.
    full = Σ_v π(v)(log π(v) − log π_ref(v))   the exact KL at each position, from logits.

verl calls k1 "kl", k2 "mse" and k3 "low_var_kl"; both spellings are accepted. As in verl's
`kl_penalty_forward` (verl/trainer/ppo/core_algos.py), k3 clamps −Δ to [−20, 20] before the
exponential and the result to [−10, 10], so a token the policy made 50 nats more or less
likely than the reference gives a finite value and a finite (possibly zero) gradient instead
of inf/NaN. We compute e^{x} − x − 1 as expm1(x) − x: for small x it keeps the float32
answer accurate where exp(x) − 1 − x would cancel to noise.

Straight-through "+" forms
--------------------------
Unbiased *values* do not mean unbiased *gradients*. When the KL is a loss (GRPO's
use_kl_loss), the gradient we want is ∇_θ KL(π_θ‖π_ref) = E_π[Δ·∇_θ log π(x)] (the extra term
E_π[∇ log π] is zero). Differentiating a sample's estimate with the sample held fixed gives
  ∇k1 = ∇log π            mean E_π[∇log π] = 0: no signal at all;
  ∇k3 = (1 − r)·∇log π    mean −Σ π_ref ∇log π = ∇ KL(π_ref‖π_θ): the *reverse* KL;
  ∇k2 = Δ·∇log π          mean ∇ KL(π_θ‖π_ref): the one we want.
So `k1+`, `kl+`, `abs+`, `k3+`, `low_var_kl+` return the value of the base estimator (for
logging and for the reward) with the gradient of k2:

    out = base.detach() + (k2 − k2.detach())

The bracket is exactly zero in floating point (x − x = 0), so the forward value is bit-for-bit
the base estimator, and autograd only sees k2. This mirrors verl's `kl_penalty`.

The exact KL from logits (`full`) and what k1/k3 teach beside it
----------------------------------------------------------------
`full` needs no sample: at each response position it sums π(v)(log π(v) − log π_ref(v)) over
all V tokens, from the logits of both models at that position (divided by the sampling
temperature). Nothing else in a PPO step holds both models' [batch, R, V] logits at once, so
nanokl/workers.py computes it micro-batch by micro-batch and keeps only the [batch, R] result:
`workers.compute_full_kl` for the KL in the reward (algorithm.kl_penalty=full), and
`workers.update_actor(..., ref=ref)` for the KL as a loss (actor.kl_loss_type=full), where the
gradient is the exact ∇_θ KL(π_θ‖π_ref) of each position's next-token distribution, without the
sampling noise of any estimator. The price is memory: a few fp32 [mb, R, V] tensors per
micro-batch of mb responses (nanokl/workers.py counts them: about 14 GiB for mb = 8, R = 512 and
Qwen2.5's V = 151936).

The lesson is in the logs. With `full` the trainer also logs k1 and k3 on the same tokens
(actor/reward_kl_k1, actor/reward_kl_k3 beside actor/reward_kl_penalty; actor/kl_loss_k1,
actor/kl_loss_k3 beside actor/kl_loss). Given a prefix, E_{x~π}[k1] = E_{x~π}[k3] = the exact
KL at that position (k3 up to its clamp), so over a batch their per-token means should sit near
the exact one, apart by sampling noise only: k1 scattered, sometimes below zero, k3 tighter. A lasting
gap means the tokens were not drawn from the π of the formula: top-k/top-p sampling draws from a
truncated distribution, rollout numerics differ from the trainer's, and in the loss, after the
first optimizer step of a batch, the tokens come from π_old while the KL is of π_θ (the gap then
grows with actor/ppo_kl).

How the tests prove it (tests/test_kl.py)
-----------------------------------------
Each kind equals an independent float64 per-element formula (python `math`) on random inputs
that include padding zeros and |Δ| up to 50, and its forward and backward are finite. A Monte
Carlo check draws tokens from a random categorical π with a known exact KL: the sample means
of k1 and k3 land within 4 standard errors of the exact sum, k3 is never negative, and
Var(k3) < Var(k1) when π ≈ π_ref; k2's exact bias matches ⅙E_π[Δ³] as the divergence shrinks
and its Monte Carlo mean sits many standard errors away from the KL when it is large. `full`
equals the explicit sum and torch.nn.functional.kl_div, its gradient with respect to the policy
logits is the analytic π(v)·(Δ(v) − KL), and bf16 logits are summed in float32
(tests/test_workers.py checks the micro-batched `full`, value and gradient, against kl_div).
The "+" forms have the base value and k2's gradient with respect to both logprob and ref_logprob.
"""

import torch
import torch.nn.functional as F

# Every name kl_penalty accepts (the config validates algorithm.kl_penalty and
# actor.kl_loss_type against this list).
KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full", "k1+", "kl+", "abs+", "k3+", "low_var_kl+")


def _k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    # x = log r = ref − logp; clamping x (not r) keeps exp from overflowing to inf.
    x = torch.clamp(ref_logprob - logprob, min=-20.0, max=20.0)
    return torch.clamp(torch.expm1(x) - x, min=-10.0, max=10.0)


def _full_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    # At least float32: a bf16 softmax over a large vocabulary loses the small terms.
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logp = F.log_softmax(logits.to(dtype), dim=-1)
    # The reference's log-softmax is a temporary: only Δ is kept, one [..., V] tensor fewer at the peak.
    delta = logp - F.log_softmax(ref_logits.to(dtype), dim=-1)
    return (logp.exp() * delta).sum(dim=-1)


def kl_penalty(logprob, ref_logprob, kind, logits=None, ref_logits=None):
    """Per-token KL estimate between the policy and the reference.

    logprob, ref_logprob: [...] log-probabilities of the sampled tokens (same shape).
    kind: one of KL_KINDS.
    logits, ref_logits: [..., V], only for kind="full"; logprob/ref_logprob are then unused
        (they may be None) and the result has shape logits.shape[:-1]. For whole batches,
        nanokl/workers.py feeds it one micro-batch at a time (compute_full_kl, update_actor).
    Returns a tensor of per-token estimates; masking and averaging are the caller's job.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL kind {kind!r}; valid kinds are {', '.join(KL_KINDS)}")

    if kind == "full":
        if logits is None or ref_logits is None:
            raise ValueError("kind='full' needs logits and ref_logits of shape [..., vocab]")
        return _full_kl(logits, ref_logits)

    base_kind = kind.rstrip("+")
    delta = logprob - ref_logprob
    if base_kind in ("kl", "k1"):
        value = delta
    elif base_kind == "abs":
        value = delta.abs()
    elif base_kind in ("mse", "k2"):
        value = 0.5 * delta.square()
    else:  # low_var_kl / k3
        value = _k3(logprob, ref_logprob)

    if not kind.endswith("+"):
        return value
    k2 = 0.5 * delta.square()
    # (k2 − k2.detach()) is exactly 0 forward and carries k2's gradient backward.
    return value.detach() + (k2 - k2.detach())

"""KL estimators: how far has the policy drifted from the reference model?

RLHF pays for KL(π‖π_ref) = E_{x~π}[log π(x) − log π_ref(x)], but a sampled token x carries
only two numbers, logprob = log π(x) and ref_logprob = log π_ref(x). An estimator is a function of
them whose mean over x ~ π approximates the KL. With Δ = log π(x) − log π_ref(x) and
r = e^{−Δ} (John Schulman, "Approximating KL Divergence", 2020,
http://joschu.net/blog/kl-approx.html):

    k1 = Δ                unbiased (E_π[Δ] = KL), but negative where π_ref(x) > π(x): noisy.
    k2 = ½Δ²              ≥ 0, biased: E_π[e^{−Δ}] = 1 gives
                          KL = ½E[Δ²] − ⅙E[Δ³] + O(Δ⁴),
                          so E[k2] − KL = ⅙E_π[Δ³] + O(Δ⁴).
    k3 = r − log r − 1    unbiased (E_π[r] = 1), ≥ 0 per sample (log r ≤ r − 1):
                          k1 plus the zero-mean control variate r − 1,
                          less noisy when π ≈ π_ref. GRPO's.
    abs = |Δ|             a heuristic, neither unbiased nor smooth.
    full = Σ_v π(v)(log π(v) − log π_ref(v))
                          the exact KL at each position, from both logits.

verl calls k1 "kl", k2 "mse", k3 "low_var_kl"; both spellings work. As verl's `kl_penalty_forward`,
k3 clamps −Δ to [−20, 20] before the exponential and the result to [−10, 10]; e^x − x − 1
is expm1(x) − x here, accurate in float32 for small x.

Straight-through "+" forms. As a loss (GRPO's use_kl_loss) we want ∇_θ KL(π_θ‖π_ref) =
E_π[Δ·∇log π]. One sample's estimate differentiates to ∇k1 = ∇log π (mean 0: no signal),
∇k3 = (1 − r)·∇log π (mean: ∇ of the *reverse* KL(π_ref‖π_θ)) and
∇k2 = Δ·∇log π (the one we want). So `k1+`, `kl+`, `abs+`, `k3+`, `low_var_kl+` are
base.detach() + (k2 − k2.detach()): the base's value, k2's gradient (the bracket is exactly 0
forward; verl's `kl_penalty`).

Masked tokens get a gradient of 0 (the caller selects), and that 0 must not meet a non-finite
derivative: where Δ is ±inf or NaN, k2 (derivative Δ) and abs (sign Δ) keep the value but get no
gradient path; k1's derivative is ±1 and k3's clamps select.

`full` has no sampling noise in value or gradient but needs both models' [batch, R, V] logits: only
nanokl/forwards.py and workers.py hold them, micro-batch by micro-batch (`compute_full_kl`,
`update_actor`). The trainer logs k1 and k3 on the same tokens beside it (actor/reward_kl_k1, _k3;
actor/kl_loss_k1, _k3): both have the exact KL as their mean under π, so a lasting gap says the
tokens were not drawn from π (top-k/top-p, rollout numerics that differ, or π_old's tokens after
the first update).

tests/test_kl.py checks every kind against a float64 formula, k1/k3's means and k2's ⅙E[Δ³] bias
by Monte Carlo against an exact KL, `full` against kl_div, and the "+" forms' gradients.
Differs from verl: see README, 'Where nanokl differs from verl'.
"""

import torch
import torch.nn.functional as F

# Every name kl_penalty accepts (the config validates algorithm.kl_penalty and
# actor.kl_loss_type against this list).
KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full", "k1+", "kl+", "abs+", "k3+",
            "low_var_kl+")


def _k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    # x = log r = ref − logp; clamping x (not r) keeps exp from overflowing to inf.
    x = torch.clamp(ref_logprob - logprob, min=-20.0, max=20.0)
    return torch.clamp(torch.expm1(x) - x, min=-10.0, max=10.0)


def _half_square(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d.square()


def _finite_grad(f, delta: torch.Tensor) -> torch.Tensor:
    # f(Δ), with no gradient path where Δ is ±inf or NaN (its value is kept); for finite Δ,
    # f(Δ) bit for bit.
    finite = torch.isfinite(delta)
    return torch.where(finite, f(torch.where(finite, delta, 0)), f(delta.detach()))


def _full_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    # At least float32: a bf16 softmax over a large vocabulary loses the small terms.
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logp = F.log_softmax(logits.to(dtype), dim=-1)
    # The reference's log-softmax is a temporary: only Δ is kept, one [..., V] tensor fewer at the
    # peak.
    delta = logp - F.log_softmax(ref_logits.to(dtype), dim=-1)
    return (logp.exp() * delta).sum(dim=-1)


def kl_penalty(logprob, ref_logprob, kind, logits=None, ref_logits=None):
    """Per-token KL estimate between the policy and the reference.

    logprob, ref_logprob: [...] log-probabilities of the sampled tokens (same shape).
    kind: one of KL_KINDS.
    logits, ref_logits: [..., V], only for kind="full"; logprob/ref_logprob are then unused
        (they may be None) and the result has shape logits.shape[:-1]. For whole batches,
        nanokl/forwards.py and workers.py feed it one micro-batch at a time (compute_full_kl,
        update_actor).
    Returns a tensor of per-token estimates; masking and averaging are the caller's job.
    Differs from verl: see README, 'Where nanokl differs from verl'.
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
        value = _finite_grad(torch.abs, delta)
    elif base_kind in ("mse", "k2"):
        value = _finite_grad(_half_square, delta)
    else:  # low_var_kl / k3 (its clamps already give a non-finite Δ a zero gradient)
        value = _k3(logprob, ref_logprob)

    if not kind.endswith("+"):
        return value
    k2 = _finite_grad(_half_square, delta)
    # (k2 − k2.detach()) is exactly 0 forward and carries k2's gradient backward.
    return value.detach() + (k2 - k2.detach())

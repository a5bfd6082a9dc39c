"""KL estimators: how far has the policy drifted from the reference model?

The idea
--------
RLHF keeps the tuned policy π close to the frozen reference π_ref by paying for the divergence
KL(π‖π_ref) = E_{x~π}[log π(x) − log π_ref(x)]. For each sampled token x we only have the two
numbers logprob = log π(x) and ref_logprob = log π_ref(x); a *KL estimator* is a function of them
whose average over tokens sampled from π approximates the KL. With Δ = log π(x) − log π_ref(x)
and r = π_ref(x)/π(x) = exp(−Δ) (John Schulman, "Approximating KL Divergence", 2020,
http://joschu.net/blog/kl-approx.html):

    k1 = Δ                  unbiased (E_π[Δ] = KL by definition), but negative whenever
                            π_ref(x) > π(x): noisy.
    k2 = ½Δ²                biased, ≥ 0: the f-divergence with f(r) = ½(log r)², equal to KL to
                            second order. From E_π[e^{−Δ}] = Σπ_ref = 1,
                            KL = ½E[Δ²] − ⅙E[Δ³] + O(Δ⁴), so E[k2] − KL = ⅙E_π[Δ³] + O(Δ⁴).
    k3 = r − log r − 1      unbiased (E_π[r] = 1 so E[k3] = E[−log r] = KL), ≥ 0 for every
       = e^{−Δ} + Δ − 1     sample (log r ≤ r − 1): k1 plus the zero-mean control variate r − 1,
                            with less variance than k1 when π ≈ π_ref. GRPO's KL loss.
    abs = |Δ|               a heuristic of some RLHF codebases; neither unbiased nor smooth.
    full = Σ_v π(v)(log π(v) − log π_ref(v))   the exact KL at each position, from logits.

verl calls k1 "kl", k2 "mse" and k3 "low_var_kl"; both spellings are accepted. As in verl's
`kl_penalty_forward`, k3 clamps −Δ to [−20, 20] before the exponential and the result to
[−10, 10], so even |Δ| = 50 gives a finite value and gradient; e^{x} − x − 1 is computed as
expm1(x) − x, which stays accurate in float32 for small x.

Straight-through "+" forms
--------------------------
Unbiased values do not mean unbiased gradients. As a loss (GRPO's use_kl_loss) we want
∇_θ KL(π_θ‖π_ref) = E_π[Δ·∇log π]. Differentiating one sample's estimate gives
  ∇k1 = ∇log π            mean E_π[∇log π] = 0: no signal at all;
  ∇k3 = (1 − r)·∇log π    mean ∇ KL(π_ref‖π_θ): the *reverse* KL;
  ∇k2 = Δ·∇log π          mean ∇ KL(π_θ‖π_ref): the one we want.
So `k1+`, `kl+`, `abs+`, `k3+`, `low_var_kl+` return the base estimator's value with k2's gradient,
out = base.detach() + (k2 − k2.detach()): the bracket is exactly 0 forward (as in verl's `kl_penalty`).

Masked tokens. The caller masks (agg_loss selects), so a padded entry gets a gradient of 0. That 0
must not meet a non-finite derivative: k2's is Δ and abs's sign(Δ), so where Δ is ±inf or NaN they
keep the value but get no gradient path. k1's derivative is ±1 and k3's clamps select, so they need
nothing. Differs from verl: see README, 'Where nanokl differs from verl'.

The exact KL from logits (`full`)
---------------------------------
`full` needs no sample: it sums π(v)(log π(v) − log π_ref(v)) over all V tokens from both models'
logits (divided by the sampling temperature), and as a loss its gradient is the exact
∇_θ KL(π_θ‖π_ref) of each next-token distribution, without sampling noise. Only nanokl/workers.py
holds both models' [batch, R, V] logits, micro-batch by micro-batch (`compute_full_kl` for the
reward, `update_actor(..., ref=ref)` for the loss); the price is a few fp32 [mb, R, V] tensors
(nanokl/workers.py counts them).
Beside it the trainer logs k1 and k3 on the same tokens (actor/reward_kl_k1, _k3; actor/kl_loss_k1,
_k3). Given a prefix, E_{x~π}[k1] = E_{x~π}[k3] = the exact KL, so their means should sit near it,
apart by sampling noise (k1 scattered, k3 tighter). A lasting gap means the tokens were not drawn
from π: top-k/top-p truncation, rollout numerics that differ from the trainer's, or (in the loss,
after the first optimizer step) tokens from π_old while the KL is of π_θ.
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


def _half_square(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d.square()


def _finite_grad(f, delta: torch.Tensor) -> torch.Tensor:
    # f(Δ), with no gradient path where Δ is ±inf or NaN (its value is kept); for finite Δ, f(Δ) bit for bit.
    finite = torch.isfinite(delta)
    return torch.where(finite, f(torch.where(finite, delta, 0)), f(delta.detach()))


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

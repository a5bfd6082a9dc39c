"""The on-policy KL probe: what an offline run's controller reads, so that the KL you set is the
KL you get.

The problem
-----------
Offline, every token the step sees was sampled by a behaviour policy μ, not by π. The KL the
controller steers (nanokl/offline.py's self-normalised, importance-weighted estimate) corrects
which token is drawn at a *logged* prefix, but not which prefixes π itself now reaches, and its
truncation at C cuts the tokens π favours most, so it under-reads the drift (bench/RESULTS.md,
"Offline RLHF: PPO on logged responses, and DPO"). No off-policy estimator sees mass on prefixes
no logged response holds; only sampling π does.

The probe
---------
Every `every` steps, before the controller moves, the current policy π (= π_old of the step)
samples one response to each of `prompts` of the step's training prompts, at the rollout's
temperature, and the step's KL estimator (algorithm.kl_penalty; `full`: the exact KL of the
next-token distributions on π's own prefixes) is averaged as the trainer averages it: per token
within a response, then over responses,

    p = (1/P) Σ_i (1/n_i) Σ_t k(log π(y_it), log π_ref(y_it)),      y_i ~ π,

an unbiased estimate of the on-policy KL, with standard error s/√P (s: the spread of the
per-response KLs). Both log-probs are recomputed by the actor and the reference in the step's
numerics, so p measures exactly the policy whose KL the logged estimate l measures.

What the controller reads: the logged estimate plus a smoothed gap
------------------------------------------------------------------
p alone is unbiased but noisy (P = 16 responses against the step's 64) and exists only on probe
steps; l is precise and exists every step, but biased. Their gap g = p − l is the bias, and it
moves slowly (it is a property of how far π's prefixes have left μ's), so it is smoothed across
probes with an exponential moving average and added to every step's l:

    ĝ_j = (1 − α) ĝ_{j−1} + α (p_j − l_j)    (ĝ_0 = p_0 − l_0, at the first probe),
    KL_read = l + ĝ.

The controller then moves with l's step-to-step changes at once (no lag) while the probe fixes
its level; where it holds KL_read on target the probes average the target. α = 1 with every = 1
reads the probe alone. Additive rather than a ratio p/l: l is ~0 at the start (π = π_ref) and a
k1 estimate may even be negative, where a ratio blows up; near the target, where the controller
holds it, the two corrections agree. The cost is counted in responses and tokens generated
(kl_probe/responses, kl_probe/tokens, cumulative) to compare with an online run's; the spreads
and costs of a run are in bench/RESULTS.md, "The KL you set offline: an on-policy probe for the
controllers".

Who reads KL_read: the reward's controller (β: harness/variants.py's probed_kl, which takes the
probe and reads `corrected_kl`), the KL monitor (it is actor/reward_kl_penalty; the logged estimate
stays as rollout_corr/kl_logged) and, when actor.kl_loss_ctrl is adaptive, the KL loss's coefficient
(train_ppo.py's steer_kl_loss): offline, the exact KL loss at the logged prefixes is the stronger
hand on π, and an on-policy error is what it should answer to.

Limits: the probe samples the training prompts, so the correction is for them; a resumed run
restarts the smoothed gap at its first probe (its state is not in the checkpoint). It adds no
term to any loss: it changes only the number the reward's controller and the KL monitor read.
tests/test_kl_probe.py checks p against a naive float64 loop over the tokens and that the
controller moves with KL_read, not l.
"""

import math
from dataclasses import dataclass

import torch

from nanokl import forwards
from nanokl.rollout import generate
from nanokl.kl import kl_penalty
from nanokl.masked import masked_mean


@dataclass
class ProbeState:
    """What the probe carries from step to step: the smoothed gap ĝ (None before the first probe),
    the steps seen, and the responses and tokens generated so far."""
    gap: float | None = None
    steps: int = 0
    responses: int = 0
    tokens: int = 0


@torch.no_grad()
def probe_sums(policy, ref, sampler, prompt_ids, prompt_mask, ro, kind, eos_token_id, pad_token_id,
               generator, spec=None):
    """Sample one response per prompt from `sampler` (the policy's rollout copy) and estimate the KL
    of `policy` to `ref` on them: float64 [Σ_i p_i, Σ_i p_i², responses, tokens], p_i the
    response's per-token mean of estimator `kind` ('full': exact over the vocabulary). Add
    across ranks."""
    out = generate(sampler, prompt_ids, prompt_mask, ro.response_length, temperature=ro.temperature,
                   top_k=ro.top_k, top_p=ro.top_p, do_sample=ro.do_sample,
                   eos_token_id=eos_token_id, pad_token_id=pad_token_id, generator=generator,
                   use_cuda_graph=ro.use_cuda_graph)
    batch, mask = forwards.rollout_batch(out), out.response_mask
    extra = {} if spec is None else {"spec": spec}
    if kind == "full":
        kl = forwards.compute_full_kl(policy, ref, batch, ro.temperature, **extra)
    else:  # both recomputed: the sampler may be a bf16 copy, and the step's KL is the actor's
        logp, _ = forwards.compute_log_probs(policy, batch, ro.temperature, **extra)
        ref_logp, _ = forwards.compute_log_probs(ref, batch, ro.temperature, **extra)
        kl = kl_penalty(logp, ref_logp, kind)
    per = masked_mean(kl, mask, dim=-1).double().cpu()
    return torch.stack([per.sum(), (per * per).sum(),
                        torch.tensor(float(len(per)), dtype=torch.float64),
                        mask.double().sum().cpu()])


def probe_stats(sums) -> tuple[float, float]:
    """(p, its standard error over responses) from (all-reduced) probe_sums, or from any
    [Σ p_i, Σ p_i², n, ...] (harness/scoring.py's on-policy KL at validation reads it too)."""
    s1, s2, n = sums.tolist()[:3]
    if n == 0:
        return math.nan, math.nan
    var = max(s2 / n - (s1 / n) ** 2, 0.0)
    return s1 / n, (var / max(n - 1, 1)) ** 0.5


def corrected_kl(state: ProbeState, logged: float, probe: float | None, alpha: float) -> float:
    """KL_read = l + ĝ, first folding this step's probe p (None: no probe this step) into ĝ."""
    if probe is not None:
        gap = probe - logged
        state.gap = gap if state.gap is None else (1.0 - alpha) * state.gap + alpha * gap
    return logged + (state.gap or 0.0)

"""DPO: the KL-regularized objective of PPO, solved for the reward and fitted to preferences.

The idea
--------
PPO in nanokl maximises, per prompt x,

    J(π) = E_{y~π}[r(x, y)] − β KL(π‖π_ref).

Its maximiser has a closed form. Write Z(x) = Σ_y π_ref(y|x) exp(r(x,y)/β) and the Gibbs
distribution π*(y|x) = π_ref(y|x) exp(r(x,y)/β) / Z(x). Then r = β log π*/π_ref + β log Z, so

    J(π) = E_π[β log π*/π_ref + β log Z − β log π/π_ref]
         = −β KL(π‖π*) + β log Z(x),

and since KL ≥ 0 with equality only at π = π*, π* is the maximiser. Invert it:
r(x,y) = β log π*(y|x)/π_ref(y|x) + β log Z(x). Under the Bradley-Terry model the logged
ranking says y_w beats y_l with probability σ(r_w − r_l); substituting, the β log Z(x) terms
cancel, so the likelihood of the preferences is a function of the policy alone. Fit π to it:

    h = (log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l))
    L_DPO = −log σ(β h)                      (Rafailov et al. 2023, arXiv:2305.18290)

So DPO's β *is* the KL coefficient of PPO's reward r − β·KL: the same knob, and nanokl reads
both from the same config value (algorithm.kl_ctrl). β log π/π_ref is DPO's *implicit reward*;
we log its sum over pairs for the chosen and the rejected responses, their difference (the
*margin*) and the count of pairs where the chosen implicit reward is larger (the *reward
accuracy*). Log π(y) is a sequence log-prob: the sum over response tokens of the per-token
log-probs, from logits divided by the sampling temperature as everywhere in nanokl.

The gradient. With d/dz(−log σ(z)) = −σ(−z) and ∂h/∂log π(y_w) = 1,
∂h/∂log π(y_l) = −1:

    ∇L = −β σ(−β h) (∇log π(y_w) − ∇log π(y_l)).

A pair the policy already orders right (β h ≫ 0) has weight σ(−βh) ≈ 0; a wrongly ordered
pair gets nearly the full β. DPO is a weighted "push chosen up, rejected down".

IPO (Azar et al. 2023, arXiv:2310.12036, "A General Theoretical Paradigm to Understand
Learning from Human Preferences"). When a preference is deterministic (y_w always wins) the
DPO loss keeps falling as h → ∞: the optimum drives π(y_l) → 0 whatever β says, so the KL
regularisation is lost. IPO regresses h to a finite target instead,

    L_IPO = (h − 1/(2β))²,      ∇L = 2(h − 1/(2β)) (∇log π(y_w) − ∇log π(y_l)),

with h on *summed* log-ratios as in the paper (TRL's "ipo" averages the log-probs over tokens
instead; we follow the paper, so one h means the same thing in both losses).

What nanokl simplifies: no label smoothing (conservative DPO), no reference-free variant, no
other loss types; the caller (nanokl/workers.py) aggregates the per-pair losses as their sum
over the global pair count, with micro-batches that hold whole pairs (rows 2k, 2k+1).
"""

import torch
import torch.nn.functional as F

from nanokl.masked import masked_sum
from nanokl.ppo import logprobs_from_logits
from nanokl.forwards import autocast, response_logits
from nanokl.workers import ppo_epochs

DPO_LOSSES = ("sigmoid", "ipo")


def sequence_log_probs(token_log_probs, response_mask):
    """[N, R] per-token log-probs -> [N] sums over the response tokens (masked entries never
    leak)."""
    return masked_sum(token_log_probs, response_mask, dim=-1)


def dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta, loss_type="sigmoid"):
    """Per-pair DPO ("sigmoid") or IPO ("ipo") losses [P] from [P] sequence log-probs, and
    metrics as detached 0-d *sums* over the pairs (the caller all-reduces and divides by the
    global pair count)."""
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; valid: {', '.join(DPO_LOSSES)}")
    if not beta > 0:
        raise ValueError(f"DPO beta must be > 0, got {beta}")
    chosen_logratio = policy_chosen - ref_chosen
    rejected_logratio = policy_rejected - ref_rejected
    h = chosen_logratio - rejected_logratio
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h)  # stable for any βh: no exp overflow
    else:
        losses = (h - 1 / (2 * beta)) ** 2
    with torch.no_grad():
        chosen_reward = beta * chosen_logratio
        rejected_reward = beta * rejected_logratio
        metrics = {
            "dpo/chosen_reward": chosen_reward.sum(),
            "dpo/rejected_reward": rejected_reward.sum(),
            "dpo/reward_margin": (chosen_reward - rejected_reward).sum(),
            "dpo/reward_accuracy": (chosen_reward > rejected_reward).to(chosen_reward.dtype).sum(),
        }
    return losses, metrics


def update_policy(actor, opt, batch, a, temperature, *, mini_size, spec, generator=None, beta):
    """DPO's update on logged pairs: `a.ppo_epochs` passes in mini-batches of `mini_size`
    responses, the loss `a.objective` ("dpo": sigmoid, "ipo"), rows 2k and 2k+1 the (chosen,
    rejected) responses of one prompt; a micro-batch holds whole pairs (rules). The batch needs
    ref_log_probs; `beta` is the KL coefficient (algorithm.kl_ctrl). Returns lists of
    per-mini-batch metrics."""
    loss_type = {"dpo": "sigmoid", "ipo": "ipo"}[a.objective]

    # norm: the mini-batch's responses over all ranks: a mean over pairs
    def micro_loss(mb, inputs, norm):
        mask = mb["response_mask"]
        with autocast(mask.device):
            logits = response_logits(actor, mb, temperature, spec.packed, inputs=inputs)
        seq = sequence_log_probs(logprobs_from_logits(logits, mb["responses"]), mask)
        ref = sequence_log_probs(mb["ref_log_probs"], mask)
        losses, m = dpo_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2], beta, loss_type)
        pairs = norm / 2
        loss = losses.sum() / pairs
        sums = {f"actor/{k.replace('/', '_')}": v / pairs for k, v in m.items()}
        return loss, {"actor/dpo_loss": loss.detach(), **sums}, {}

    return ppo_epochs(actor, opt, batch, mini_size, spec, a.ppo_epochs, False, a.grad_clip,
                      "seq-mean-token-sum", micro_loss, "actor", generator)

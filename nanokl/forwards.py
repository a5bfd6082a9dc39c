"""The forwards before the update: log-probs, values and the exact KL, micro-batched, without
gradients.

After rollout, a PPO step runs a few forwards over a batch of sequences `[prompt | response]`
before its update (train_ppo.py's step 3; verl's dp_actor.py / dp_critic.py):

    compute_log_probs   actor (π_old) or reference, no grad: the log-prob of each sampled token
    compute_values      critic, no grad: V(s_t) for GAE
    compute_full_kl     actor and reference on the same rows: the exact KL over the vocabulary

The update (nanokl/workers.py) runs the same model calls with gradients: `response_log_probs`,
`response_logits` and `critic_values` under `autocast`.

The log-prob of response token t comes from the logits at position P+t-1 (the token before it),
divided by the sampling temperature, so it is the quantity the rollout recorded
(nanokl/rollout.py); only those R positions go through the LM head (`logits_to_keep`). Values are
read at the same positions: V(s_t) is the critic's output on the prefix that precedes token t.

π_old's forward is often redundant. When the rollout sampled from the actor itself at the same
precision (on CPU, the same fp32 module) and temperature, its log-probs *are* π_old's up to float
error (~1e-6: the decode step sums in another order), so setup takes them instead (verl's
`algorithm.rollout_correction.bypass_mode`; `rollout_log_probs_are_old` says when) and
`update_actor` (nanokl/workers.py) returns the entropy from the logits it computes anyway
(`record_entropy`). TRL's GRPOTrainer saves the same forward another way, valid for one update per
batch only: it uses the detached current log-probs as the old ones.

The LM head. A micro-batch of n tokens makes [n, V] logits, fp32 once divided by the temperature:
for V = 151,936 that is 0.6 MB a token, and the loss path makes several more of that size. With
`spec.chunk` (verl's `use_fused_kernels` / `entropy_from_logits_with_chunking`) the log-probs and
the entropy come from the last hidden states chunk by chunk instead (nanokl/engine/fused.py's
`chunked_log_probs`, its own backward recomputing each chunk), so no tensor is larger than
chunk x V fp32 whatever the micro-batch, and the micro-batch can be sized by the activations alone
(bench/memory.py).

The exact KL (kind `full`, nanokl/kl.py) needs both models' whole next-token distributions, so it
keeps the logits: the reference runs on the same micro-batch and the two [n, R, V] logits are
reduced to [n, R] before the next micro-batch starts (`compute_full_kl` for the reward;
nanokl/workers.py's `exact_kl_loss` for the loss, the gradient through the policy's logits only).
Its memory is linear in the micro-batch's mb·R, so a smaller micro-batch (or token budget) is the
knob (bench/RESULTS.md, "The exact KL's memory").
"""

import contextlib

import torch

from nanokl.engine import dist, shard
from nanokl.engine.batching import Batching, agreed_micro_batches, host_mask, micro_batch
from nanokl.engine.fused import chunked_log_probs
from nanokl.kl import kl_penalty
from nanokl.masked import zero_masked
from nanokl.ppo import entropy_from_logits, logprobs_from_logits


AUTOCAST = {"cuda": torch.bfloat16}  # device type -> compute dtype of every forward (none: fp32)


def autocast(device):
    """bf16 autocast on CUDA (fp32 master weights stay fp32), plain fp32 on CPU. The actor, the
    reference and the critic all run under it, so the reference computes at the actor's precision
    (step-0 KL exactly 0). A test sets AUTOCAST["cpu"] to check the CUDA precision on a CPU."""
    dev = torch.device(device).type
    if dev in AUTOCAST:
        return torch.autocast(dev, dtype=AUTOCAST[dev])
    return contextlib.nullcontext()


def rollout_batch(out) -> dict:
    """The training batch of a rollout (or of logged responses in a rollout's layout): the tensors
    every forward reads. The step adds old/ref log-probs, values, weights and advantages to it."""
    return {"sequences": out.sequences, "attention_mask": out.attention_mask,
            "position_ids": out.position_ids, "responses": out.responses,
            "response_mask": out.response_mask}


def _inputs(mb, packed, inputs):
    """A micro-batch's model inputs: the loops pass the ones they built (nanokl/engine/batching.py);
    a caller outside them (a test, a benchmark) gets them built here, reading the mask from the
    device."""
    if inputs is not None:
        return inputs
    return micro_batch(mb, list(range(len(mb["responses"]))), Batching(packed=packed),
                       host_mask(mb))[1]


def response_logits(model, mb, temperature, packed=False, inputs=None):
    """Logits that predict each response token, fp32, divided by the temperature: [n, R, V].
    Only those positions go through the LM head (`logits_to_keep`)."""
    inputs = _inputs(mb, packed, inputs)
    out = model(*inputs.args, logits_to_keep=inputs.keep, lay=inputs.lay)
    logits = out[0].view(*inputs.index.shape, -1) if inputs.index is not None else out[:, :-1]
    return logits.float() / temperature


def response_log_probs(model, mb, temperature, spec, inputs=None, with_entropy=False):
    """(log π of each response token [n, R], the entropy at each position [n, R] or None, the
    logits [n, R, V] or None), fp32 at `temperature`. With `spec.chunk` the LM head runs chunk by
    chunk from the hidden states (nanokl/engine/fused.py): no logits are returned, since none ever
    existed whole."""
    inputs = _inputs(mb, spec.packed, inputs)
    labels = mb["responses"]
    if spec.chunk:
        # the kept positions' hidden states: [n, R + 1, H] padded, [1, n R, H] packed
        def head(h, weight):
            h = h[:, :-1] if inputs.index is None else h.view(*labels.shape, -1)
            return chunked_log_probs(h, weight, labels, temperature, spec.chunk, with_entropy)
        logp, entropy = model(*inputs.args, logits_to_keep=inputs.keep, lay=inputs.lay, head=head)
        return logp, entropy, None
    logits = response_logits(model, mb, temperature, inputs=inputs)
    return (logprobs_from_logits(logits, labels),
            entropy_from_logits(logits) if with_entropy else None, logits)


def critic_values(critic, mb, inputs):
    """V(s_t) for each response token t: the critic's output at the position before it, [n, R]."""
    out = critic(*inputs.args, lay=inputs.lay)
    if inputs.index is not None:
        return out[0][inputs.index].float()
    R = mb["responses"].shape[1]
    return out[:, -R - 1:-1].float()


def rollout_log_probs_are_old(mode, same_numerics, do_sample, temperature) -> bool:
    """Whether the step takes pi_old's log-probs from the rollout instead of recomputing them
    (verl's `algorithm.rollout_correction.bypass_mode`): `mode` is True, False or "auto".

    "auto" is on only when the two are the same numbers up to float error: the sampler is the actor
    itself at the same precision (`same_numerics`: on CPU the rollout runs the fp32 actor; a bf16
    copy on CUDA differs by bf16 rounding, so there the actor recomputes), and the rollout recorded
    its log-probs at the training temperature (a greedy rollout records temperature 1). top-k/top-p
    do not matter: the recorded log-prob is taken before filtering, as training's is
    (nanokl/rollout.py). True takes them whenever they are at the training temperature, even from a
    bf16 copy: PPO then anchors its ratio on the policy that really sampled (verl's bypass); rules
    refuses True where they are not."""
    at_training_temperature = (do_sample and temperature > 0) or temperature == 1
    if mode == "auto":
        return same_numerics and at_training_temperature
    return bool(mode) and at_training_temperature


def forward_micro_batches(batch, spec):
    """(micro-batch, its model inputs) of each non-empty micro-batch of a no-grad forward pass, as
    many as every rank runs (nanokl/engine/batching.py); the mask is read from the device once,
    here, before the loop."""
    host = host_mask(batch)
    for mb, inputs, _ in agreed_micro_batches(batch, None, spec, host, dist.agreed_count,
                                              skip_empty=True):
        yield mb, inputs


@torch.no_grad()
def compute_log_probs(model, batch, temperature, spec=Batching(), with_entropy=False):
    """Log-prob of each response token under `model` ([N, R]), and its entropy if asked."""
    model = shard.unwrap(model)  # no gradients to synchronise: skip a DDP wrapper
    mask = batch["response_mask"]
    logp = torch.zeros(mask.shape, device=mask.device)
    ent = torch.zeros(mask.shape, device=mask.device) if with_entropy else None
    for mb, inputs in forward_micro_batches(batch, spec):
        with autocast(mask.device):
            lp, e, logits = response_log_probs(model, mb, temperature, spec, inputs, with_entropy)
        logp[inputs.rows] = lp
        if with_entropy:
            ent[inputs.rows] = e
        # else the [n, R, V] logits stay alive through the next micro-batch's forward
        del logits, lp, e
    return logp, ent


@torch.no_grad()
def compute_full_kl(actor, ref, batch, temperature, spec=Batching()):
    """Exact KL(π‖π_ref) of the next-token distributions at each response position: [N, R], 0 at
    padding. Micro-batch by micro-batch both models run on the same rows and their logits (divided
    by `temperature`) are reduced by kl_penalty(..., "full") before the next micro-batch starts.

    For algorithm.kl_penalty=full the trainer puts this in the reward and logs its per-token mean
    as actor/reward_kl_penalty, and beside it actor/reward_kl_k1 and actor/reward_kl_k3: the k1
    and k3 estimates from old_log_probs and ref_log_probs on the same tokens (nanokl/kl.py)."""
    actor, ref = shard.unwrap(actor), shard.unwrap(ref)
    mask = batch["response_mask"]
    out = torch.zeros(mask.shape, device=mask.device)
    for mb, inputs in forward_micro_batches(batch, spec):
        with autocast(mask.device):
            logits = response_logits(actor, mb, temperature, inputs=inputs)
            ref_logits = response_logits(ref, mb, temperature, inputs=inputs)
        out[inputs.rows] = zero_masked(kl_penalty(None, None, "full", logits, ref_logits),
                                       mb["response_mask"])
        del logits, ref_logits  # else they stay alive through the next micro-batch's forwards
    return out


@torch.no_grad()
def compute_values(critic, batch, spec=Batching()):
    """V(s_t) of each response token under the critic: [N, R]."""
    critic = shard.unwrap(critic)
    out = torch.zeros(batch["response_mask"].shape, device=batch["responses"].device)
    for mb, inputs in forward_micro_batches(batch, spec):
        with autocast(out.device):
            out[inputs.rows] = critic_values(critic, mb, inputs)
    return out

"""The actor and the critic at work: the PPO update loops, micro-batched.

After rollout and the forwards before the update (nanokl/forwards.py: π_old's and the reference's
log-probs, the values, the exact KL), a PPO step runs epochs of gradient steps over the batch
(Schulman et al. 2017; verl's dp_actor.py / dp_critic.py):

    update_actor        ppo_epochs x mini-batches x micro-batches of the clipped policy loss
    update_critic       the same loop with the clipped value loss

Each micro-batch's forward is nanokl/forwards.py's (`response_log_probs`, `critic_values`), now with
gradients: the same positions, temperature, LM head chunking and precision as the passes before.

Mini- and micro-batches (verl's names). A mini-batch is what one optimizer step sees
(`ppo_mini_batch_size` prompts x `rollout.n` responses, over all ranks); it is cut into
micro-batches of `ppo_micro_batch_size_per_gpu` responses, or under a token budget
(`use_dynamic_bsz`, nanokl/engine/batching.py), optionally packed without padding
(`use_remove_padding`), and their gradients accumulate. Each micro-batch's loss is aggregated with
the *whole mini-batch's* denominator (its token count for token-mean, its sequence count for the
seq-mean modes, summed over ranks; nanokl/ppo.py), so the accumulated gradient is exactly the
gradient of the mini-batch loss, whatever the micro-batching and the number of ranks. A
mini-batch whose loss or gradient is not finite is skipped (`actor/nan_skipped`); the trainer
stops after three such steps in a row.

The host never waits inside a micro-batch loop. On a GPU every read of a device value (`.item()`,
`bool(t)`, `.tolist()`, `nonzero`, a boolean-mask index) stops the host until the GPU has drained
its queue, and the next kernels are launched only then: the GPU idles for the launch latency of a
whole micro-batch. So each pass reads the attention mask once (nanokl/engine/batching.py builds
every micro-batch's lengths, packing and attention layout from that copy on the host), and
the update keeps its finiteness check and its metrics as tensors until one read per
mini-batch, where the optimizer step has to know whether to apply the gradient (`_step`).
tests/test_update_ops.py counts the reads inside the loops on the meta device (where any
read of a device value is visible): none.
"""

import math
from collections import defaultdict

import torch

from nanokl.engine import dist, shard
from nanokl.engine.batching import Batching, agreed_micro_batches, host_mask, send
from nanokl.forwards import autocast, critic_values, response_log_probs, response_logits
from nanokl.kl import kl_penalty
from nanokl.masked import masked_mean
from nanokl.ppo import (POLICY_LOSSES, agg_loss, compute_policy_loss, compute_value_loss,
                        entropy_from_logits, logprobs_from_logits)


def loss_norm(mask, loss_agg_mode):
    """The mini-batch denominator of `agg_loss` (see nanokl/ppo.py): tokens or sequences."""
    # torch.full, not torch.tensor: a fill on the device, not a blocking copy from the host
    return (mask.sum().float() if loss_agg_mode == "token-mean"
            else torch.full((), float(mask.shape[0]), device=mask.device))


def _minibatches(n, mini_size, epochs, shuffle, generator):
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
        yield from order.split(mini_size)


def _step(model, opt, grad_clip, finite, sums, means, metrics, prefix):
    """Clip the accumulated gradient, then read the host's one look at the mini-batch: whether every
    loss and the gradient were finite, the gradient norm and the metrics, in one copy. Apply the
    gradient, or drop it when anything was not finite."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor norm over all shards
        grad_norm = grad_norm.full_tensor()
    keys = list(sums) + list(means)
    dev = finite.device
    finite = dist.all_reduce(finite.float(), op="min")
    total = (dist.all_reduce(torch.stack([torch.as_tensor((sums | means)[k], device=dev).float()
                                          for k in keys]))
             if keys else finite.new_zeros(0))
    # the one host read
    read = torch.cat([torch.stack([finite, grad_norm.float().to(dev)]), total]).tolist()
    if read[0] == 1.0 and math.isfinite(read[1]):
        opt.step()
        metrics[f"{prefix}/grad_norm"].append(read[1])
    else:
        metrics[f"{prefix}/nan_skipped"].append(1.0)
    opt.zero_grad(set_to_none=True)
    for k, v in zip(keys, read[2:]):
        metrics[k].append(v)


def ppo_epochs(model, opt, batch, mini_size, spec, epochs, shuffle, grad_clip, loss_agg_mode,
               micro_loss, prefix, generator=None) -> dict:
    """The loop both updates share: `epochs` passes over the batch in mini-batches of `mini_size`
    responses (this rank's share), each cut into micro-batches (`spec`) whose gradients accumulate
    before one optimizer step.

    `micro_loss(mb, inputs, norm)` returns (loss, sums, means): the micro-batch's share of the
    mini-batch loss, aggregated with the *global* mini-batch denominator `norm` (all ranks' tokens
    or sequences), metrics that add up over micro-batches and ranks (the loss terms), and metrics
    averaged with token weights (fractions); `inputs` are its model inputs
    (nanokl/engine/batching.py). DDP and FSDP average gradients over the W ranks, so the loss is
    scaled by W: the applied gradient is then exactly the global mini-batch gradient. A non-finite
    loss or gradient anywhere skips the step on every rank alike.

    The host never waits inside the micro-batch loop: the mask is read once for the whole update,
    the finiteness and the metrics stay tensors until the mini-batch's one read (`_step`)."""
    metrics = defaultdict(list)
    W = dist.world()
    host = host_mask(batch)
    for idx in _minibatches(len(batch["responses"]), mini_size, epochs, shuffle, generator):
        idx = idx.tolist()
        (idx_d,) = send([torch.tensor(idx)], batch["responses"].device)
        mask_all = batch["response_mask"][idx_d]
        norm, tokens = dist.all_reduce(torch.stack([loss_norm(mask_all, loss_agg_mode),
                                                    mask_all.sum().float()]))  # one collective
        # no real token (all rejected: rollout_rs): a loss of 0
        norm, tokens = norm.clamp(min=1), tokens.clamp(min=1)
        finite, sums, means = None, defaultdict(float), defaultdict(float)
        # as many micro-batches as every rank runs (nanokl/engine/batching.py): the gradient
        # is reduced after the last
        for mb, inputs, last in agreed_micro_batches(batch, idx, spec, host, dist.agreed_count):
            with shard.no_sync(model, skip=not last):
                loss, s, m = micro_loss(mb, inputs, norm)
                (loss * W).backward()
            finite = torch.isfinite(loss) if finite is None else finite & torch.isfinite(loss)
            # this micro-batch's share of all ranks' tokens
            share = mb["response_mask"].sum() / tokens
            for k, v in s.items():
                sums[k] += v
            for k, v in m.items():
                means[k] += v * share
        _step(model, opt, grad_clip, finite, sums, means, metrics, prefix)
    return metrics


def update_actor(actor, opt, batch, a, temperature, *, mini_size, spec=Batching(), generator=None,
                 horizon=None, kl_loss_coef: float, ref=None, record_entropy=False, watch=None):
    """PPO epochs over the batch with the clipped policy loss (+ KL loss, − entropy bonus).

    `a` is the config's actor_rollout_ref.actor (its policy_loss.loss_mode picks the loss from
    nanokl/ppo.py's POLICY_LOSSES: vanilla, gspo or cispo, one signature); `batch` holds the rollout
    tensors, old_log_probs, advantages, is_weights (None, or the importance weights of responses
    another policy sampled, nanokl/offline.py: they weigh each token's policy and KL loss) and
    ref_log_probs; `mini_size` counts responses (ppo_mini_batch_size x rollout.n). `kl_loss_coef`
    weighs the KL loss (the trainer's controller holds it, so a remedy can raise it); `ref`, the
    reference model, is needed for kl_loss_type `full` (`exact_kl_loss`). Returns (lists of
    per-mini-batch metrics under verl's names, entropy): with `record_entropy` the [N, R] entropy of
    each response token from the first pass over its row (no extra forward: the trainer's
    actor/entropy when the old log-probs came from the rollout), else None. `watch(mb, log_probs)`:
    more fractions to record of each micro-batch (the KL monitor's ratio band,
    nanokl/harness/hacking.py), token-weighted as pg_clipfrac is."""
    loss_agg_mode, policy_loss_mode = a.loss_agg_mode, a.policy_loss.loss_mode
    # PPO's clipped loss; GSPO and CISPO (nanokl/ppo.py) replace it with the same signature
    policy_loss = (compute_policy_loss if policy_loss_mode == "vanilla"
                   else POLICY_LOSSES[policy_loss_mode])
    kl_loss = None
    if a.use_kl_loss:
        kl_loss = (exact_kl_loss(ref, temperature, spec, loss_agg_mode, horizon)
                   if a.kl_loss_type == "full"
                   else sampled_kl_loss(a.kl_loss_type, loss_agg_mode, horizon))
    first_pass = FirstPassEntropy(batch) if record_entropy else None
    want_entropy = bool(a.entropy_coeff) or first_pass is not None

    def micro_loss(mb, inputs, norm):
        mask = mb["response_mask"]
        with autocast(mask.device):
            logp, entropy, logits = response_log_probs(
                actor, mb, temperature, spec, inputs,
                with_entropy=want_entropy and bool(spec.chunk))
        if logits is not None and want_entropy:
            # a record needs none
            with torch.set_grad_enabled(bool(a.entropy_coeff) and torch.is_grad_enabled()):
                entropy = entropy_from_logits(logits)
        if first_pass is not None:
            first_pass.record(inputs.rows, entropy.detach())
        pg_loss, m = policy_loss(mb["old_log_probs"], logp, mb["advantages"], mask,
                                 a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c,
                                 loss_agg_mode, global_norm=norm, horizon=horizon,
                                 is_weights=mb.get("is_weights"))
        loss, sums = pg_loss, {"actor/pg_loss": pg_loss.detach()}
        if a.entropy_coeff:
            loss = loss - a.entropy_coeff * agg_loss(entropy, mask, loss_agg_mode, norm, horizon)
        if kl_loss is not None:
            kl, kl_sums = kl_loss(mb, inputs, logits, logp, norm)
            loss = loss + kl_loss_coef * kl
            sums.update(kl_sums)
        means = {f"actor/{k}": m[k] for k in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")}
        if watch is not None:
            means.update(watch(mb, logp.detach()))
        return loss, sums, means

    metrics = ppo_epochs(actor, opt, batch, mini_size, spec, a.ppo_epochs, a.shuffle, a.grad_clip,
                         loss_agg_mode, micro_loss, "actor", generator)
    if a.use_kl_loss:
        metrics["actor/kl_coef"].append(kl_loss_coef)
    return metrics, None if first_pass is None else first_pass.entropy


def _weighted(kl_mat, mb):
    return kl_mat if mb.get("is_weights") is None else mb["is_weights"] * kl_mat


def sampled_kl_loss(kind, loss_agg_mode, horizon):
    """The KL loss from the sampled tokens' log-probs (verl's use_kl_loss with kl_loss_type `kind`):
    (mb, inputs, logits, logp, norm) -> (aggregated loss, its metric)."""
    def kl_loss(mb, inputs, logits, logp, norm):
        loss = agg_loss(_weighted(kl_penalty(logp, mb["ref_log_probs"], kind), mb),
                        mb["response_mask"], loss_agg_mode, norm, horizon)
        return loss, {"actor/kl_loss": loss.detach()}
    return kl_loss


def exact_kl_loss(ref, temperature, spec, loss_agg_mode, horizon):
    """The exact KL(π‖π_ref) over the vocabulary as the loss (kl_loss_type `full`): the
    reference runs on the same micro-batch and the gradient flows through the policy's logits only.
    Logs actor/kl_loss_k1 and actor/kl_loss_k3, the estimators on the same tokens, beside it."""
    if ref is None:
        raise ValueError("kl_loss_type='full' needs the reference model: "
                         "update_actor(..., ref=ref)")
    ref = shard.unwrap(ref)

    def kl_loss(mb, inputs, logits, logp, norm):
        mask = mb["response_mask"]
        sums = {}
        with torch.no_grad():
            with autocast(mask.device):
                ref_logits = response_logits(ref, mb, temperature, inputs=inputs)
            # log π_ref of the sampled tokens from these very logits, so k1/k3 and `full`
            # share every number
            ref_logp = logprobs_from_logits(ref_logits, mb["responses"])
            for k in ("k1", "k3"):
                sums[f"actor/kl_loss_{k}"] = agg_loss(kl_penalty(logp, ref_logp, k), mask,
                                                      loss_agg_mode, norm, horizon)
        kl_mat = kl_penalty(None, None, "full", logits, ref_logits)
        del ref_logits  # nothing of the reference is needed by the backward
        loss = agg_loss(_weighted(kl_mat, mb), mask, loss_agg_mode, norm, horizon)
        return loss, {**sums, "actor/kl_loss": loss.detach()}
    return kl_loss


class FirstPassEntropy:
    """The entropy of each response token from the first pass over its row (no gradient).
    With one mini-batch per step that is π_old's entropy exactly; later mini-batches see the
    policy after the earlier optimizer steps. Recorded without a host read: a row seen before
    keeps its entropy."""

    def __init__(self, batch):
        mask = batch["response_mask"]
        self.entropy = torch.zeros(mask.shape, device=mask.device)
        self.seen = torch.zeros(len(mask), dtype=torch.bool, device=mask.device)

    @torch.no_grad()
    def record(self, rows, entropy):
        self.entropy[rows] = torch.where(self.seen[rows, None], self.entropy[rows], entropy)
        self.seen.index_fill_(0, rows, True)  # a scalar fill: no host-to-device copy


def update_critic(critic, opt, batch, c, *, mini_size, spec=Batching(), generator=None,
                  horizon=None) -> dict:
    """PPO epochs over the batch with the clipped value loss; `c` is the config's critic."""
    loss_agg_mode = c.loss_agg_mode

    def micro_loss(mb, inputs, norm):
        mask = mb["response_mask"]
        with autocast(mb["sequences"].device):
            vpreds = critic_values(critic, mb, inputs)
        loss, m = compute_value_loss(vpreds, mb["returns"], mb["values"], mask, c.cliprange_value,
                                     loss_agg_mode, global_norm=norm, horizon=horizon)
        means = {"critic/vf_clipfrac": m["vf_clipfrac"],
                 "critic/vpred_mean": masked_mean(vpreds.detach(), mask)}
        return loss, {"critic/vf_loss": loss.detach()}, means

    return ppo_epochs(critic, opt, batch, mini_size, spec, c.ppo_epochs, c.shuffle, c.grad_clip,
                      loss_agg_mode, micro_loss, "critic", generator)

"""Is the reference still the reference? A probe of its log-probs, recorded at start and rechecked.

The idea
--------
The KL penalty measures the policy against a frozen reference, KL(pi || pi_ref). Everything the KL
monitor judges (nanokl/harness/monitor.py) assumes pi_ref does not move. When it does, the KL reads
wrong in ways no check on the KL's own numbers can explain: a reference that shares its parameters'
memory with the actor moves with every update, so the measured KL stays near 0 however far the
policy has gone; a reference that is accidentally trained (its parameters require grad, or sit in an
optimizer) drifts on its own schedule and makes the KL noisy. The verl KL-tuning checklist's remedy
for a high KL variance is "check the reference model's consistency"; this module is that check.

Two checks, both cheap:

1. At setup, before any step, the storage test (`shared_with`, `diagnose`): does any reference
   parameter share memory with a parameter of the actor, the rollout copy or the critic
   (`untyped_storage().data_ptr()` equal), require grad, or sit in an optimizer's param groups?
   Any of these ends the run at once (TrainingStopped: "error: ..." and exit status 1), since no step
   of such a run would be worth its time.
2. The probe (`record`, `recheck`): the reference's log-probs on a fixed probe batch, recorded at
   setup and, with the KL monitor on (trainer.kl_monitor.enable), recomputed every
   `trainer.kl_monitor.ref_check_freq` steps (default 10; 0: never); the two must be
   bit-for-bit equal (torch.equal). A difference stops the run as a monitor stop does: a checkpoint
   of the step, one line naming the likely cause (found by `diagnose`; when none of the storage
   causes holds: "changed by something outside the trainer"), exit status 0. This is the check that
   catches what the setup test cannot see: a tie made later, an in-place write, a hook.

The probe batch. The first `PROBE_PROMPTS` held-out prompts (training prompts when there is no
held-out set), templated and left-padded as the step's prompts are; the "response" is each prompt's
own last R tokens, R = the shortest prompt's length - 1, so every row scores R real tokens and no
generation is needed (a greedy continuation would cost a rollout and, under FSDP2, a sharded model
cannot generate). Every weight the model uses on these tokens enters the log-probs, the LM head's
every row through the softmax's denominator; an embedding row of a token absent from the probe does
not, which is the probe's blind spot (the storage test has none: it inspects every parameter).
Under torchrun every rank computes the same probe (a forward of a few rows) and the equality flag is
reduced with min, so every rank takes the same decision at the same step.

Why exact equality holds. The reference is in eval mode and never changes; the probe is the same
tensors, cut into the same micro-batches (the reference's batching spec), run by the same kernels
on the same device under the same autocast; no op in the forward is random or atomically
accumulated, so the same inputs give the same bits (cuBLAS documents bitwise reproducibility for
the same GPU architecture and configuration; the CPU kernels are deterministic). A tolerance would
only hide a small drift, such as a tiny learning rate on a reference put in an optimizer by mistake.

Resume. The reference is reloaded from actor_rollout_ref.model.path at every start, so the probe is
recorded again at setup, from the reloaded weights; nothing of it is kept in a checkpoint. (A file
at that path replaced between two runs would therefore pass: it is the reference of the new run.)

The recheck logs monitor/ref_consistent (1.0 equal, 0.0 not) and timing_s/ref_check on the steps it
runs. It is not one of the monitor's CHECKS: those read a step's metrics; this one runs a model.
tests/test_ref_check.py plants a reference that shares the actor's parameters in a real run.
"""

import torch

from nanokl.engine import dist, shard
from nanokl.harness.data import encode_prompts
from nanokl.harness.metrics import timer
from nanokl.harness.run_state import TrainingStopped
from nanokl.forwards import compute_log_probs

PROBE_PROMPTS = 8  # rows of the probe: a few, so that a recheck costs one small forward


def probe_batch(run) -> dict | None:
    """The fixed probe batch (the module docstring), or None when the prompts are too short to score."""
    d = run.cfg.data
    examples = (run.val or run.train)[:PROBE_PROMPTS]
    if not examples:
        return None
    ids, mask = encode_prompts(examples, run.tok, d, device=run.device)
    R = int(mask.sum(-1).min()) - 1  # every row's last R tokens are real, and each has a token before it
    if R < 1:
        return None
    return {"sequences": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, -R:], "response_mask": torch.ones_like(ids[:, -R:])}


def _probe_log_probs(run, batch):
    return compute_log_probs(run.ref, batch, run.cfg.actor_rollout_ref.rollout.temperature,
                             spec=run.specs["ref"])[0]


def _storage(p):
    """The memory a parameter lives in (an FSDP2 DTensor: its local shard's); None for an empty one,
    whose address (0) says nothing."""
    p = p.to_local() if hasattr(p, "to_local") else p
    return p.untyped_storage().data_ptr() if p.numel() else None


def shared_with(ref, model) -> tuple[str, str] | None:
    """(reference parameter, model parameter) of the first pair living in the same memory, or None."""
    if model is None:
        return None
    owners = {_storage(p): name for name, p in shard.unwrap(model).named_parameters()}
    owners.pop(None, None)
    for name, p in shard.unwrap(ref).named_parameters():
        if _storage(p) in owners:
            return name, owners[_storage(p)]
    return None


def diagnose(run) -> str | None:
    """The likely reason the reference is not frozen, from the models themselves; None when none holds."""
    ref = shard.unwrap(run.ref)
    for what, model in (("actor", run.actor), ("rollout copy", run.rollout_model if run.rollout_copy else None),
                        ("critic", run.critic)):
        pair = shared_with(ref, model)
        if pair:
            return (f"the reference shares storage with the {what} (reference {pair[0]} is {what} {pair[1]}): "
                    f"every update of the {what} moves it; build the reference from its own copy of the weights")
    grads = [name for name, p in ref.named_parameters() if p.requires_grad]
    if grads:
        return (f"reference parameter {grads[0]} requires grad ({len(grads)} do): the reference is meant to be "
                f"frozen (requires_grad_(False))")
    mine = {_storage(p): name for name, p in ref.named_parameters()}
    mine.pop(None, None)
    for what, opt in (("actor", run.actor_opt), ("critic", run.critic_opt)):
        for group in (opt.param_groups if opt is not None else ()):
            hit = next((mine[_storage(p)] for p in group["params"] if _storage(p) in mine), None)
            if hit:
                return f"reference parameter {hit} sits in the {what}'s optimizer: the reference is being trained"
    if ref.training:
        return "the reference is in train mode (it must run in eval mode)"
    return None


def check_setup(run):
    """The storage test before any step: a reference that cannot stay frozen stops the run at once."""
    cause = diagnose(run)
    if dist.all_reduce(torch.tensor(int(cause is not None)), op="max").item():  # every rank stops together
        raise TrainingStopped(f"reference check at setup: {cause or 'another rank found the reference not frozen'}")


def record_probe(run):
    """The reference's log-probs on the probe batch now: (batch, log-probs), or None (no probe)."""
    km = run.cfg.trainer.kl_monitor
    if not km.enable or km.ref_check_freq <= 0:
        return None
    batch = probe_batch(run)
    return None if batch is None else (batch, _probe_log_probs(run, batch))


def recheck(run, done: int, metrics: dict) -> str | None:
    """After step `done` (1-based): on every ref_check_freq-th step, recompute the probe's log-probs;
    None when they are equal (or it is not a checking step), else the line that stops the run."""
    freq = run.cfg.trainer.kl_monitor.ref_check_freq
    if run.ref_probe is None or freq <= 0 or done % freq:
        return None
    batch, recorded = run.ref_probe
    with timer(metrics, "ref_check", run.device):
        same = torch.equal(_probe_log_probs(run, batch), recorded)
        same = bool(dist.all_reduce(torch.tensor(int(same)), op="min").item())  # one decision for every rank
    metrics["monitor/ref_consistent"] = float(same)
    if same:
        return None
    cause = diagnose(run) or "changed by something outside the trainer (an in-place write, a hook, another process)"
    return (f"reference check stopped the run at step {done}: the reference's log-probs on the probe batch "
            f"differ from those recorded at start; likely cause: {cause}")

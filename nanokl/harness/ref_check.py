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
2. The recheck (`record_probe`, `recheck`), with the KL monitor on (trainer.kl_monitor.enable),
   every `trainer.kl_monitor.ref_check_freq` steps (default 10; 0: never). Two readings recorded at
   setup are taken again:
   - the parameters' checksum (`checksum`), which must be *exactly* equal: each parameter's bits, read
     as integers, summed with position weights in int64. Integer sums are exact and do not depend on
     the order of the additions, so thread counts, a busy machine or another kernel cannot move them;
     any write to any weight (a tiny learning rate on a reference put in an optimizer by mistake, an
     in-place add, a tie to a model that trains) changes them;
   - the reference's log-probs on a fixed probe batch, which must agree within `PROBE_ATOL` +
     `PROBE_RTOL`·|log p|: they catch what changes the reference's *output* with its weights untouched
     (a forward hook, a patched module, another dtype). Bit-for-bit is not what kernels guarantee
     here: a CPU matmul splits its sums by the intra-op thread count, and a loaded node ran the same
     reference to other last bits, which once stopped a healthy run (tests/test_ref_check.py runs the
     recheck under load and with another thread count and stays quiet).
   Either difference stops the run as a monitor stop does: a checkpoint of the step, one line naming
   the likely cause (found by `diagnose`; when none of the storage causes holds: "changed by
   something outside the trainer"), exit status 0. This is the check that catches what the setup test
   cannot see: a tie made later, an in-place write, a hook.

The probe batch. The first `PROBE_PROMPTS` held-out prompts (training prompts when there is no
held-out set), templated and left-padded as the step's prompts are; the "response" is each prompt's
own last R tokens, R = the shortest prompt's length - 1, so every row scores R real tokens and no
generation is needed (a greedy continuation would cost a rollout and, under FSDP2, a sharded model
cannot generate). The checksum has no blind spot: it reads every parameter. Under torchrun each rank
sums its own shard and computes the same probe, and the equality flag is reduced with min, so every
rank takes the same decision at the same step.

Resume. The reference is reloaded from actor_rollout_ref.model.path at every start, so the probe is
recorded again at setup, from the reloaded weights; nothing of it is kept in a checkpoint. (A file
at that path replaced between two runs would therefore pass: it is the reference of the new run.)

The recheck logs monitor/ref_consistent (1.0 equal, 0.0 not), monitor/ref_logp_diff (the probe's
largest |change| of a log-prob) and timing_s/ref_check on the steps it runs. It is not one of the
monitor's CHECKS: those read a step's metrics; this one runs a model.
LoRA (harness/lora_run.py). The reference is the actor itself with its adapters off (lora.AdaptersOff),
so its parameters are the actor's frozen base: the storage test then passes a base weight shared under
its own name and refuses anything else (an adapter, the rollout copy, the critic), a base weight that
requires grad or sits in the optimizer; the checksum reads the base alone and must stay exact.
tests/test_ref_check.py plants a reference that shares the actor's parameters in a real run.
"""

import torch

from nanokl.engine import dist, shard
from nanokl.harness.data import encode_prompts
from nanokl.harness.metrics import timer
from nanokl.harness.run_state import TrainingStopped
from nanokl.forwards import compute_log_probs
from nanokl.lora import AdaptersOff

PROBE_PROMPTS = 8  # rows of the probe: a few, so that a recheck costs one small forward
# How far the probe's log-probs may move with untouched weights: float32 sums re-split across threads
# move a log-prob by ~1e-6; bf16 by ~1e-2 of its size. A hook or patch that matters moves them more.
PROBE_ATOL, PROBE_RTOL = 1e-4, 1e-2
_CHUNK = 1 << 22  # elements summed at a time: bounds the int64 temporaries of a large embedding
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(model) -> torch.Tensor:
    """Two int64 sums over every parameter's bits (this rank's shard under FSDP2): the plain sum and
    one weighted by position (1 + i mod 65521), so that swapped values count too. Exact (int64 wraps
    modulo 2^64, which keeps the sums exact and order-free), whatever the order of the additions."""
    total = None  # on the parameters' device: one host read at the end, not one per parameter
    for p in shard.unwrap(model).parameters():
        p = p.to_local() if hasattr(p, "to_local") else p
        flat = p.detach().reshape(-1)
        bits = flat.view(_INT[flat.element_size()])
        for start in range(0, bits.numel(), _CHUNK):
            chunk = bits[start:start + _CHUNK].to(torch.int64)
            weight = (torch.arange(start, start + len(chunk), device=chunk.device) % 65521) + 1
            part = torch.stack([chunk.sum(), (chunk * weight).sum()])
            total = part if total is None else total + part
    return torch.zeros(2, dtype=torch.int64) if total is None else total.cpu()


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


def shared_with(ref, model, same_name_ok=False) -> tuple[str, str] | None:
    """(reference parameter, model parameter) of the first pair living in the same memory, or None.
    `same_name_ok` (LoRA: the reference is the actor's own base) passes a parameter shared under its
    own name: then only the adapters, whose names no reference parameter has, may not be shared."""
    if model is None:
        return None
    owners = {_storage(p): name for name, p in shard.unwrap(model).named_parameters()}
    owners.pop(None, None)
    for name, p in shard.unwrap(ref).named_parameters():
        if _storage(p) in owners and not (same_name_ok and owners[_storage(p)] == name):
            return name, owners[_storage(p)]
    return None


def diagnose(run) -> str | None:
    """The likely reason the reference is not frozen, from the models themselves; None when none holds."""
    ref = shard.unwrap(run.ref)
    lora = isinstance(ref, AdaptersOff)  # the actor with its adapters off: its parameters are the frozen base
    for what, model in (("actor", run.actor), ("rollout copy", run.rollout_model if run.rollout_copy else None),
                        ("critic", run.critic)):
        pair = shared_with(ref, model, same_name_ok=lora and what == "actor")
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
    """The reference now: (its checksum, the probe batch or None, its log-probs or None), or None when
    the recheck is off."""
    km = run.cfg.trainer.kl_monitor
    if not km.enable or km.ref_check_freq <= 0:
        return None
    batch = probe_batch(run)
    return checksum(run.ref), batch, None if batch is None else _probe_log_probs(run, batch)


def recheck(run, done: int, metrics: dict) -> str | None:
    """After step `done` (1-based): on every ref_check_freq-th step, recompute the probe's log-probs;
    None when they are equal (or it is not a checking step), else the line that stops the run."""
    freq = run.cfg.trainer.kl_monitor.ref_check_freq
    if run.ref_probe is None or freq <= 0 or done % freq:
        return None
    summed, batch, recorded = run.ref_probe
    with timer(metrics, "ref_check", run.device):
        weights_same = torch.equal(checksum(run.ref), summed)
        diff, outputs_same = 0.0, True  # no probe batch (prompts too short): the checksum alone
        if batch is not None:
            moved = (_probe_log_probs(run, batch) - recorded).abs()
            diff = float(moved.max())
            outputs_same = bool((moved <= PROBE_ATOL + PROBE_RTOL * recorded.abs()).all())
        flags = dist.all_reduce(torch.tensor([int(weights_same), int(outputs_same)]), op="min")  # one decision
        weights_same, outputs_same = bool(flags[0]), bool(flags[1])
    metrics["monitor/ref_consistent"] = float(weights_same and outputs_same)
    metrics["monitor/ref_logp_diff"] = diff
    if weights_same and outputs_same:
        return None
    whose = "the actor's frozen base weights' (LoRA)" if isinstance(run.ref, AdaptersOff) else "its parameters'"
    what = (f"{whose} checksum differs from the one recorded at start" if not weights_same else
            f"its log-probs on the probe batch moved by up to {diff:.3g} with its parameters unchanged")
    cause = diagnose(run) or "changed by something outside the trainer (an in-place write, a hook, another process)"
    return f"reference check stopped the run at step {done}: {what}; likely cause: {cause}"

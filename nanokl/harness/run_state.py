"""A run's checkpoints: save one, resume from one, restore one for a rollback.

Every rank takes part in a save (FSDP2 gathers each tensor, a collective); rank 0 writes the
HF-format weights, the optimizer states keyed by parameter name (any world size can load them) and
the trainer state: the step, both KL controllers, the monitor, the NaN streak, the last healthy
step and every RNG state (nanokl/harness/checkpoint.py writes them atomically). On resume only rank
0 reads the files; the others receive each tensor from it."""

import sys
from pathlib import Path

from nanokl import dist
from nanokl.harness import remedies
from nanokl.harness.checkpoint import CheckpointWriteError, load_state, rng_state, save_checkpoint, set_rng_state
from nanokl.harness.hf_format import from_pretrained, load_value_model
from nanokl.kl_ctrl import FixedKLController


class TrainingStopped(Exception):
    """The run cannot continue (repeated NaN losses: a checkpoint was saved first; a checkpoint that
    could not be written: the previous one is intact)."""


def _models(run):
    return (("actor", run.actor, run.actor_opt, run.actor_sched),
            *((("critic", run.critic, run.critic_opt, run.critic_sched),) if run.critic is not None else ()))


def _restore(run, path, weights=False):
    """Optimizer states (+ weights, for a rollback) from checkpoint `path`; returns (the LR
    schedulers' states by name, the trainer state). Only rank 0 reads optim.pt and the weights;
    the other ranks receive them tensor by tensor (dist.load_optimizer_state, load_full_state_dict)."""
    optim_state, state = load_state(path, read_optim=run.rank == 0)
    optim_state = optim_state or {}
    for name, model, opt, _ in _models(run):
        if weights:
            load = from_pretrained if name == "actor" else load_value_model
            dist.load_full_state_dict(model, load(path / name).state_dict() if run.rank == 0 else {})
        dist.load_optimizer_state(model, opt, optim_state.get(name, {}))
    if weights and run.rollout_copy:
        dist.sync_rollout_weights(run.rollout_model, run.actor)
    scheds = dist.broadcast_object({k: v for k, v in optim_state.items() if k.endswith("_sched")})
    return scheds, state


def resume(run, ckpt):
    """Continue a run from checkpoint `ckpt` exactly where it stopped."""
    scheds, state = _restore(run, ckpt)
    for name, _, _, sched in _models(run):
        sched.load_state_dict(scheds[f"{name}_sched"])
    if state["kl_ctrl"].get("type") == "fixed" and run.kl_ctrl.kind != "fixed":  # the fixed_kl rollback froze it
        run.kl_ctrl = FixedKLController(state["kl_ctrl"]["value"])
    run.kl_ctrl.load_state_dict(state["kl_ctrl"])
    if "kl_loss_ctrl" in state:  # a rollback may have raised it
        run.kl_loss_ctrl.load_state_dict(state["kl_loss_ctrl"])
    if run.monitor and "monitor" in state:
        run.monitor.load_state_dict(state["monitor"])
        remedies.restore(run)
    set_rng_state(state["rng"])
    run.start, run.nan_streak, run.healthy_step = state["global_step"], state.get("nan_streak", 0), state.get(
        "healthy_step")
    if run.rank == 0:
        print(f"resumed from {ckpt} at step {run.start}", file=sys.stderr)


def save(run, step, healthy=True) -> Path:
    """Every rank gathers (a collective), rank 0 writes full HF weights + name-keyed optimizer state."""
    run.healthy_step = step if healthy else run.healthy_step
    weights = {name: (dist.unwrap(m), dist.full_state_dict(m)) for name, m, _, _ in _models(run)}
    optim = {}
    for name, model, opt, sched in _models(run):
        optim.update({name: dist.optimizer_state(model, opt), f"{name}_sched": sched.state_dict()})
    state = {"kl_ctrl": run.kl_ctrl.state_dict(), "kl_loss_ctrl": run.kl_loss_ctrl.state_dict(), "rng": rng_state(),
             "nan_streak": run.nan_streak, "healthy_step": run.healthy_step,
             **({"monitor": run.monitor.state_dict()} if run.monitor else {})}
    path, failed = run.run_dir / "checkpoints" / f"global_step_{step}", None
    if run.rank == 0:
        try:
            path = save_checkpoint(run.run_dir, step, weights, optim, state, tokenizer=run.tok,
                                   keep=run.cfg.trainer.max_actor_ckpt_to_keep)
        except CheckpointWriteError as e:
            failed = str(e)
    failed = dist.broadcast_object(failed)  # every rank stops, none waits forever for rank 0
    if failed:
        raise TrainingStopped(f"{failed}; the previous checkpoint is untouched")
    return path

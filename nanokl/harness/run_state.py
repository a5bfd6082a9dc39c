"""A run's checkpoints: save one, resume from one, restore one for a rollback.

Every rank takes part in a save (FSDP2 gathers each tensor, a collective); rank 0 writes the
HF-format weights, the optimizer states keyed by parameter name (any world size can load them) and
the trainer state: the step, both KL controllers, the monitor, the NaN streak, the last healthy
step and every RNG state (nanokl/harness/checkpoint.py writes them atomically). On resume only rank
0 reads the files; the others receive each tensor from it.

The run's folder (the second half of this file): one run at a time, and nothing in it silently wrong.

  the lock      rank 0 holds `<run dir>/.lock` (an flock, and the holder's pid, host and start time
                in it) from setup to finish; a second run in the folder stops with one line naming
                the first's pid (exit 2); the lock of a run that died (SIGKILL, a crash) is free to
                the next one, which takes it over with a note
  the resume    which checkpoint: auto takes the newest that verifies; a folder with none starts at
                trainer.resume_from_path when set (a note), a folder whose every checkpoint is damaged
                refuses to start over (exit 2) unless resume_mode=disable; the chosen one is compared
                with this run's settings first (fingerprint.resume_check: one line per refusal)
  set aside     a run that starts over (no checkpoint, or resume_mode=disable) in a folder holding an
                earlier run's metrics.jsonl, val_generations.jsonl, summary.json or checkpoints
                renames them to metrics.1.jsonl, ..., checkpoints.1 (one note): the folder's files
                then describe this run alone. Checkpoints in verl's layout (global_step_N/ and
                latest_checkpointed_iteration.txt in the folder itself) move into checkpoints.1/, with
                the old layout's checkpoints/ folder if there is one
"""

import atexit
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from nanokl.engine import dist, shard
from nanokl.harness import lora_run, remedies
from nanokl.harness.checkpoint import (LEGACY_ROOT, POINTER, CheckpointWriteError, committed, latest_checkpoint,
                                       load_state, rng_state, save_checkpoint, set_rng_state)
from nanokl.harness.config.load import save_config
from nanokl.harness.config.yaml_io import UserError
from nanokl.harness.fingerprint import resume_check
from nanokl.harness.hf_format import from_pretrained, load_value_model
from nanokl.harness.tracking import GENERATIONS
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
    the other ranks receive them tensor by tensor (shard.load_optimizer_state, load_full_state_dict)."""
    optim_state, state = load_state(path, read_optim=run.rank == 0)
    optim_state = optim_state or {}
    for name, model, opt, _ in _models(run):
        if weights and lora_run.has_adapters(model):  # LoRA: the base never moved; every rank reads the adapters
            lora_run.load_adapters(shard.unwrap(model), path / name)
        elif weights:
            load = from_pretrained if name == "actor" else load_value_model
            shard.load_full_state_dict(model, load(path / name).state_dict() if run.rank == 0 else {})
        shard.load_optimizer_state(model, opt, optim_state.get(name, {}))
    if weights and run.rollout_copy:
        shard.sync_rollout_weights(run.rollout_model, run.actor)
    scheds = dist.broadcast_object({k: v for k, v in optim_state.items() if k.endswith("_sched")})
    return scheds, state


def resume(run, ckpt):
    """Continue a run from checkpoint `ckpt` exactly where it stopped."""
    scheds, state = _restore(run, ckpt)
    for name, _, _, sched in _models(run):
        sched.load_state_dict(scheds[f"{name}_sched"])
    if state["kl_ctrl"].get("type") == "fixed" and run.kl_ctrl.type != "fixed":  # the fixed_kl rollback froze it
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


def save(run, step, healthy=True, before_commit=None) -> Path:
    """Every rank gathers (a collective), rank 0 writes full HF weights + name-keyed optimizer state and
    the run's record; `before_commit` (the step's metrics row) runs before the checkpoint commits."""
    run.healthy_step = step if healthy else run.healthy_step
    weights = {name: (shard.unwrap(m), lora_run.full_weights(m)) for name, m, _, _ in _models(run)}  # LoRA: merged
    optim = {}
    for name, model, opt, sched in _models(run):
        optim.update({name: shard.optimizer_state(model, opt), f"{name}_sched": sched.state_dict()})
    state = {"kl_ctrl": run.kl_ctrl.state_dict(), "kl_loss_ctrl": run.kl_loss_ctrl.state_dict(), "rng": rng_state(),
             "nan_streak": run.nan_streak, "healthy_step": run.healthy_step,
             **({"monitor": run.monitor.state_dict()} if run.monitor else {})}
    path, failed = run.run_dir / f"global_step_{step}", None  # verl's layout (checkpoint.save_checkpoint)
    if run.rank == 0:
        try:
            path = save_checkpoint(run.run_dir, step, weights, optim, state, tokenizer=run.tok,
                                   keep=checkpoints_to_keep(run.cfg.trainer, run.critic is not None),
                                   record=getattr(run, "record", None),
                                   before_commit=before_commit, extra=lora_run.adapter_writer(run.actor))
        except CheckpointWriteError as e:
            failed = str(e)
    failed = dist.broadcast_object(failed)  # every rank stops, none waits forever for rank 0
    if failed:
        raise TrainingStopped(f"{failed}; the previous checkpoint is untouched")
    if run.rank != 0 and before_commit is not None:  # rank 0 called it; elsewhere it logs nothing
        before_commit()
    return path


def checkpoints_to_keep(trainer, critic: bool):
    """How many global_step_* folders save keeps (None or 0: all). A folder holds the actor and the critic together,
    so it goes only when neither limit keeps it: the larger of max_actor_ckpt_to_keep and, with a critic,
    max_critic_ckpt_to_keep, of those set (verl rotates each alone; a start-up note says so, config/notes.py)."""
    critic_keep = getattr(trainer, "max_critic_ckpt_to_keep", None) if critic else None
    limits = [n for n in (trainer.max_actor_ckpt_to_keep, critic_keep) if n]
    return max(limits) if limits else None


# ---------------------------------------------------------------------------------------------
# The run's folder: the lock, the record a resume must match, what a fresh start sets aside
# ---------------------------------------------------------------------------------------------

LOCK = ".lock"
_held = {}  # the locks this process holds: the lock file's real path -> its open file


def _holder(f) -> tuple[dict | None, str]:
    """What a lock file says: ({pid, host, started} or None, 'pid N on HOST, since TIME' or its text)."""
    f.seek(0)
    text = f.read().strip()
    try:
        h = json.loads(text)
        return h, f"pid {h['pid']} on {h['host']}, since {h['started']}"
    except (ValueError, KeyError, TypeError):
        return None, " ".join(text.split())[:120] or "pid unknown"


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True  # someone else's live process (or a pid we cannot read): in use
    return True


def take_lock(run_dir) -> str | None:
    """Hold `run_dir`/.lock for this run (rank 0: from setup to finish, or to this process's end).
    A live run holding it -> UserError naming its pid; a lock left by a run that died (its flock went
    with its process) -> taken over, and the note that says so is returned."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK
    key = os.path.realpath(path)
    if key in _held:  # an earlier run of this very process that did not finish (its setup raised; a test)
        _held.pop(key).close()
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:  # held (EWOULDBLOCK); or a file system without flock: the named pid's liveness
            h, holder = _holder(f)
            if not isinstance(e, BlockingIOError):
                mine = h is not None and h.get("host") == socket.gethostname()
                if h is None or (mine and (h.get("pid") == os.getpid() or not _alive(h.get("pid")))):
                    holder = None  # nothing that says a live run holds it
            if holder is not None:
                f.close()
                raise UserError(f"{run_dir} is in use by another run ({holder}): one run per folder. Wait for it to "
                                "end or stop it, or give this run its own trainer.default_local_dir") from None
        try:  # the file locked must still be the one at the path: a finishing run unlinks it, then unlocks
            same = os.path.samestat(os.fstat(f.fileno()), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        f.close()
    left = _holder(f)[1] if os.fstat(f.fileno()).st_size else None
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                        "started": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    f.flush()
    _held[key] = f
    if left is None:
        return None
    return f"note: {run_dir}: took over the lock of a run that ended without releasing it ({left})"


def release_lock(run_dir) -> None:
    """Give back `run_dir`/.lock (a no-op when this process does not hold it). In a folder that became
    read-only the file cannot be deleted: it is emptied instead (the open file is still writable), and
    an empty lock whose flock is free is what take_lock takes without a word."""
    key = os.path.realpath(Path(run_dir) / LOCK)
    f = _held.pop(key, None)
    if f is None:
        return
    try:
        os.unlink(key)  # before unlocking: a run that opened the old file meanwhile sees it gone and retries
    except OSError:
        try:
            f.truncate(0)  # no pid left in it: nobody mistakes it for a live run's
        except OSError:
            pass
    f.close()


@atexit.register
def release_all():  # a run that raised after its setup (a failed checkpoint write): its folder is free again
    for key in list(_held):
        release_lock(Path(key).parent)


ASIDE = ("metrics.jsonl", GENERATIONS, "summary.json", LEGACY_ROOT)  # what an earlier run leaves in the folder
# (LEGACY_ROOT: the checkpoints, in either layout: verl's global_step_N/ and its tracker move into checkpoints.N/)


def _aside_name(name, n):
    p = Path(name)
    return f"{p.stem}.{n}{p.suffix}"


def set_aside(run_dir, why: str) -> str | None:
    """A run that starts over in `run_dir`: the earlier run's files (ASIDE) renamed to name.N (the
    first N free for all of them), so that this run's metrics.jsonl, summary and checkpoints are its
    own; the note that says so, or None when there was nothing to set aside."""
    run_dir = Path(run_dir)

    def ckpts(d):  # a run's checkpoints in folder d (debris included), and its tracker file
        return [*d.glob("global_step_*"), *([d / POINTER] if (d / POINTER).is_file() else [])]

    def present(p):
        if p.name == LEGACY_ROOT:  # only the old layout's own: a checkpoints/ folder of other runs' folders stays
            return p.is_dir() and bool(ckpts(p))
        return any(p.iterdir()) if p.is_dir() else p.is_file() and p.stat().st_size > 0
    verl = ckpts(run_dir)
    found = [name for name in ASIDE if present(run_dir / name) or (name == LEGACY_ROOT and verl)]
    if not found:
        return None
    n = 1
    while any((run_dir / _aside_name(name, n)).exists() for name in ASIDE):
        n += 1
    for name in found:
        if present(run_dir / name):
            os.replace(run_dir / name, run_dir / _aside_name(name, n))
    if verl:  # verl's layout: into checkpoints.N/ beside the old layout's (a name in both: the old one as NAME.legacy)
        into = run_dir / _aside_name(LEGACY_ROOT, n)
        into.mkdir(exist_ok=True)
        for p in verl:
            if (into / p.name).exists():
                os.replace(into / p.name, into / f"{p.name}.legacy")
            os.replace(p, into / p.name)
    return (f"note: {run_dir} holds an earlier run's {', '.join(found)} and this run starts over ({why}): set aside "
            f"as {', '.join(_aside_name(name, n) for name in found)}")


def checkpoint_to_resume(cfg, rank, record):
    """The checkpoint to resume from, checked against what this run starts with (`record`) before anything
    loads (run_state.resume_check); None when the run starts over, which sets the folder's earlier run
    aside. auto: the newest that matches its manifest (skipped ones are named); when the folder has none,
    resume_from_path (verl reads it under resume_path only: said in a note). A folder whose every checkpoint
    is damaged does not start over by itself: that is a one-line refusal, as resume_mode=disable would
    set the run aside and redo it all. config.yaml is written only then: a refused resume leaves it be."""
    t, run_dir = cfg.trainer, Path(cfg.trainer.default_local_dir)
    ckpt, notes, problem = None, [], None
    if rank == 0:
        try:
            if t.resume_mode == "auto":
                ckpt = latest_checkpoint(run_dir)
                if ckpt is None and committed(run_dir):
                    raise UserError(f"{run_dir}: every checkpoint is damaged (each is named above), and a resume "
                                    "would start over from step 0: restore one, or start over on purpose with "
                                    "trainer.resume_mode=disable (the earlier run is set aside, not deleted)")
                if ckpt is None and t.resume_from_path is not None:
                    ckpt = Path(t.resume_from_path)
                    notes.append(f"note: trainer.resume_from_path is set under resume_mode=auto and {run_dir} has "
                                 f"no checkpoint: resuming from {ckpt} (verl uses it under resume_mode=resume_path "
                                 "only)")
                elif ckpt is not None and t.resume_from_path is not None:
                    notes.append(f"note: trainer.resume_from_path={t.resume_from_path} is not used: resume_mode=auto "
                                 f"resumes this folder's own newest checkpoint, {ckpt}")
            elif t.resume_mode == "resume_path":
                ckpt = Path(t.resume_from_path)
            why = "trainer.resume_mode=disable" if t.resume_mode == "disable" else "no checkpoint to resume from"
            notes = (notes + resume_check(ckpt, record, t.resume_allow_changes) if ckpt else
                     [set_aside(run_dir, why)])
        except (UserError, OSError) as e:
            problem = str(e)
    ckpt, problem = dist.broadcast_object((ckpt, problem))
    if problem is not None:
        raise UserError(problem)
    if rank == 0:
        for note in filter(None, notes):
            print(note, file=sys.stderr)
        save_config(cfg, run_dir / "config.yaml")
    return ckpt

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
  the record    every checkpoint holds what its run was started with (run.json: the config with its
                paths made absolute, the SHA-256 of the model's tokenizer.json, its config.json's
                shapes). A resume compares this run's with it before loading anything: a key that
                changes the result (the model, the algorithm, the batch sizes, the lengths, ...)
                stops the run with one line naming each difference, unless
                trainer.resume_allow_changes names it or resume_mode=disable starts over; keys that
                change only the speed or the logging (speed_only) resume with a one-line note. A
                checkpoint from before the record resumes, with a note (its model's shapes still
                compared with the new model's)
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
from nanokl.harness import remedies
from nanokl.harness.checkpoint import (LEGACY_ROOT, POINTER, CheckpointWriteError, _sha256, load_state, read_record,
                                       rng_state, save_checkpoint, set_rng_state)
from nanokl.harness.config.build import config_to_dict
from nanokl.harness.config.yaml_io import UserError
from nanokl.harness.hf_format import from_pretrained, load_value_model, read_config
from nanokl.harness.tracking import GENERATIONS
from nanokl.kl_ctrl import FixedKLController
from nanokl.engine.model import ModelConfig


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
        if weights:
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
    weights = {name: (shard.unwrap(m), shard.full_state_dict(m)) for name, m, _, _ in _models(run)}
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
                                   keep=run.cfg.trainer.max_actor_ckpt_to_keep, record=getattr(run, "record", None),
                                   before_commit=before_commit)
        except CheckpointWriteError as e:
            failed = str(e)
    failed = dist.broadcast_object(failed)  # every rank stops, none waits forever for rank 0
    if failed:
        raise TrainingStopped(f"{failed}; the previous checkpoint is untouched")
    if run.rank != 0 and before_commit is not None:  # rank 0 called it; elsewhere it logs nothing
        before_commit()
    return path


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


SHAPES = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")
# paths compare as absolute paths (the same model from another working directory is the same model)
PATH_LEAVES = {"path", "tokenizer_path", "train_files", "val_files", "offline_files", "output_dir", "data_path",
             "val_data_path", "hf_config_path", "lora_adapter_path", "rollout_data_dir", "validation_data_dir",
             "default_local_dir", "resume_from_path", "input_tokenizer"}
# never compared: where the run lives and how it resumes; the stages before RL (their output is the model path)
IGNORED = ("trainer.resume_mode", "trainer.resume_from_path", "trainer.resume_allow_changes",
           "trainer.default_local_dir", "sft.", "reward_model.train.")
# keys that change how fast a run goes, or what it logs, and not what it computes: a resume may change them
SPEED_ONLY_NAMES = {
    "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu", "log_prob_micro_batch_size",
    "log_prob_micro_batch_size_per_gpu", "forward_micro_batch_size", "forward_micro_batch_size_per_gpu",
    "micro_batch_size", "micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu",
    "forward_max_token_len_per_gpu", "use_dynamic_bsz", "log_prob_use_dynamic_bsz", "use_remove_padding",
    "use_fused_kernels", "fused_chunk_size", "strategy", "use_torch_compile", "enable_gradient_checkpointing",
    "entropy_from_logits_with_chunking", "entropy_checkpointing", "use_cuda_graph", "enforce_eager",
    "max_batch_size", "gpu_memory_utilization", "dataloader_num_workers", "filter_overlong_prompts_workers",
    "nccl_timeout"}
SPEED_ONLY_PARTS = (".fsdp_config.", ".checkpoint.", ".profiler.", ".global_profiler.", ".fused_kernel_options.")
SPEED_ONLY_KEYS = {"data.val_batch_size", *(f"trainer.{k}" for k in (
    "logger", "project_name", "experiment_name", "save_freq", "test_freq", "total_training_steps", "total_epochs",
    "max_actor_ckpt_to_keep", "max_critic_ckpt_to_keep", "log_freq", "log_val_generations", "validation_data_dir",
    "rollout_data_dir", "val_before_train", "val_only", "val_kl_prompts", "n_gpus_per_node", "nnodes", "device",
    "balance_batch", "profile_steps"))}
MODEL_PATH = "actor_rollout_ref.model.path"


def speed_only(key: str) -> bool:
    return (key in SPEED_ONLY_KEYS or key.rsplit(".", 1)[-1] in SPEED_ONLY_NAMES
            or any(part in f".{key}." for part in SPEED_ONLY_PARTS))


def _flat(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _absolute(v):
    if isinstance(v, str) and v and "://" not in v:
        return os.path.abspath(os.path.expanduser(v))
    if isinstance(v, list):
        return [_absolute(x) for x in v]
    return v


def model_shapes(path) -> dict:
    """The shape fields of the model at `path` (its config.json, as nanokl reads it)."""
    mc = ModelConfig(**read_config(path)[0])
    return {k: getattr(mc, k) for k in SHAPES}


def run_record(cfg) -> dict:
    """What this run is started with, as a checkpoint keeps it (run.json): the config (flat, dotted keys;
    paths absolute), the SHA-256 of the policy's tokenizer.json and its model's shapes."""
    config = {k: _absolute(v) if k.rsplit(".", 1)[-1] in PATH_LEAVES else v
              for k, v in _flat(config_to_dict(cfg))}
    tok = Path(cfg.actor_rollout_ref.model.tokenizer_path) / "tokenizer.json"
    return {"config": json.loads(json.dumps(config)), "tokenizer_sha256": _sha256(tok) if tok.is_file() else None,
            "model_shapes": model_shapes(cfg.actor_rollout_ref.model.path)}


def _show(v) -> str:
    if isinstance(v, list):
        text = "[" + ",".join(_show(x) for x in v) + "]"
    elif isinstance(v, bool) or v is None:
        text = json.dumps(v)
    else:
        text = str(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _renamed(was: dict) -> dict:
    """A record written before nanokl renamed two of its own spellings (actor.loss_mode -> objective, the
    monitor's knob kl_coef -> kl_weight) in today's words: the same settings are no change."""
    was = {OBJECTIVE if k == OLD_OBJECTIVE else k: v for k, v in was.items()}
    return {k: "kl_weight" if k.endswith(".knob") and v == "kl_coef" else v for k, v in was.items()}


OLD_OBJECTIVE, OBJECTIVE = "actor_rollout_ref.actor.loss_mode", "actor_rollout_ref.actor.objective"


def resume_check(ckpt, record: dict, allow=()) -> list[str]:
    """Resuming from checkpoint `ckpt` with this run's `record` (run_record): the notes to print, or a
    UserError naming every difference that changes the result and that `allow`
    (trainer.resume_allow_changes) does not name."""
    ckpt = Path(ckpt)
    old, notes = read_record(ckpt), []
    if old is None:  # written before checkpoints kept a record: only the actor's shapes to compare
        notes.append(f"note: {ckpt} has no record of the settings its run started with (written before nanokl "
                     "kept one): resuming without comparing them")
        actor = ckpt / "actor"
        old = {"model_shapes": model_shapes(actor)} if (actor / "config.json").is_file() else {}
    diffs = {}  # name -> "old -> new"
    was = _renamed(old.get("config") or {})
    for k, v in record["config"].items():
        if k in was and was[k] != v and not k.startswith(IGNORED):
            diffs[k] = f"{_show(was[k])} -> {_show(v)}"
    if MODEL_PATH in diffs:  # the keys that follow the model path (its tokenizer's, the critic's): named with it
        diffs = {k: d for k, d in diffs.items() if k == MODEL_PATH or (was[k], record["config"][k]) !=
                 (was[MODEL_PATH], record["config"][MODEL_PATH])}
    if "tokenizer_sha256" in old and old["tokenizer_sha256"] != record["tokenizer_sha256"]:
        a, b = (x[:12] if x else "none" for x in (old["tokenizer_sha256"], record["tokenizer_sha256"]))
        diffs["tokenizer"] = f"tokenizer.json sha256 {a} -> {b}"
    shapes = old.get("model_shapes") or {}
    changed = [f"{k} {_show(shapes[k])} -> {_show(v)}" for k, v in record["model_shapes"].items()
               if k in shapes and shapes[k] != v]
    if changed:
        diffs["model_shapes"] = ", ".join(changed)

    def allowed(name):
        return any(name == a or name.startswith(a + ".") for a in allow)
    speed = [k for k in diffs if speed_only(k)]
    accepted = [k for k in diffs if k not in speed and allowed(k)]
    refused = [k for k in diffs if k not in speed and k not in accepted]
    if refused:
        raise UserError(f"checkpoint {ckpt} was written by a run started with other settings, which change the "
                        f"result: {'; '.join(f'{k} ({diffs[k]})' for k in refused)}. Start over with "
                        "trainer.resume_mode=disable (or another trainer.default_local_dir), or resume with the "
                        f"change: trainer.resume_allow_changes=[{','.join([*accepted, *refused])}]")
    if accepted:
        notes.append("note: resuming with changed keys that trainer.resume_allow_changes accepts: "
                     + "; ".join(f"{k} ({diffs[k]})" for k in accepted))
    if speed:
        notes.append("note: resuming with changed speed-only keys: " + "; ".join(f"{k} ({diffs[k]})" for k in speed))
    return notes


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

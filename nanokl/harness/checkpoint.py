"""Checkpoints: atomic saves and an exact resume.

The idea
--------
A PPO run is a long loop whose state is more than the weights. To continue a run as if it had
never stopped, a checkpoint holds everything the next step reads:

    actor/, critic/         Hugging Face-format weights (config.json + model.safetensors, and the
                            tokenizer beside the actor), loadable by `transformers` and generate.py
    optim.pt                optimizer and LR-scheduler states (AdamW's moments, the step count),
                            full and keyed by parameter name; under torchrun only rank 0 reads it
    trainer_state.pt        global step, the KL controller's beta, and every RNG state (torch CPU,
                            CUDA, and the rollout sampler's generator)
    run.json                what the run was started with: the config (paths absolute), the SHA-256
                            of the model's tokenizer.json, its config.json's shapes. A resume that
                            differs stops before loading anything (nanokl/harness/run_state.py)

The data position needs no file: batches are a pure function of (seed, step) (nanokl/harness/data.py).
With all of it restored, "4 steps straight" and "2 steps, stop, resume, 2 steps" produce
bit-identical weights on CPU (tests/test_train_ppo.py proves it).

Atomicity. A checkpoint is written into `global_step_N.tmp`, then renamed to `global_step_N`,
and only then is the pointer file `latest_checkpointed_iteration.txt` (verl's name) replaced, by
writing a temporary file and `os.replace`-ing it: a rename within one file system is atomic, so a
crash at any moment leaves either the old checkpoint or the new one, never half of one. Loading
follows the pointer; leftover `.tmp` directories are ignored and cleaned on the next save.

Verification. The last file written before the rename is `manifest.json`: every other file's size
and SHA-256. `latest_checkpoint` resumes from the newest checkpoint that still matches its manifest
and names the file of each one it skips (a truncated or copied-over file); an explicitly requested
checkpoint that does not match is an error. Retention never deletes older checkpoints while the
newest one has no manifest.

Safety: weights are safetensors; optimizer and trainer state are read with
`torch.load(weights_only=True)`, which refuses to unpickle arbitrary objects.
"""

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError

from nanokl.harness.config_io import UserError
from nanokl.harness.faults import checkpoint_bytes
from nanokl.harness.hf_format import save_pretrained

POINTER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"
RECORD = "run.json"  # what the run was started with (model, tokenizer, shapes, config): read_record


def _sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(ckpt):
    """Every file under `ckpt` (but the manifest) -> its size and SHA-256, written to manifest.json."""
    ckpt = Path(ckpt)
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {p.relative_to(ckpt).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (ckpt / MANIFEST).write_text(json.dumps({"files": entries}, indent=1))


def verify_checkpoint(ckpt) -> str | None:
    """None when every file of the manifest is there with its size and SHA-256; else what is wrong,
    naming the file."""
    ckpt = Path(ckpt)
    try:
        entries = json.loads((ckpt / MANIFEST).read_text())["files"]
        assert isinstance(entries, dict)
    except FileNotFoundError:
        return f"{ckpt / MANIFEST}: missing"
    except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError):
        return f"{ckpt / MANIFEST}: unreadable"
    for name, want in entries.items():
        path = ckpt / name
        if not path.is_file():
            return f"{path}: missing"
        try:
            size, digest = want["size"], want["sha256"]
        except (KeyError, TypeError):
            return f"{ckpt / MANIFEST}: unreadable entry for {name}"
        if path.stat().st_size != size:
            return f"{path}: {path.stat().st_size} bytes, the manifest says {size}"
        if _sha256(path) != digest:
            return f"{path}: SHA-256 differs from the manifest"
    return None


def rng_state(generator=None) -> dict:
    """Every random state the loop draws from, as tensors (safe for weights_only loading)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def set_rng_state(state: dict, generator=None):
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"])


class CheckpointWriteError(Exception):
    """A checkpoint could not be written (a full disk, a quota); the previous one is untouched."""


def save_checkpoint(run_dir, step, models: dict, optim_state: dict, trainer_state: dict, tokenizer=None,
                    keep=None, record: dict | None = None, before_commit=None) -> Path:
    """Write checkpoint `global_step_{step}` atomically; keep only the newest `keep` if given.

    models: name -> module, or name -> (module, full state dict) when the weights were gathered
    from shards (saved HF-format under name/); optim_state: name -> state_dict; trainer_state:
    plain values and tensors (step, KL controller, RNG states, ...); record: what the run was started
    with, written as run.json (a resume compares it: nanokl/harness/run_state.py); before_commit: called
    once everything is written, before the rename that commits it (the run logs the step's metrics
    row there, so that no checkpoint exists without its row). Raises CheckpointWriteError,
    with nothing of the new checkpoint left on disk, when the free space is short of its size or
    the write fails."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"global_step_{step}", root / f"global_step_{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    models = {k: m if isinstance(m, tuple) else (m, None) for k, m in models.items()}
    need = checkpoint_bytes([sd if sd is not None else m for m, sd in models.values()], optim_state, trainer_state)
    free = shutil.disk_usage(root).free
    if free < need:  # refuse before writing a byte: a half-written checkpoint would only take more space
        raise CheckpointWriteError(f"checkpoint not written to {root}: it needs {need:,} bytes and {free:,} are free")
    try:
        tmp.mkdir()
        for name, (model, sd) in models.items():
            save_pretrained(model, tmp / name, state_dict=sd)
        if tokenizer is not None and "actor" in models:
            tokenizer.save(tmp / "actor")
        torch.save(optim_state, tmp / "optim.pt")
        torch.save({**trainer_state, "global_step": step}, tmp / "trainer_state.pt")
        if record is not None:
            (tmp / RECORD).write_text(json.dumps(record, indent=1) + "\n")
        write_manifest(tmp)  # last: a directory with a manifest was written whole
        if before_commit is not None:
            before_commit()
    except (OSError, RuntimeError, SafetensorError) as e:  # torch.save reports a failed write as a RuntimeError,
        # safetensors as its own SafetensorError ("Error while serializing: IoError(... StorageFull ...)")
        shutil.rmtree(tmp, ignore_errors=True)  # give the space back; the previous checkpoint is untouched
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        raise CheckpointWriteError(f"checkpoint not written to {tmp}: {why} (it needs {need:,} bytes; "
                                   f"{shutil.disk_usage(root).free:,} free)") from None
    if final.exists():  # re-saving the same step (e.g. after a rollback): replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    ptr_tmp = root / (POINTER + ".tmp")
    ptr_tmp.write_text(str(step))
    os.replace(ptr_tmp, root / POINTER)
    for stale in root.glob("global_step_*.tmp"):  # debris of an earlier crash
        shutil.rmtree(stale, ignore_errors=True)
    # never delete the last good one for a bad one. The manifest was hashed from the files on disk a
    # moment ago: its presence is the check, without reading gigabytes of weights a second time
    if keep and (final / MANIFEST).is_file():
        done = sorted((p for p in root.glob("global_step_*") if p.suffix != ".tmp"), key=_step_of)
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _step_of(path) -> int:
    try:
        return int(path.name.rsplit("_", 1)[1])
    except ValueError:
        return -1


def latest_checkpoint(run_dir, warn=True) -> Path | None:
    """The newest checkpoint that verifies against its manifest, or None when there is none: the
    pointer file's first, then the others newest first. Each one skipped is named, with its bad file,
    in a one-line warning."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    done = sorted((p for p in root.glob("global_step_*") if p.is_dir() and p.suffix != ".tmp"), key=_step_of,
                  reverse=True)
    ptr = root / POINTER
    try:
        named = root / f"global_step_{int(ptr.read_text().strip())}"
        done = sorted(done, key=lambda p: p != named)  # the pointer's target first (a stable sort)
    except (OSError, ValueError):
        pass
    legacy = None  # written before checkpoints had manifests: used, unverified, only if nothing verifies
    for path in done:
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        if legacy is None and not (path / MANIFEST).exists() and (path / "trainer_state.pt").is_file():
            legacy = path
        elif warn:
            print(f"checkpoint {path.name} skipped: {problem}", file=sys.stderr)
    if legacy is not None and warn:
        print(f"checkpoint {legacy.name} has no manifest (written before nanokl wrote them): resuming from it "
              "unverified", file=sys.stderr)
    return legacy


def load_state(path, read_optim=True) -> tuple[dict | None, dict]:
    """(optimizer states, trainer state) of a checkpoint directory; weights load separately
    with nanokl.harness.hf_format.from_pretrained(path / "actor") etc. Under torchrun only rank 0
    passes read_optim (it gets None otherwise): the states are then broadcast from rank 0
    (nanokl/dist.py), so N ranks do not each hold a full copy of Adam's moments in memory."""
    path = Path(path)
    for f in ("optim.pt", "trainer_state.pt"):
        if not (path / f).is_file():
            raise UserError(f"{path}: not a nanokl checkpoint (no {f})")

    def read(f):
        try:
            return torch.load(path / f, weights_only=True, map_location="cpu")
        except Exception as e:  # a truncated zip, a bit flip, a pickle of the wrong thing: never a traceback
            raise UserError(f"{path / f}: unreadable ({type(e).__name__})") from None
    optim = read("optim.pt") if read_optim else None
    trainer = read("trainer_state.pt")
    if not isinstance(trainer, dict) or "global_step" not in trainer:
        raise UserError(f"{path / 'trainer_state.pt'}: not a nanokl trainer state")
    return optim, trainer


def read_record(ckpt) -> dict | None:
    """The record of what the run that wrote checkpoint `ckpt` was started with (its run.json), or None
    for a checkpoint written before nanokl kept one. An unreadable one is a one-line UserError."""
    path = Path(ckpt) / RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        assert isinstance(record, dict) and isinstance(record.get("config"), dict)
    except (ValueError, AssertionError, UnicodeDecodeError, RecursionError):
        raise UserError(f"{path}: unreadable (not the JSON record nanokl writes)") from None
    return record

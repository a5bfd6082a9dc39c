"""Checkpoints: atomic saves and an exact resume.

The idea
--------
A PPO run is a long loop whose state is more than the weights. To continue a run as if it had
never stopped, a checkpoint holds everything the next step reads:

    actor/, critic/         Hugging Face-format weights (config.json + model.safetensors, and the
                            tokenizer beside the actor), loadable by `transformers` and generate.py;
                            actor/huggingface/ (critic/huggingface/): verl's HF folder, hard links to
                            those files (hf_view), what `python -m nanokl.harness.model_merger` reads
    optim.pt                optimizer and LR-scheduler states (AdamW's moments, the step count),
                            full and keyed by parameter name; under torchrun only rank 0 reads it
    trainer_state.pt        global step, the KL controller's beta, and every RNG state (torch CPU,
                            CUDA, and the rollout sampler's generator)
    run.json                what the run was started with: the config (paths absolute), the SHA-256
                            of the model's tokenizer.json, its config.json's shapes. A resume that
                            differs stops before loading anything (nanokl/harness/fingerprint.py)

The data position needs no file: batches are a pure function of (seed, step) (nanokl/harness/data.py).
With all of it restored, "4 steps straight" and "2 steps, stop, resume, 2 steps" produce
bit-identical weights on CPU (tests/test_train_ppo.py proves it).

Layout (verl's). Checkpoint N is `<trainer.default_local_dir>/global_step_N/` (actor/ and critic/
inside it, as verl's), and `<trainer.default_local_dir>/latest_checkpointed_iteration.txt` holds N,
the step of the last one committed (verl's tracker file: its `find_latest_ckpt_path` reads it), so
verl's `trainer.resume_mode=resume_path trainer.resume_from_path=<dir>/global_step_N` works as
written. nanokl before this wrote `<dir>/checkpoints/global_step_N/` (LEGACY_ROOT); those still
resume (auto finds them, resume_from_path takes them), rotate and are set aside with the new ones,
and the next checkpoint goes to verl's layout.

Atomicity. A checkpoint is written into `global_step_N.tmp`, then renamed to `global_step_N`,
and only then is the tracker file `latest_checkpointed_iteration.txt` replaced, by writing a
temporary file and `os.replace`-ing it (verl writes it after the checkpoint is complete too): a
rename within one file system is atomic, so a crash at any moment leaves either the old checkpoint
or the new one, never half of one, and the tracker only ever names a committed one. Loading
follows the tracker; leftover `.tmp` directories are ignored and cleaned on the next save.

Verification. The last file written before the rename is `manifest.json`: every other file's size
and SHA-256. `latest_checkpoint` resumes from the newest checkpoint that still matches its manifest
and names the file of each one it skips (a truncated or copied-over file); an explicitly requested
checkpoint that does not match is an error. Retention never deletes older checkpoints while the
newest one has no manifest.

Safety: weights are safetensors; optimizer and trainer state are read with
`torch.load(weights_only=True)`, which refuses to unpickle arbitrary objects.
"""

import errno
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError

from nanokl.harness.config.yaml_io import UserError
from nanokl.harness.faults import checkpoint_bytes
from nanokl.harness.hf_format import save_pretrained

POINTER = "latest_checkpointed_iteration.txt"  # verl's tracker file (get_checkpoint_tracker_filename)
LEGACY_ROOT = "checkpoints"  # where nanokl kept them before verl's layout: <dir>/checkpoints/global_step_N
MANIFEST = "manifest.json"
RECORD = "run.json"  # what the run was started with (model, tokenizer, shapes, config): read_record


def _sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _hasher():
    """_sha256 that reads each file once: a hard link (actor/huggingface/'s) has its target's digest."""
    seen = {}

    def digest(path):
        st = path.stat()
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if key not in seen:
            seen[key] = _sha256(path)
        return seen[key]
    return digest


def write_manifest(ckpt):
    """Every file under `ckpt` (but the manifest) -> its size and SHA-256, written to manifest.json."""
    ckpt, digest = Path(ckpt), _hasher()
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {p.relative_to(ckpt).as_posix(): {"size": p.stat().st_size, "sha256": digest(p)} for p in files}
    (ckpt / MANIFEST).write_text(json.dumps({"files": entries}, indent=1))


def verify_checkpoint(ckpt) -> str | None:
    """None when every file of the manifest is there with its size and SHA-256; else what is wrong,
    naming the file."""
    ckpt, digest = Path(ckpt), _hasher()
    try:
        entries = json.loads((ckpt / MANIFEST).read_text())["files"]
        assert isinstance(entries, dict)
    except FileNotFoundError:
        return f"{ckpt / MANIFEST}: missing"
    except (ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError):
        return f"{ckpt / MANIFEST}: unreadable"
    # the files resume reads first, so that a bad weights file is named where it is read, not by its link
    for name, want in sorted(entries.items(), key=lambda kv: "huggingface/" in kv[0]):
        path = ckpt / name
        if not path.is_file():
            return f"{path}: missing"
        try:
            size, want_digest = want["size"], want["sha256"]
        except (KeyError, TypeError):
            return f"{ckpt / MANIFEST}: unreadable entry for {name}"
        if path.stat().st_size != size:
            return f"{path}: {path.stat().st_size} bytes, the manifest says {size}"
        if digest(path) != want_digest:
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
                    keep=None, record: dict | None = None, before_commit=None, extra=None) -> Path:
    """Write checkpoint `<run_dir>/global_step_{step}` atomically, then the tracker file naming it; keep only
    the newest `keep` (the old layout's counted with them) if given.

    models: name -> module, or name -> (module, full state dict) when the weights were gathered
    from shards (saved HF-format under name/); optim_state: name -> state_dict; trainer_state:
    plain values and tensors (step, KL controller, RNG states, ...); record: what the run was started
    with, written as run.json (a resume compares it: nanokl/harness/fingerprint.py); before_commit: called
    once everything is written, before the rename that commits it (the run logs the step's metrics
    row there, so that no checkpoint exists without its row); extra: called with the folder being written,
    to add files before the manifest (a LoRA run's adapters: harness/lora_run.py). Raises CheckpointWriteError,
    with nothing of the new checkpoint left on disk, when the free space is short of its size or
    the write fails."""
    root = Path(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"global_step_{step}", root / f"global_step_{step}.tmp"  # verl's layout, always
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
        if extra is not None:
            extra(tmp)
        for name in models:
            hf_view(tmp / name)
        torch.save(optim_state, tmp / "optim.pt")
        torch.save({**trainer_state, "global_step": step}, tmp / "trainer_state.pt")
        if record is not None:
            (tmp / RECORD).write_text(json.dumps(record, indent=1) + "\n")
        write_manifest(tmp)  # last: a directory with a manifest was written whole
        if before_commit is not None:
            before_commit()
        if final.exists():  # re-saving the same step (e.g. after a rollback): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)  # the commit: refused too in a folder that became read-only
    except (OSError, RuntimeError, SafetensorError) as e:  # torch.save reports a failed write as a RuntimeError,
        # safetensors as its own SafetensorError ("Error while serializing: IoError(... StorageFull ...)")
        shutil.rmtree(tmp, ignore_errors=True)  # give the space back; the previous checkpoint is untouched
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):  # not a matter of space
            raise CheckpointWriteError(f"checkpoint not written to {tmp}: {why} (the folder {root} refuses "
                                       "writes)") from None
        raise CheckpointWriteError(f"checkpoint not written to {tmp}: {why} (it needs {need:,} bytes; "
                                   f"{shutil.disk_usage(root).free:,} free)") from None
    ptr_tmp = root / (POINTER + ".tmp")  # the tracker names committed checkpoints only: after the rename
    ptr_tmp.write_text(str(step))
    os.replace(ptr_tmp, root / POINTER)
    legacy = root / LEGACY_ROOT
    if (legacy / final.name).is_dir():  # the same step in the old layout (a re-save after a rollback): superseded
        shutil.rmtree(legacy / final.name, ignore_errors=True)
    for where in (root, legacy):
        for stale in where.glob("global_step_*.tmp"):  # debris of an earlier crash
            shutil.rmtree(stale, ignore_errors=True)
    # never delete the last good one for a bad one. The manifest was hashed from the files on disk a
    # moment ago: its presence is the check, without reading gigabytes of weights a second time
    if keep and (final / MANIFEST).is_file():
        for old in sorted(committed(root), key=_step_of)[:-keep]:  # both layouts: the oldest go first
            shutil.rmtree(old, ignore_errors=True)
    if legacy.is_dir() and not committed(legacy, legacy_too=False):  # the old layout's last one rotated out
        (legacy / POINTER).unlink(missing_ok=True)
        try:
            legacy.rmdir()  # only when nothing else is left in it
        except OSError:
            pass
    return final


def hf_view(folder):
    """`folder`/huggingface/: verl's FSDP checkpoint manager writes `global_step_N/actor/huggingface/` (the HF
    config and tokenizer; the weights too when checkpoint.save_contents has hf_model), and scripts read it
    there. nanokl's actor/ (critic/) is already that HF folder (under LoRA the merged export), so huggingface/
    holds hard links to its files (config.json, model.safetensors, the tokenizer's): no second copy of the
    weights. Where a hard link is refused (a file system without them) the small files are copied and the
    weights left out. LoRA's adapter files stay in actor/ alone; resume never reads huggingface/, and the
    manifest covers it (a hard link is hashed once)."""
    folder = Path(folder)
    view = folder / "huggingface"
    view.mkdir(exist_ok=True)
    for f in sorted(folder.iterdir()):
        if not f.is_file() or f.name.startswith("lora_adapters"):
            continue
        try:
            os.link(f, view / f.name)
        except OSError:
            if f.suffix != ".safetensors":  # a copy of the small files only, never of the weights
                shutil.copy2(f, view / f.name)


def checkpoint_dir(run_dir, step) -> Path:
    """Where checkpoint `step` of the run in `run_dir` is: verl's `<dir>/global_step_N`, or the old layout's
    `<dir>/checkpoints/global_step_N` when only that one exists (written before verl's layout)."""
    new, old = Path(run_dir) / f"global_step_{step}", Path(run_dir) / LEGACY_ROOT / f"global_step_{step}"
    return old if not new.is_dir() and old.is_dir() else new


def committed(run_dir, legacy_too=True) -> list[Path]:
    """The committed checkpoint directories of the run in `run_dir` (no .tmp), in verl's layout and, with
    legacy_too, in the old `checkpoints/` one; unordered."""
    roots = [Path(run_dir)] + ([Path(run_dir) / LEGACY_ROOT] if legacy_too else [])
    return [p for root in roots for p in root.glob("global_step_*")
            if p.is_dir() and p.suffix != ".tmp" and _step_of(p) >= 0]


def _step_of(path) -> int:
    try:
        return int(path.name.rsplit("_", 1)[1])
    except ValueError:
        return -1


def latest_checkpoint(run_dir, warn=True) -> Path | None:
    """The newest checkpoint that verifies against its manifest, or None when there is none: the
    tracker file's first (verl's `<dir>/latest_checkpointed_iteration.txt`; the old layout's
    `<dir>/checkpoints/` one when verl's is absent), then the others newest first, over both layouts
    (verl's before the old one's at the same step). Each one skipped is named, with its bad file, in a
    one-line warning."""
    root = Path(run_dir)
    done = sorted(committed(root), key=lambda p: (_step_of(p), p.parent == root), reverse=True)
    for where in (root, root / LEGACY_ROOT):
        try:
            named = where / f"global_step_{int((where / POINTER).read_text().strip())}"
        except (OSError, ValueError):
            continue
        done = sorted(done, key=lambda p: p != named)  # the tracker's target first (a stable sort)
        break  # verl's tracker, when there is one, is the newer
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
    (nanokl/engine/shard.py), so N ranks do not each hold a full copy of Adam's moments in memory."""
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

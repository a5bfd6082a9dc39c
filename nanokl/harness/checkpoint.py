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

The data position needs no file: batches are a pure function of (seed, step) (nanokl/harness/data.py).
With all of it restored, "4 steps straight" and "2 steps, stop, resume, 2 steps" produce
bit-identical weights on CPU (tests/test_train_ppo.py proves it).

Atomicity. A checkpoint is written into `global_step_N.tmp`, then renamed to `global_step_N`,
and only then is the pointer file `latest_checkpointed_iteration.txt` (verl's name) replaced, by
writing a temporary file and `os.replace`-ing it: a rename within one file system is atomic, so a
crash at any moment leaves either the old checkpoint or the new one, never half of one. Loading
follows the pointer; leftover `.tmp` directories are ignored and cleaned on the next save.

Safety: weights are safetensors; optimizer and trainer state are read with
`torch.load(weights_only=True)`, which refuses to unpickle arbitrary objects.
"""

import os
import shutil
from pathlib import Path

import torch

from nanokl.harness.config_io import UserError
from nanokl.harness.hf_format import save_pretrained

POINTER = "latest_checkpointed_iteration.txt"


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


def save_checkpoint(run_dir, step, models: dict, optim_state: dict, trainer_state: dict, tokenizer=None,
                    keep=None) -> Path:
    """Write checkpoint `global_step_{step}` atomically; keep only the newest `keep` if given.

    models: name -> module, or name -> (module, full state dict) when the weights were gathered
    from shards (saved HF-format under name/); optim_state: name -> state_dict; trainer_state:
    plain values and tensors (step, KL controller, RNG states, ...)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"global_step_{step}", root / f"global_step_{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    for name, model in models.items():
        model, sd = model if isinstance(model, tuple) else (model, None)
        save_pretrained(model, tmp / name, state_dict=sd)
    if tokenizer is not None and "actor" in models:
        tokenizer.save(tmp / "actor")
    torch.save(optim_state, tmp / "optim.pt")
    torch.save({**trainer_state, "global_step": step}, tmp / "trainer_state.pt")
    if final.exists():  # re-saving the same step (e.g. after a rollback): replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    ptr_tmp = root / (POINTER + ".tmp")
    ptr_tmp.write_text(str(step))
    os.replace(ptr_tmp, root / POINTER)
    for stale in root.glob("global_step_*.tmp"):  # debris of an earlier crash
        shutil.rmtree(stale, ignore_errors=True)
    if keep:
        done = sorted((p for p in root.glob("global_step_*") if p.suffix != ".tmp"),
                      key=lambda p: int(p.name.rsplit("_", 1)[1]))
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir) -> Path | None:
    """The checkpoint the pointer file names, or None when the run has none yet."""
    root = Path(run_dir) / "checkpoints"
    ptr = root / POINTER
    if not ptr.is_file():
        return None
    path = root / f"global_step_{int(ptr.read_text().strip())}"
    if path.is_dir():
        return path
    # a crash while re-saving the same step removed it: fall back to the newest complete one
    done = [p for p in root.glob("global_step_*") if p.suffix != ".tmp" and (p / "trainer_state.pt").is_file()]
    return max(done, key=lambda p: int(p.name.rsplit("_", 1)[1]), default=None)


def load_state(path, read_optim=True) -> tuple[dict | None, dict]:
    """(optimizer states, trainer state) of a checkpoint directory; weights load separately
    with nanokl.harness.hf_format.from_pretrained(path / "actor") etc. Under torchrun only rank 0
    passes read_optim (it gets None otherwise): the states are then broadcast from rank 0
    (nanokl/dist.py), so N ranks do not each hold a full copy of Adam's moments in memory."""
    path = Path(path)
    for f in ("optim.pt", "trainer_state.pt"):
        if not (path / f).is_file():
            raise UserError(f"{path}: not a nanokl checkpoint (no {f})")
    optim = torch.load(path / "optim.pt", weights_only=True, map_location="cpu") if read_optim else None
    trainer = torch.load(path / "trainer_state.pt", weights_only=True, map_location="cpu")
    return optim, trainer

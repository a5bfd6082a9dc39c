"""What depends on torchrun's world size, checked once at setup before any model is built: verl's node
and GPU counts against the processes torchrun started, verl's older global micro-batch sizes mapped to
the per-GPU ones nanokl reads (verl's workers divide them by the world size), and the batch sizes that
must divide evenly among the processes. Split from run.py to keep each file short.

And this process's device (`pick_device`): nanokl.engine.dist.local_device's choice, plus the one line that
says why trainer.device=auto runs on the CPU of a machine that has an NVIDIA GPU (tests/test_local_device.py)."""

import functools
import re
import sys
import warnings
from pathlib import Path

import torch

from nanokl.engine import dist
from nanokl.harness.config.yaml_io import ConfigError, UserError
from nanokl.harness.config.rules import validate as validate_config


# verl's older micro-batch sizes count responses over all GPUs: verl's workers divide them by the world size
_GLOBAL_SIZES = (("actor_rollout_ref.actor", "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu"),
                 ("actor_rollout_ref.ref", "log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu"),
                 ("actor_rollout_ref.rollout", "log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu"),
                 ("critic", "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu"),
                 ("critic", "forward_micro_batch_size", "forward_micro_batch_size_per_gpu"),
                 ("reward_model", "micro_batch_size", "micro_batch_size_per_gpu"))


def check_world(cfg, W, needs_critic):
    """What depends on torchrun's world size W: verl's node/GPU counts, its global micro-batch sizes
    (mapped to the per-GPU ones here, in place), the divisibility of the batch sizes."""
    d, a, c, t = cfg.data, cfg.actor_rollout_ref.actor, cfg.critic, cfg.trainer
    if t.n_gpus_per_node is not None and t.n_gpus_per_node * t.nnodes != W:
        raise ConfigError(f"trainer.n_gpus_per_node x trainer.nnodes = {t.n_gpus_per_node} x {t.nnodes} = "
                          f"{t.n_gpus_per_node * t.nnodes}, but the run has {W} process(es) (torchrun's world size): start "
                          f"{t.n_gpus_per_node * t.nnodes} (torchrun --nproc_per_node={t.n_gpus_per_node} "
                          f"--nnodes={t.nnodes}), or set them to match", keys=("trainer.n_gpus_per_node", "trainer.nnodes"))
    if t.n_gpus_per_node is None and W % t.nnodes:
        raise ConfigError(f"trainer.nnodes ({t.nnodes}) must divide the run's {W} process(es)",
                          keys="trainer.nnodes")
    if cfg.algorithm.filter_groups.enable and W > 1:  # each rank would need its own number of sampling rounds
        raise ConfigError(f"algorithm.filter_groups.enable samples until enough groups are kept, in one process: "
                          f"run it with plain python, not {W} processes", keys="algorithm.filter_groups.enable")
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    if W % tp:
        raise ConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size ({tp}) must divide the {W} "
                          f"process(es) of the run (as in verl)", keys="actor_rollout_ref.rollout.tensor_model_parallel_size")
    mapped = False
    for path, old, new in _GLOBAL_SIZES:
        section = functools.reduce(getattr, path.split("."), cfg)
        size = getattr(section, old)
        if size is not None:
            if size % W:
                raise ConfigError(f"{path}.{old} ({size}, over all GPUs) must be divisible by the {W} process(es)",
                                  keys=f"{path}.{old}")
            setattr(section, new, size // W)
            setattr(section, old, None)  # the config saved with the run holds the per-GPU size only
            mapped = True
    if mapped:  # the per-GPU sizes must divide the mini-batches like any given one
        validate_config(cfg)
    for key, v in (("data.train_batch_size", d.train_batch_size), ("actor_rollout_ref.actor.ppo_mini_batch_size",
                   a.ppo_mini_batch_size), ("critic.ppo_mini_batch_size", c.ppo_mini_batch_size)):
        if v % W:
            raise UserError(f"{key} ({v}) must be divisible by the number of processes ({W})")
    # (a frozen reference may stay `none`: a full copy per process, like a DDP replica without grads)
    for key, v in (("actor_rollout_ref.actor.strategy", a.strategy), ("critic.strategy", c.strategy)):
        if v == "none" and W > 1 and (key != "critic.strategy" or needs_critic):
            # each process would train its own model and silently diverge
            raise UserError(f"{key}=none runs one process, but torchrun started {W}: use ddp or fsdp2")


def pick_device(setting):
    """dist.local_device(setting) for trainer.device = cpu | cuda | auto. `auto` on a CUDA build of
    torch that finds no usable GPU on a machine that has one (a driver loaded, or torch warning about
    CUDA) says why on stderr, once: a driver older than the build needs otherwise looks like a run
    that chose the CPU (torch 2.14's cu130 wheels need driver >= 580)."""
    if setting == "auto":
        _say_why_no_cuda()
    return dist.local_device(setting)


_SAID_CPU = []
# the oldest driver that runs a build for each CUDA major (NVIDIA's CUDA Compatibility guide, "Minor
# Version Compatibility": 11.x >= 450, 12.x >= 525, 13.x >= 580)
_MIN_DRIVER = {11: "450", 12: "525", 13: "580"}
_DRIVER_FILE = "/proc/driver/nvidia/version"  # the loaded kernel module's version, without nvidia-smi


def _say_why_no_cuda():
    """The line `auto` prints where CUDA is unusable on a machine with a GPU; torch's own CUDA warning
    goes into it, and any other warning reaches the caller's filters as if never caught."""
    with warnings.catch_warnings(record=True) as caught:  # torch warns at most once: keep it
        warnings.simplefilter("always")
        usable = torch.cuda.is_available()
    said = next((w for w in caught if "cuda" in str(w.message).lower()), None) if not usable else None
    # a CUDA build of torch on a machine with no GPU (no driver loaded, torch silent) is ordinary:
    # say nothing; a driver or torch's own CUDA warning means a GPU this run cannot use
    gpu_here = said is not None or Path(_DRIVER_FILE).exists()
    if not usable and torch.version.cuda and gpu_here and not _SAID_CPU:
        _SAID_CPU.append(True)
        print(f"nanokl: trainer.device=auto runs on the CPU: {_why_no_cuda(said)}", file=sys.stderr)
    for w in caught:  # the others reach the caller's filters as if never caught
        if w is not said:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _why_no_cuda(warned):
    """One line: the driver found, what this torch build needs, and torch's own warning if any."""
    cuda = torch.version.cuda
    need = _MIN_DRIVER.get(int(cuda.split(".")[0]))
    why = f"torch {torch.__version__} is built for CUDA {cuda}"
    why += f", which needs NVIDIA driver >= {need}" if need else ""
    try:
        found = re.search(r"\b(\d{3,}\.\d+(?:\.\d+)?)\b", Path(_DRIVER_FILE).read_text())
        why += f"; this machine's driver is {found.group(1)}" if found else f"; {_DRIVER_FILE} names no version"
    except OSError:
        why += f"; no NVIDIA driver loaded ({_DRIVER_FILE} absent)"
    if warned is not None:  # e.g. "The NVIDIA driver on your system is too old (found version 12080)"
        why += f"; torch: {' '.join(str(warned.message).split())[:240]}"
    return why

"""LoRA in the trainer (actor_rollout_ref.model.lora_rank > 0): nanokl/lora.py wired into the run.

    setup        the actor loads from actor_rollout_ref.model.path (the base, also when resuming),
                 `attach` adds the adapters (A drawn from trainer.seed; a resume then loads the
                 checkpoint's A and B) and returns the reference: `AdaptersOff(actor)`, the actor
                 itself with its adapters skipped, not a second model. One line on rank 0 says so.
    optimizer    A and B alone (add_adapters freezes the rest; harness/optim.py takes the
                 parameters that require grad)
    rollout      on CPU the adapted actor samples itself; a rollout copy (CUDA) receives the
                 merged weights W + (alpha/r)·B A (engine/shard.py's sync_rollout_weights)
    checkpoints  actor/ is the merged export (config.json + model.safetensors: what transformers
                 and generate.py load), actor/lora_adapters.safetensors the adapters alone and
                 actor/lora_adapters.json their rank, alpha and modules; the optimizer state is
                 keyed by the adapters' names. A rollback reloads the adapters (the base never moved)
    reference    ref_check.py checksums the frozen base (`AdaptersOff`'s parameters) and refuses an
                 adapter shared with it; "start over from the reference" (remedies.py) is B = 0

Refused in one line: FSDP2-sharded actors (the adapters would be sharded beside a frozen base, and the
merged export gathered from shards; not built here).
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nanokl.engine import dist, shard
from nanokl.harness.config.yaml_io import UserError
from nanokl.lora import (AdaptersOff, adapter_state_dict, adapters, add_adapters, load_adapter_state_dict,
                         merged_state_dict, reset_adapters, trainable_parameters)

ADAPTERS, META = "lora_adapters.safetensors", "lora_adapters.json"
_M = "actor_rollout_ref.model."


def lora_enabled(cfg) -> bool:
    return cfg.actor_rollout_ref.model.lora_rank > 0


def refuse_unsupported(cfg):
    """What LoRA cannot run with here: a one-line UserError (start-up, before any model loads)."""
    a = cfg.actor_rollout_ref.actor
    if lora_enabled(cfg) and shard.sharded(a.strategy):
        raise UserError(f"{_M}lora_rank={cfg.actor_rollout_ref.model.lora_rank} is not supported with "
                        f"actor_rollout_ref.actor.strategy=fsdp2 under torchrun: nanokl's LoRA runs on a plain or "
                        f"DDP actor (strategy=ddp)")


def attach(actor, cfg, ckpt=None) -> AdaptersOff:
    """Adapters on the freshly loaded base `actor` (the checkpoint's when resuming), the start-up line
    said on rank 0; returns the reference, the actor with its adapters off."""
    m = cfg.actor_rollout_ref.model
    device = next(actor.parameters()).device
    gen = torch.Generator(device=device).manual_seed(cfg.trainer.seed)
    try:
        names = add_adapters(actor, m.lora_rank, m.lora_alpha, m.target_modules, m.exclude_modules,
                             generator=gen)
    except ValueError as e:
        raise UserError(f"{_M}target_modules={m.target_modules!r} / exclude_modules={m.exclude_modules!r}: "
                        f"{e}") from None
    if ckpt is not None:
        load_adapters(actor, Path(ckpt) / "actor")
    if dist.rank() == 0:
        kinds = ", ".join(dict.fromkeys(n.rpartition(".")[2] for n in names))
        total = sum(p.numel() for p in actor.parameters())
        print(f"LoRA: rank {m.lora_rank}, alpha {m.lora_alpha} on {len(names)} modules ({kinds}): "
              f"{trainable_parameters(actor):,} trainable of {total:,} parameters; the reference is the actor "
              f"with its adapters off (no reference copy)", file=sys.stderr)
    return AdaptersOff(actor).eval()


def has_adapters(model) -> bool:
    return bool(adapters(shard.unwrap(model)))


def full_weights(model) -> dict:
    """The weights a checkpoint's folder holds: the merged export under LoRA (rank 0; {} elsewhere),
    else the gathered full state dict."""
    if not has_adapters(model):
        return shard.full_state_dict(model)
    return {k: v.cpu() for k, v in merged_state_dict(shard.unwrap(model)).items()} if dist.rank() == 0 else {}


def adapter_writer(model):
    """None without adapters, else a function writing them into a checkpoint folder's actor/."""
    if not has_adapters(model):
        return None
    return lambda folder: save_adapters(shard.unwrap(model), Path(folder) / "actor")


def save_adapters(model, path):
    """lora_adapters.safetensors (A and B) and lora_adapters.json (rank, alpha, modules) in `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mods = adapters(model)
    save_file({k: v.detach().cpu().contiguous() for k, v in adapter_state_dict(model).items()}, path / ADAPTERS,
              metadata={"format": "pt"})
    first = next(iter(mods.values()))
    meta = {"lora_rank": first.lora_A.shape[0], "scale": first.scale, "target_modules": list(mods)}
    (path / META).write_text(json.dumps(meta, indent=1) + "\n")


def load_adapters(model, path):
    """A and B from `path`/lora_adapters.safetensors into the adapted model (a one-line UserError when
    the file is missing or does not fit)."""
    f = Path(path) / ADAPTERS
    if not f.is_file():
        raise UserError(f"{f}: missing; a LoRA run resumes from the adapters its checkpoints hold "
                        f"({_M}lora_rank > 0, but this checkpoint was written without LoRA?)")
    try:
        load_adapter_state_dict(model, load_file(f, device=str(next(model.parameters()).device)))
    except ValueError as e:
        raise UserError(f"{f}: {e}") from None


@torch.no_grad()
def restart_from_reference(actor):
    """The policy back at the reference: B = 0 in every adapter (the base never moved)."""
    reset_adapters(shard.unwrap(actor))

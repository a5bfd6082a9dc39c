"""The optimizers of a run and verl's two learning-rate schedules: AdamW, a linear warm-up, then a
constant or cosine rate (down to min_lr_ratio of the base)."""

import math

import torch

from nanokl.engine import shard


def lr_lambda(optim, total_steps):
    """Linear warm-up, then constant or cosine down to min_lr_ratio (verl's two schedules)."""
    warm = optim.lr_warmup_steps if optim.lr_warmup_steps > 0 else int(optim.lr_warmup_steps_ratio * total_steps)

    def f(step):
        if step < warm:
            return (step + 1) / warm
        if optim.lr_scheduler_type == "cosine":
            progress = (step - warm) / max(1, total_steps - warm)
            return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0
    return f


def make_optimizer(model, optim, total_steps, offload_state=False):
    # under LoRA the adapters alone; a model with nothing trainable keeps them all (a reference that is the
    # actor froze it: harness/ref_check.py's setup test then names the cause, not torch's empty-list error)
    params = [p for p in model.parameters() if p.requires_grad] or list(model.parameters())
    # On CUDA, torch's fused AdamW: one kernel per step for all parameters instead of a dozen per group
    # (the same update up to float rounding). The CPU keeps the default for-each path, bit for bit as before.
    fused = bool(params) and all(p.device.type == "cuda" for p in params) or None
    opt = torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                            fused=fused)
    if offload_state:  # fsdp_config.optimizer_offload alone: the state waits on CPU between steps (nanokl/engine/shard.py)
        shard.offload_optimizer(opt)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(optim, total_steps))

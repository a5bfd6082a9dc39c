"""Data parallelism under torchrun: process groups, DDP / FSDP2, weights for rollout, reductions.

The idea
--------
`torchrun --nproc_per_node=8 train_ppo.py` starts 8 copies of the script; each reads RANK,
WORLD_SIZE and LOCAL_RANK from its environment and joins one process group (NCCL on GPUs, gloo on
CPU). A plain `python train_ppo.py` is world size 1 and needs no process group: every helper
below is then the identity. The data are split, the models are not (or are sharded):

- `none`: one process holds the whole model (world size 1).
- `ddp` (DistributedDataParallel): every rank holds a full replica; backward all-reduces (averages)
  the gradients, so the replicas stay identical. Memory per GPU: weights + grads + Adam's two
  moments = 16 bytes/parameter in fp32.
- `fsdp2` (`torch.distributed.fsdp.fully_shard`, Zhao et al. 2023): each decoder layer and the root
  are sharded across the ranks; a layer's full weights are all-gathered just before its forward or
  backward and freed after, gradients are reduce-scattered. Memory per GPU: 16/W bytes/parameter
  plus one layer's gathered weights. On CUDA a `MixedPrecisionPolicy` computes in bf16 and reduces
  gradients in fp32; the fp32 master weights stay sharded. The reference model is sharded too.

Rollout needs the policy's whole weights on every rank, and a CUDA graph needs them at fixed
addresses. nanokl's minimal version of verl's hybrid engine keeps one *rollout copy* of the policy
per rank (bf16 on CUDA, fp32 on CPU); after each update `sync_rollout_weights` all-gathers the
actor's shards one tensor at a time (`DTensor.full_tensor()`) and copies them in place, so the
copy's storage never moves and its captured graphs stay valid. Memory cost: 2 bytes/parameter for
the bf16 copy (its KV cache on top), plus one full fp32 tensor in flight during the sync. With
`none` on CPU the actor itself is the rollout model (no copy); with `ddp` the copy shares nothing
with the replica only on CUDA (bf16), on CPU rollout reads the replica's module directly.

Data-parallel semantics (train_ppo.py): rank r takes prompts [r*B/W, (r+1)*B/W) of the global
batch, so a GRPO group (the n samples of a prompt) never straddles two ranks; advantage whitening,
the KL the controller sees and every logged metric are reduced over ranks (`all_reduce`), so the
numbers do not depend on W; rank 0 logs and writes checkpoints, which hold full (gathered)
HF-format weights and an optimizer state keyed by parameter name (`optimizer_state`), loadable by
any world size. tests/test_dist.py spawns 2 gloo processes and checks that one PPO update with DDP
and with FSDP2 gives the parameters of one process on the whole batch (<= 1e-5 fp32).
"""

import contextlib
import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)


def init():
    """(rank, world_size, device) from torchrun's environment; joins the process group if W > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if world > 1 and not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=30))
    return rank(), world, local_device()


def local_device(setting="auto"):
    """This process's device for trainer.device = cpu | cuda | auto (CUDA when there is one);
    on CUDA the GPU torchrun gave it (LOCAL_RANK)."""
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")


def active():
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank():
    return dist.get_rank() if active() else 0


def world():
    return dist.get_world_size() if active() else 1


def barrier():
    if active():
        dist.barrier()


def destroy():
    """Leave the process group. Call it after the wrapped models are gone: a DDP Reducer that
    outlives the group joins gloo's threads in its destructor at interpreter exit and can hang
    once the peer has left; the barrier makes every rank arrive before any leaves."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        gc.collect()  # DDP wrappers sit in reference cycles: free them (and their Reducers) now
        dist.destroy_process_group()


def all_reduce(t, op="sum"):
    """A tensor reduced over ranks (a new tensor; the identity at world size 1)."""
    t = torch.as_tensor(t).clone()
    if active():
        home = t.device
        if dist.get_backend() == "nccl" and home.type != "cuda":
            t = t.cuda()  # NCCL reduces GPU tensors only
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        dist.all_reduce(t, op=ops[op])
        t = t.to(home)
    return t


def all_reduce_moments(stats):
    """Global (sum, sum of squares, count) from this rank's (nanokl/advantages.py's `whiten_stats`)."""
    return tuple(all_reduce(x) for x in stats)


def wrap(model, strategy, device, trainable=True):
    """The model as its strategy runs it: itself, a DDP replica, or FSDP2-sharded.

    Build the optimizer right after wrapping, before any forward: between a no-grad forward and
    the next backward FSDP2 registers the root's *unsharded* parameters on the module, and an
    optimizer built then would update copies that the next reshard throws away."""
    if strategy == "none" or not active():
        return model
    if strategy == "ddp":
        if not trainable:
            return model  # a frozen replica needs no gradient synchronisation
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device.type, (world(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" \
        else MixedPrecisionPolicy()
    for layer in unwrap(model).model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def unwrap(model):
    """The module underneath a DDP wrapper (FSDP2 shards in place: the module is itself)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def no_sync(model, skip):
    """DDP: accumulate this backward locally (`skip`) and all-reduce only on the last micro-batch."""
    if skip and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def full_tensors(model):
    """(name, full tensor) of every parameter, all-gathering FSDP2 shards one at a time."""
    for name, p in unwrap(model).named_parameters():
        yield name, (p.full_tensor() if hasattr(p, "full_tensor") else p)


@torch.no_grad()
def sync_rollout_weights(rollout_model, actor):
    """Copy the actor's current weights into the rollout copy, in place (its graphs stay valid)."""
    for (name, full), (rname, p) in zip(full_tensors(actor), rollout_model.named_parameters()):
        assert name == rname, (name, rname)
        p.copy_(full)


def full_state_dict(model):
    """Full (gathered) weights on rank 0, for an HF-format checkpoint; {} on the other ranks."""
    sd = get_model_state_dict(unwrap(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if rank() == 0 else {}


def load_full_state_dict(model, sd):
    """Load full (unsharded) weights into a plain, DDP or FSDP2 model; each rank keeps its shard."""
    set_model_state_dict(unwrap(model), sd, options=StateDictOptions(full_state_dict=True))


def optimizer_state(model, opt):
    """The optimizer's full state keyed by parameter name (rank 0): loadable by any world size."""
    return get_optimizer_state_dict(unwrap(model), opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model, opt, state):
    set_optimizer_state_dict(unwrap(model), opt, state, options=StateDictOptions(full_state_dict=True))


def global_stats(values, mask=None):
    """(mean, max, min) of the masked entries over all ranks (nan when there are none)."""
    v = (values[mask.bool()] if mask is not None else values.flatten()).float()
    total = all_reduce(torch.stack([v.sum(), torch.tensor(float(v.numel()), device=v.device)]))
    hi = all_reduce(v.max() if v.numel() else torch.tensor(-float("inf"), device=v.device), op="max")
    lo = all_reduce(v.min() if v.numel() else torch.tensor(float("inf"), device=v.device), op="min")
    mean = (total[0] / total[1]).item() if total[1] > 0 else float("nan")
    return mean, hi.item(), lo.item()

"""Data parallelism under torchrun: the process group, and reductions that make results world-size independent.

The idea
--------
`torchrun --nproc_per_node=8 train_ppo.py` starts 8 copies of the script; each reads RANK,
WORLD_SIZE and LOCAL_RANK from its environment and joins one process group (NCCL on GPUs, gloo on
CPU). The data are split, the models are not (or are sharded): how each model is replicated (DDP)
or sharded (FSDP2), offloaded, copied for rollout and checkpointed is nanokl/engine/shard.py's.

Who gets a process group. A plain `python train_ppo.py` gets none: every helper below (and every
one in nanokl/engine/shard.py) is then the identity and the run is the same, bit for bit, as if these
modules did not exist. Any process that torchrun started (its environment names RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) joins a group, *even at world size 1*: the configured strategy is then
applied as written, so `torchrun --nproc_per_node=1` with fsdp2 really shards over one rank (the
parameters are DTensors on a 1-device mesh, gathered by FSDP2 - torch 2.13 copies a 1-rank shard
instead of calling NCCL - and computed in bf16 by the policy) and one GPU exercises the code that
eight run. Collectives that only combine ranks' values (`all_reduce`, `barrier`) are skipped when
there is one rank: their result would be their input.

Data-parallel semantics (train_ppo.py): rank r takes prompts [r*B/W, (r+1)*B/W) of the global
batch, so a GRPO group (the n samples of a prompt) never straddles two ranks; advantage whitening,
the KL the controller sees and every logged metric are reduced over ranks (`all_reduce`), so the
numbers do not depend on W; rank 0 logs and writes checkpoints (nanokl/engine/shard.py gathers their
weights and optimizer state, and broadcasts them from rank 0 on resume).

How the tests check it (tests/test_dist.py, gloo processes on CPU): one PPO update over 2
processes logs the same metrics and ends with the parameters of one process on the whole batch
(<= 1e-5 fp32), the models wrapped by nanokl/engine/shard.py and every count, sum and extreme reduced here.
"""

import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist


def launched():
    """True when a launcher (torchrun) started this process: the env:// rendezvous is set."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


TIMEOUT_S = [None]  # the process group's collective timeout, in seconds, once joined


def timed_out(error: BaseException) -> bool:
    """Is `error` a collective that gave up waiting for another rank (gloo: "Timed out waiting ...ms";
    NCCL's watchdog: "... ran for ... milliseconds before timing out")?"""
    text = str(error).lower()
    return active() and isinstance(error, RuntimeError) and ("timed out" in text or "timing out" in text)


def init(timeout_s=None):
    """(rank, world_size, device); joins the process group whenever torchrun started the process. timeout_s
    (verl's actor_rollout_ref.nccl_timeout; None: 30 minutes, torch's own default for gloo) bounds every
    collective, NCCL's and gloo's alike: a rank that waits that long for a frozen or dead peer raises
    instead of hanging the job. The first call decides it."""
    cuda = torch.cuda.is_available()
    if launched() and dist.is_available() and not dist.is_initialized():
        # NCCL binds to the GPU named here; left to guess, it maps rank -> GPU by the global rank and warns
        # that this can hang when the mapping differs (seen on the first H200 run, torch 2.11)
        device_id = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else None
        if cuda:
            torch.cuda.set_device(device_id)
        backend = "nccl" if cuda else "gloo"
        timeout = timedelta(minutes=30) if timeout_s is None else timedelta(seconds=timeout_s)
        TIMEOUT_S[0] = timeout.total_seconds()
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun --max-restarts keeps its store across restarts, and a restarted gloo group can read the
            # dead attempt's addresses from it (torch 2.13: it then hangs or fails to connect): give each
            # attempt its own key space in the agent's store
            R, W = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), W, is_master=False,
                                  timeout=timeout)
            dist.init_process_group(backend, store=dist.PrefixStore(f"nanokl/attempt_{attempt}", store), rank=R,
                                    world_size=W, timeout=timeout, device_id=device_id)
        else:
            dist.init_process_group(backend, timeout=timeout, device_id=device_id)
    return rank(), world(), local_device()


def local_device(setting="auto"):
    """This process's device for trainer.device = cpu | cuda | auto (CUDA when there is one);
    on CUDA the GPU torchrun gave it (LOCAL_RANK). Why `auto` found no GPU on a machine that has
    one is the harness's to say (nanokl/harness/world.py: pick_device)."""
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")


def active():
    """A process group exists (torchrun started us), at any world size."""
    return dist.is_available() and dist.is_initialized()


def rank():
    return dist.get_rank() if active() else 0


def world():
    return dist.get_world_size() if active() else 1



def barrier():
    if world() > 1:
        dist.barrier()


def destroy():
    """Leave the process group. Call it after the wrapped models are gone: a DDP Reducer that
    outlives the group joins gloo's threads in its destructor at interpreter exit and can hang
    once the peer has left; the barrier makes every rank arrive before any leaves."""
    if active():
        dist.barrier()
        gc.collect()  # DDP wrappers sit in reference cycles: free them (and their Reducers) now
        dist.destroy_process_group()


def all_reduce(t, op="sum"):
    """A tensor reduced over ranks (a new tensor; the identity at world size 1)."""
    t = torch.as_tensor(t).clone()
    if world() > 1:
        home = t.device
        if dist.get_backend() == "nccl" and home.type != "cuda":
            t = t.cuda()  # NCCL reduces GPU tensors only
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        dist.all_reduce(t, op=ops[op])
        t = t.to(home)
    return t


def agreed_count(count):
    """The count every rank uses: the largest any rank has (one all-reduce; e.g. of micro-batches,
    nanokl/engine/batching.py's agreed_micro_batches, since every rank must run as many)."""
    return all_reduce(torch.tensor(count), op="max").item()


def all_reduce_moments(stats):
    """Global (sum, sum of squares, count) from this rank's (nanokl/advantages.py's `whiten_stats`)."""
    return tuple(all_reduce(x) for x in stats)


def broadcast_object(obj):
    """Rank 0's `obj` (any picklable value) on every rank; the others may pass None."""
    if world() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj) -> list:
    """Every rank's `obj` (any picklable value), in rank order, on every rank."""
    if world() == 1:
        return [obj]
    out = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def global_stats(values, mask=None):
    """(mean, max, min) of the masked entries over all ranks (nan when there are none)."""
    v = (values[mask.bool()] if mask is not None else values.flatten()).float()
    total = all_reduce(torch.stack([v.sum(), torch.tensor(float(v.numel()), device=v.device)]))
    hi = all_reduce(v.max() if v.numel() else torch.tensor(-float("inf"), device=v.device), op="max")
    lo = all_reduce(v.min() if v.numel() else torch.tensor(float("inf"), device=v.device), op="min")
    mean = (total[0] / total[1]).item() if total[1] > 0 else float("nan")
    return mean, hi.item(), lo.item()

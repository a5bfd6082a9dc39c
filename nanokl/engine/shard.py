"""The models across ranks: DDP replicas or FSDP2 shards, CPU offload, the rollout copy, checkpoints.

The process group is nanokl/engine/dist.py's; this module decides what each rank holds of each model
(`wrap`), and moves whole weights in and out of it. Without a process group every helper here is
the identity. The strategies:

- `none`: one process holds the whole model (world size 1).
- `ddp` (DistributedDataParallel): every rank holds a full replica; backward all-reduces (averages)
  the gradients, so the replicas stay identical. Memory per GPU: weights + grads + Adam's two
  moments = 16 bytes/parameter in fp32.
- `fsdp2` (`torch.distributed.fsdp.fully_shard`, Zhao et al. 2023): each decoder layer and the root
  are sharded across the ranks; a layer's full weights are all-gathered just before its forward or
  backward and freed after, gradients are reduce-scattered. Memory per GPU: 16/W bytes/parameter
  plus one layer's gathered weights. A `MixedPrecisionPolicy` gathers and computes in `param_dtype`
  (bf16 on CUDA, fp32 on CPU unless asked) and reduces gradients in fp32; the fp32 master weights
  and Adam's moments stay sharded. The reference model is sharded too. At world size 1 the
  micro-batches of a mini-batch accumulate their gradients unsharded, in fp32, and only the last
  one reduces the sum (`no_sync`): one reduction per unit (each layer, the root) per optimizer step
  instead of one per micro-batch (with more ranks each micro-batch reduce-scatters: accumulating
  would hold a full fp32 gradient, 4 bytes/parameter instead of 4/W, on every rank). At world
  size 1 (without offload) no unit reshards after
  forward (`wrap`): a 1-rank shard is the whole tensor, so resharding would free only the gathered
  compute-dtype copy (bf16: 2 bytes/parameter, which the frozen reference then keeps between its
  forwards) and each forward and backward would copy and cast it again; every backward still
  reshards, so the optimizer always steps the registered fp32 masters and the next forward
  gathers their new values.

CPU offload (verl's `fsdp_config.param_offload` / `optimizer_offload`; fsdp2 only, since it moves
shards: with `none` / `ddp` the keys are a one-line note and do nothing). A GPU holds, per
parameter, 4/W bytes of fp32 master shard, 4/W of gradient shard and 8/W of Adam moments; the
rest of its memory goes to activations, the gathered layer in flight, the rollout copy and its KV
cache. Offloading trades that memory for PCIe traffic and CPU time:

- `param_offload` -> FSDP2's `CPUOffloadPolicy` on every `fully_shard`: the sharded masters, their
  gradients and therefore the optimizer state live in (pinned) host memory, so all 16/W bytes
  leave the GPU. Each all-gather first copies the layer's shard to the GPU (4/W bytes/param per
  gather: forward, backward, every no-grad forward), each reduce-scatter copies the gradient shard
  back, and `optimizer.step()` runs on the CPU over 1/W of the parameters: the slow part (seconds
  per step for billions of parameters). Because the step runs where the parameters are, the
  optimizer state is on CPU whether or not `optimizer_offload` is set (a note says so).
  Collectives on CPU shards (the gradient norm's all-reduce) need gloo beside NCCL, so an
  offloaded model's mesh gets a `cpu:gloo,cuda:nccl` group. This is verl's
  `fsdp_config.offload_policy`; verl's own `param_offload` instead moves the shards to the GPU for
  each phase and back after it (the step then runs on the GPU): less PCIe per forward, but the
  shards do occupy the GPU during every phase.
- `optimizer_offload` alone -> verl's meaning: Adam's moments (8/W bytes/param) wait in host memory
  between optimizer steps; a step copies them to the GPU, steps there and copies them back
  (`offload_optimizer`: step pre/post hooks). 16/W bytes/param cross PCIe per step; the peak
  (rollout, forward, backward) no longer holds them. verl moves them once per update phase;
  nanokl per step, which needs nothing from the update loop.
- `ref.fsdp_config.param_offload`: the frozen reference's fp32 shards (4/W bytes/param) in host
  memory, copied in for each of its forwards (verl offloads an FSDP2 reference whatever the key says).

The rollout copy (below) stays on the GPU either way: decoding reads all of it for every token.

Rollout needs the policy's whole weights on every rank, and a CUDA graph needs them at fixed
addresses. nanokl's minimal version of verl's hybrid engine keeps one *rollout copy* of the policy
per rank (bf16 on CUDA, fp32 on CPU) wherever the actor is sharded (`sharded`) or on CUDA; after
each update `sync_rollout_weights` all-gathers the actor's fp32 shards one tensor at a time
(`DTensor.full_tensor()`) and copies them in place, so the copy's storage never moves and its
captured graphs stay valid. FSDP2 leaves the root's (at world size 1 every unit's) *unsharded*
parameters registered after a no-grad forward (it expects a backward next), in the policy's
bf16; the sync re-shards first, so it always reads the fp32 masters. Memory cost: 2
bytes/parameter for the bf16 copy (its KV cache on top), plus one full fp32 tensor in flight
during the sync. With `none` on CPU the actor itself
is the rollout model (no copy); with `ddp` on CPU rollout reads the replica's module directly.

Checkpoints hold full (gathered) HF-format weights (`full_state_dict`, on rank 0) and an optimizer
state keyed by parameter name (`optimizer_state`), loadable by any world size. On resume only
rank 0 reads them: `load_optimizer_state` and `load_full_state_dict` broadcast each tensor from
rank 0, and each rank keeps its shard.

How the tests check it (tests/test_dist.py, gloo processes on CPU): one PPO update with DDP and
with FSDP2 over 2 processes gives the parameters of one process on the whole batch (<= 1e-5 fp32),
with either offload too (the shards and optimizer state then on CPU, the policy on every FSDP2
module, the step hooks on the optimizer); FSDP2 under torchrun at world size 1 holds DTensors and
gives them too; FSDP2 with a bf16 policy matches one process that computes in bf16 from fp32
masters; the rollout copy equals the weights after an update and after a no-grad forward; a
checkpoint restored over 2 processes continues exactly like the uninterrupted run, and rank 1
never opens optim.pt or the weights. Counted inside the FSDP2 processes: at world size 1 one
reduction per unit per optimizer step whatever the number of micro-batches (with 2 ranks, one per
micro-batch), and at world size 1 one gather
(there a copy and a cast) per unit for a no-grad pass over several micro-batches.
"""

import contextlib
import sys
import weakref

import torch

from nanokl.engine import dist

# torch.distributed.checkpoint, .device_mesh and .fsdp are imported where used: ~2 s that a plain run never needs


def sharded(strategy):
    """Whether `wrap(model, strategy, ...)` shards the model (its parameters become DTensors)."""
    return strategy == "fsdp2" and dist.active()


def offload_setting(key, strategy, device, fsdp_config, trainable=True):
    """What `{key}.fsdp_config.param_offload` / `.optimizer_offload` (verl's keys; a frozen model
    has no optimizer state) do for one model, as (offload the shards with FSDP2's CPUOffloadPolicy,
    offload only the optimizer state between steps); see the module docstring. Prints a one-line
    note on rank 0 where they do less, or more, than they say (one line per model at most)."""
    param_offload, optimizer_offload = fsdp_config.param_offload, trainable and fsdp_config.optimizer_offload
    if not (param_offload or optimizer_offload):
        return False, False
    key = f"{key}.fsdp_config"
    keys = " / ".join(f"{key}.{k}" for k, on in (("param_offload", param_offload),
                                                  ("optimizer_offload", optimizer_offload)) if on)
    if not sharded(strategy):
        why = f"strategy={strategy}" if strategy != "fsdp2" else "fsdp2 without torchrun (unsharded)"
        _note(f"{keys}: nothing to offload with {why}; CPU offload moves FSDP2 shards")
        return False, False
    said = ["the optimizer state lives on CPU too (FSDP2 steps the optimizer where the shards are)"] \
        if param_offload and trainable and not optimizer_offload else []
    if device.type == "cpu":
        said.append("on CPU everything already lives in host memory: nothing moves")
    if said:
        _note(f"{keys}: {'; '.join(said)}")
    return bool(param_offload), bool(optimizer_offload and not param_offload)


def _note(message):
    if dist.rank() == 0:
        print(f"note: {message}", file=sys.stderr)


def wrap(model, strategy, device, trainable=True, param_dtype=None, offload=False):
    """The model as its strategy runs it: itself, a DDP replica, or FSDP2-sharded.

    Under torchrun the strategy applies at every world size (see the module docstring); without
    a process group the model is returned as is. `param_dtype` is FSDP2's compute dtype (default:
    bf16 on CUDA, fp32 on CPU); gradients are reduced in fp32 and the sharded masters stay fp32.
    `offload` (fsdp2 only): the shards, their gradients and the optimizer step on CPU
    (`CPUOffloadPolicy`, pinned memory on CUDA; see the module docstring).

    Build the optimizer right after wrapping, before any forward: between a forward and the next
    backward FSDP2 registers the root's (at world size 1, without offload, every unit's)
    *unsharded* parameters on the module, and an optimizer built then would update copies that the
    next reshard throws away."""
    if strategy == "none" or not dist.active():
        return model
    if strategy == "ddp":
        if not trainable:
            return model  # a frozen replica needs no gradient synchronisation
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    # offloaded shards are CPU tensors on a CUDA mesh: their collectives (the gradient norm) need gloo
    cpu_collectives = {0: "cpu:gloo,cuda:nccl"} if offload and device.type == "cuda" else None
    mesh = init_device_mesh(device.type, (dist.world(),), backend_override=cpu_collectives)
    param_dtype = param_dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    # fp32 compute needs no policy (no casts): the same numbers as before the option existed
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) \
        if param_dtype != torch.float32 else MixedPrecisionPolicy()
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    # At world size 1 a unit's "shard" is the whole tensor: resharding after forward frees only the
    # gathered compute-dtype copy, which the backward and every later forward would copy and cast
    # again. So every unit stays gathered from a forward on (False). The invariant that keeps this
    # safe: every backward reshards every unit (FSDP2's reshard_after_backward, left True), so the
    # optimizer only ever steps while the fp32 masters are registered and the next forward gathers
    # the new values; a gathered copy left by a forward that no backward followed (a no-grad pass)
    # is never stepped, and whatever reads or writes weights then reshards first (reshard():
    # full_tensors / the rollout sync, the state-dict and optimizer-state helpers, no_sync on entry
    # to each micro-batch). Offloaded shards keep resharding: their gathered copy is the GPU memory
    # the offload saves. More ranks: FSDP2's default (None: layers reshard, the root does not).
    after = False if dist.world() == 1 and not offload else None
    for layer in unwrap(model).model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=policy, reshard_after_forward=after)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy, reshard_after_forward=after)
    return model


def unwrap(model):
    """The module underneath a DDP wrapper (FSDP2 shards in place: the module is itself)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def no_sync(model, skip):
    """Around one micro-batch's forward and backward: accumulate its gradients locally (`skip`, every
    micro-batch but the last of a mini-batch) and reduce them over the ranks once, in the last one.

    DDP: `model.no_sync()` skips the all-reduce. FSDP2: `set_requires_gradient_sync(not skip)` on
    every unit (recursive), set on entry and back to True on exit, so a backward outside this context
    always reduces. A skipped backward keeps each unit's unsharded gradient (in the reduce dtype,
    fp32: a bf16 gradient is upcast after the first micro-batch and later ones are added to it), and
    the last one reduce-scatters the sum: one reduce-scatter per unit per optimizer step, not per
    micro-batch. On entry the FSDP2 units are resharded, so the forward gathers the current masters
    even if a no-grad forward left older gathered copies registered.

    FSDP2 skips only at world size 1, where a rank's shard is the whole gradient anyway: the
    reductions it saves are copies, and it costs no memory. With W ranks an accumulated unsharded
    gradient is 4 bytes/parameter on every rank instead of 4/W (a 7B model on 8 GPUs: 28 GB instead
    of 3.5, past what bench/memory.py leaves on an 80 GB GPU), so there each micro-batch's backward
    reduce-scatters as it goes (verl's choice too), overlapped with the backward of the next layers."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync() if skip else contextlib.nullcontext()
    if dist.active() and dist.world() == 1:  # see below: with more ranks FSDP2 reduce-scatters every micro-batch
        from torch.distributed.fsdp import FSDPModule
        if isinstance(model, FSDPModule):
            return _fsdp_gradient_sync(model, not skip)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_gradient_sync(model, sync):
    reshard(model)  # a no-op after a backward (FSDP2 reshards then); after a no-grad forward, fresh gathers
    model.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def reshard(model):
    """Put FSDP2's sharded fp32 parameters back on the module. After a no-grad forward the root
    (at world size 1 every unit) keeps its gathered parameters (in the policy's compute dtype)
    registered instead."""
    if not dist.active():
        return
    from torch.distributed.fsdp import FSDPModule
    for m in unwrap(model).modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def full_tensors(model):
    """(name, full tensor) of every parameter, all-gathering FSDP2 shards one at a time."""
    reshard(model)
    for name, p in unwrap(model).named_parameters():
        if hasattr(p, "full_tensor"):
            if p.device.type != p.device_mesh.device_type:  # an offloaded shard: gather it on the GPU
                p = p.detach().to(p.device_mesh.device_type)
            p = p.full_tensor()
        yield name, p


@torch.no_grad()
def sync_rollout_weights(rollout_model, actor):
    """Copy the actor's current weights into the rollout copy, in place (its graphs stay valid).
    Nothing to do where the rollout runs the actor itself (a plain CPU actor, a DDP replica)."""
    if rollout_model is unwrap(actor):
        return
    if any(name.endswith(".lora_A") for name, _ in unwrap(actor).named_parameters()):
        return _sync_merged(rollout_model, unwrap(actor))
    for (name, full), (rname, p) in zip(full_tensors(actor), rollout_model.named_parameters()):
        assert name == rname, (name, rname)
        p.copy_(full)


def _sync_merged(rollout_model, actor):
    """An actor with LoRA adapters (nanokl/lora.py; never sharded): each adapted weight goes to the copy
    merged, W + (alpha/r)·B A in fp32, the copy's names being the plain model's."""
    mine = dict(rollout_model.named_parameters())
    for name, p in actor.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if leaf in ("lora_A", "lora_B"):
            continue
        if owner.endswith("base_layer"):
            owner = owner[:-len("base_layer")].rstrip(".")
            if leaf == "weight":
                p = p.float() + actor.get_submodule(owner).delta_weight().float()
            name = f"{owner}.{leaf}"
        mine[name].copy_(p)


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, **kw)


def full_state_dict(model):
    """Full (gathered) weights on rank 0, for an HF-format checkpoint; {} on the other ranks."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    reshard(model)  # (FSDP2's state-dict hooks reshard too; said here like every reader of the weights)
    sd = get_model_state_dict(unwrap(model), options=_options(cpu_offload=True))
    return sd if dist.rank() == 0 else {}


def load_full_state_dict(model, sd):
    """Load full (unsharded) weights into a plain, DDP or FSDP2 model; each rank keeps its shard.
    Under torchrun only rank 0's `sd` is read (the others pass {}): it is broadcast tensor by tensor."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    reshard(model)  # write the masters, never the gathered copies a no-grad forward left
    set_model_state_dict(unwrap(model), sd, options=_options(broadcast_from_rank0=dist.active()))


def optimizer_state(model, opt):
    """The optimizer's full state keyed by parameter name (rank 0): loadable by any world size."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    reshard(model)  # names map to the optimizer's (sharded) parameters only when they are registered
    return get_optimizer_state_dict(unwrap(model), opt, options=_options(cpu_offload=True))


def load_optimizer_state(model, opt, state):
    """Load a full, name-keyed optimizer state; under torchrun only rank 0's `state` is read (the
    others pass {}) and each tensor is broadcast from it, so no other rank opens the file."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    reshard(model)
    set_optimizer_state_dict(unwrap(model), opt, state, options=_options(broadcast_from_rank0=dist.active()))
    if opt in _STATE_ON_CPU:
        _move_state(opt, home=False)  # load_state_dict put it beside the parameters


_STATE_ON_CPU = weakref.WeakSet()  # optimizers whose state waits in host memory between steps


def offload_optimizer(opt):
    """verl's `optimizer_offload` without `param_offload`: `opt`'s state (Adam's moments) lives in
    host memory between steps; each step copies it to the parameters' device first and back to
    the CPU after (step pre/post hooks, so the update loop needs no change). Returns `opt`."""
    _STATE_ON_CPU.add(opt)
    opt.register_step_pre_hook(lambda o, args, kwargs: _move_state(o, home=True))
    opt.register_step_post_hook(lambda o, args, kwargs: _move_state(o, home=False))
    return opt


@torch.no_grad()
def _move_state(opt, home):
    """Every state tensor of `opt` to its parameter's device (home) or to the CPU. 0-dim ones
    (Adam's step count) stay where torch keeps them."""
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            for k, v in state.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    state[k] = v.to(p.device if home else torch.device("cpu"))


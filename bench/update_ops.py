"""Ops, host syncs and the largest tensor of ONE PPO step's training side, counted on the meta device.

    python bench/update_ops.py                          # Qwen2.5-0.5B shape: 1, 2, 3 layers built, 24 extrapolated
    python bench/update_ops.py --layers 24              # build 1 and 24 layers instead (meta: no memory; ~30 s)
    python bench/update_ops.py --settings config        # one setting (first, config or both)
    python bench/update_ops.py --shape tiny             # the same op counts: they do not depend on the widths

The work of one step of the GSM8K GPU run (bench/ppo_gpu.py): 128 prompts x 1 response, the
Qwen2.5-0.5B shape, prompts left-padded to 256 tokens (real lengths 60 + 37 i mod 141: 60..200,
deterministic), responses of 256 real tokens (a random policy never stops), mini-batches of 64
responses (2 optimizer steps per update), 1 epoch, GAE with a critic. Its five training passes
(nanokl/forwards.py, then nanokl/workers.py), in the trainer's order:

    old_log_prob   compute_log_probs(actor, with_entropy=True)    spec "old"
    ref            compute_log_probs(ref)                         spec "ref"
    values         compute_values(critic)                         spec "values"
    update_critic  update_critic                                  spec "critic"
    update_actor   update_actor (no KL loss, no entropy bonus)    spec "actor"

under two settings: `first`, the first GPU run's (every pass packed; old: 8 responses a micro-batch,
the others 4; no chunk; activation checkpointing on the actor, off on the critic: the checkout of
that run never applied critic.model.enable_gradient_checkpointing), and `config`, the specs of
configs/gsm8k_qwen2.5_0.5b.yaml (`nanokl.harness.run.batching_specs`: token budgets, the LM head
chunked) with checkpointing as its enable_gradient_checkpointing keys say.

How. The models (`nanokl.engine.model.CausalLM` x2, `ValueModel`), their AdamW states and the batch live on
the meta device: shapes and dtypes without data, so the full 0.5B shape costs nothing. A
TorchDispatchMode sees every aten op below autograd (backward, checkpoint recomputation and optimizer
included) and counts, per phase:

  ops       ops that touch a meta tensor, as bench/decode_ops.py's OpCounter counts: views (every
            return aliases an input and nothing is written, read from the op's schema since meta
            tensors have no storage to compare; `_unsafe_view` too, which aliases on a real device),
            allocations (empty*, SDPA's backend choice) and the profiler's marks are left out. A host
            copy to the device counts (a copy kernel). Ops on host tensors only (a micro-batch's
            packing metadata built on the CPU) are counted apart, as `host ops`.
  syncs     what makes the host wait for the device: a copy from meta to cpu (`.cpu()`, `.tolist()`,
            `.to("cpu")`), `_local_scalar_dense` (item, bool, int, float), the data-dependent ops whose
            output shape needs the values (nonzero, masked_select, index / index_put with a bool index,
            repeat_interleave without output_size, unique*), and a blocking copy from the host to the
            device: a `.to(device)` of a host tensor (h2d: on CUDA a pageable copy without non_blocking
            synchronizes the stream) or a torch.tensor / torch.as_tensor of host data made on the device
            (tensor:h2d; no dispatch shows it, so those two functions are wrapped while a phase runs).
            batching.send's copy is not one: on CUDA it goes from pinned memory, non-blocking (on meta it
            takes the plain `.to`, recognised by being inside send).
            A sync is *inside* a micro-batch loop when it runs between the first micro-batch built after
            a `split` (micro_batch; take in an older checkout) and the loop's end: the
            pass's return, or `workers._step`, which clears the flag (its one read per mini-batch is
            outside by definition, and so is the next mini-batch's set-up until its first micro-batch).
            The wrappers are set on the module attributes where the loop looks them up: batching's
            (agreed_micro_batches), or workers' in an older checkout.
            Everything else in a pass is *outside*: the mask's read before the loop, each mini-batch's read.
  largest   the largest tensor an op outputs (numel x element size), with the op and its shape.

Answering syncs. Meta tensors have no values, so the mode answers a sync itself. The batch's
attention mask is registered with its real CPU twin, and twins propagate: every small op whose meta
inputs all have twins also runs on the twins (a host copy to the device, or torch.tensor of host
data on it, gets the host values as its twin), and an in-place op with an untwinned input drops the
twin of what it writes. A copy to the CPU returns the twin (the real mask, or what was computed from
it), else ones (placeholders: finite flag 1, grad norm 1, metrics 1); `item()` returns the twin's
value, else 1; a data-dependent op takes its output shape from the twins of the inputs that decide it
(nonzero's input, a bool index, repeat_interleave's repeats) and raises DataDependent when they have
none. So the current code, which reads the mask's host copy and each mini-batch's metrics, runs
exactly; so does an older checkout that packs with boolean masks on the device, its syncs counted.

What the meta device does not show (read the counts with these in mind):
  - precision: meta has no autocast, so everything computes in fp32, the masters' dtype. On CUDA the
    bf16 autocast adds casts (of each matmul's input and weight: a few ops per layer per micro-batch,
    in every setting alike) and halves activations; the LM head's logits are fp32 on both (the trainer
    upcasts them), so the largest tensor, a [rows, vocab] fp32 block of logits, is the same.
  - kernels: packed attention is counted as CUDA runs it (`nanokl.engine.attention.packed_kernel` answers
    "varlen": this torch's varlen_attn, one op forward and one backward; the CPU runs one SDPA per
    document); clip_grad_norm_ and AdamW take their for-each / fused paths as on CUDA (the meta device
    is let through torch's device checks); AdamW is fused, as nanokl.harness.optim.make_optimizer builds
    it on CUDA (`adamw_kind="foreach"`: CUDA's default before that). The AdamW state exists before the
    step (one uncounted step on zero gradients): the step counted is a steady-state one.
  - FSDP2 and collectives: at world size 1 dist.all_reduce is a clone; no shard, no gather.
  - meta kernels are slow Python, so the mode reuses an op's output metadata for inputs of the same
    shapes, strides and dtypes (SHAPE_CACHE): the same ops are counted, just not re-run.

Layers: the op count is linear in the layer count (each layer adds the same ops to every forward,
backward and recomputation), so by default 1, 2 and 3 layers are built, the linearity is checked,
and the count of the shape's 24 layers is extrapolated; syncs, micro-batches and the largest tensor
are checked not to depend on the layers. `--layers N` builds 1 and N layers and reports N.

Output: a markdown table of both settings side by side (ops and their ratio, micro-batches, syncs
inside the loops and outside them, largest tensor), then the ops of each micro-batch (its fixed part
and its part per layer), outside the loops and per layer, the host ops and the syncs by kind.
tests/test_update_ops.py holds the syncs inside loops at 0, the largest tensor of every pass under
`config` within chunk x vocab x 4 bytes, and `config` at least 4x fewer ops per step than `first`.
"""

import inspect
import argparse
import contextlib
import copy
import dataclasses
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from nanokl.engine import attention as A  # noqa: E402
from nanokl.engine import batching  # noqa: E402
from nanokl.engine import model as M  # noqa: E402
from nanokl import workers  # noqa: E402
try:
    from nanokl import forwards  # noqa: E402
except ImportError:  # an older checkout: the no-grad passes were in workers
    forwards = workers

SHAPES = {  # as bench/decode_ops.py
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),  # Qwen2.5-0.5B
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=24,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}
CONFIG = ROOT / "configs" / "gsm8k_qwen2.5_0.5b.yaml"
N, P, R, MINI = 128, 256, 256, 64  # responses, prompt and response length, responses per mini-batch
PHASES = ("old_log_prob", "ref", "values", "update_critic", "update_actor")
SPEC = {"old_log_prob": "old", "ref": "ref", "values": "values", "update_critic": "critic", "update_actor": "actor"}
FIRST = {  # the first GPU run: its checkout's config (every pass packed, micro-batches of responses)
    "old": dict(micro_size=8, packed=True), "ref": dict(micro_size=4, packed=True),
    "actor": dict(micro_size=4, packed=True), "critic": dict(micro_size=4, packed=True),
    "values": dict(micro_size=4, packed=True),
    "checkpointing": dict(actor=True, critic=False),  # that checkout never applied the critic's key
}
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_fused_sdp_choice",
             "_record_function_enter", "_record_function_enter_new", "_record_function_exit"}  # + the profiler's marks
VIEW_LIKE = {"_unsafe_view"}  # aliases its input on a real device (matmul's reshapes); decode_ops skips it
DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive"}
SYNC_CANDIDATES = DATA_DEPENDENT | {"_to_copy", "copy_", "_copy_from", "_copy_from_and_resize", "_local_scalar_dense",
                                    "index", "index_put", "index_put_", "_index_put_impl_", "repeat_interleave"}
SHAPE_CACHE = {}  # StepCounter's: the outputs' metadata of an op on inputs of given metadata (shared by all runs)
TWIN_LIMIT = 1 << 22  # elements: twins are kept for small (metadata-sized) tensors only


def prompt_lengths(n=N):
    """Real prompt tokens of each row: 60..200, deterministic (37 and 141 are coprime: all distinct)."""
    return [60 + (37 * i) % 141 for i in range(n)]


def settings(name, config=CONFIG):
    """{spec name: Batching fields, "checkpointing": {"actor": bool, "critic": bool}} of a setting."""
    if name == "first":
        return copy.deepcopy(FIRST)
    from nanokl.harness.config.load import load_config
    from nanokl.harness.run import batching_specs
    cfg = load_config(str(config), [])
    out = {k: dataclasses.asdict(v) for k, v in batching_specs(cfg).items()}
    out["checkpointing"] = dict(actor=cfg.actor_rollout_ref.model.enable_gradient_checkpointing,
                                critic=cfg.critic.model.enable_gradient_checkpointing)
    return out


def make_spec(fields):
    """A Batching of the fields this checkout knows; the ones it does not (an older one: no chunk) are
    dropped, and named."""
    known = {f.name for f in dataclasses.fields(batching.Batching)}
    dropped = sorted(k for k, v in fields.items() if k not in known and v is not None)
    return batching.Batching(**{k: v for k, v in fields.items() if k in known}), dropped


# ---------------------------------------------------------------------------------------------
# The counting mode


class OpInfo:
    """What the mode needs to know of an op, from its schema (cached per overload)."""

    def __init__(self, func):
        s = func._schema
        self.name = func.overloadpacket.__name__
        self.mutable = s.is_mutable
        self.view = self.name in VIEW_LIKE or (not s.is_mutable and bool(s.returns) and all(
            r.alias_info is not None and not r.alias_info.is_write for r in s.returns))
        self.written = [i for i, a in enumerate(s.arguments) if a.alias_info is not None and a.alias_info.is_write]
        self.random = "rand" in s.name or "normal" in s.name or "bernoulli" in s.name
        # a fresh tensor (or tuple of them) out, nothing written: its meta output is a function of the inputs' metadata
        self.cacheable = not self.mutable and not self.view and bool(s.returns) and \
            all(str(r.type) == "Tensor" and r.alias_info is None for r in s.returns)
        self.may_sync = self.name in SYNC_CANDIDATES


def _tensors(x, out=None):
    """The tensors in an op's arguments or outputs (nested lists, tuples, dicts)."""
    out = [] if out is None else out
    if isinstance(x, torch.Tensor):
        out.append(x)
        return out
    for v in (x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else ()):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple, dict)) and v:  # not a call per int of a size list
            _tensors(v, out)
    return out


class Twins:
    """meta tensor -> its real CPU values, kept on the meta tensor itself (it dies with it)."""
    attr = "_update_ops_twin"

    def __contains__(self, t):
        return getattr(t, self.attr, None) is not None

    def __getitem__(self, t):
        return getattr(t, self.attr)

    def __setitem__(self, t, cpu):
        setattr(t, self.attr, cpu)

    def pop(self, t, default=None):
        cpu = getattr(t, self.attr, default)
        if cpu is not None:
            setattr(t, self.attr, None)
        return cpu


def _is_meta(t):
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


def _freeze(x):
    """A hashable key of an op's argument: tensors by shape, strides and dtype (meta: no values)."""
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.stride(), x.dtype, x.device.type)
    if isinstance(x, (list, tuple)):
        if all(type(v) is int for v in x):
            return tuple(x)
        return tuple(_freeze(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _freeze(v)) for k, v in sorted(x.items()))
    return x


class DataDependent(RuntimeError):
    """A data-dependent op on a meta tensor whose values nobody knows."""


class StepCounter(TorchDispatchMode):
    """Ops, syncs and the largest tensor of each phase; see the module docstring."""

    def __init__(self):
        super().__init__()
        self.twins = Twins()  # meta tensor -> its real CPU values
        self.phase = None
        self.inside = False  # between a loop's first micro-batch and its end
        self.armed = False  # a split just ran: the next micro-batch built starts (or continues) a loop
        self.micro = None  # index of the current micro-batch within the phase (None: outside)
        self.in_send = False  # inside batching.send
        self.stats = {}
        self.infos = {}
        self.shapes = SHAPE_CACHE  # (op, inputs' metadata) -> outputs' metadata: the meta kernels are slow Python

    def register(self, meta, cpu):
        self.twins[meta] = cpu
        return meta

    def start(self, phase):
        self.phase, self.inside, self.armed, self.micro = phase, False, False, None
        self.stats[phase] = dict(ops=0, host_ops=0, ops_inside=0, ops_outside=0, micro_ops=Counter(), micro=0,
                                 sync_inside=Counter(), sync_outside=Counter(), largest=(0, "", (), None))

    def stop(self):
        self.phase, self.inside, self.armed, self.micro = None, False, False, None

    # the loop markers (patched into workers by `markers`)
    def built_micro_batch(self):
        if self.phase is not None and self.armed:
            self.inside = True
            self.micro = self.stats[self.phase]["micro"]
            self.stats[self.phase]["micro"] += 1

    def split_ran(self):
        self.armed = True

    def sending(self, on):
        self.in_send = on

    def host_data_to_device(self, meta, cpu):
        """torch.tensor / as_tensor of host data on the device: a blocking copy on CUDA (the host waits)."""
        if cpu.numel() <= TWIN_LIMIT:
            self.twins[meta] = cpu
        if self.phase is not None:
            self.stats[self.phase]["sync_inside" if self.inside else "sync_outside"]["tensor:h2d"] += 1

    def loop_ended(self):
        self.inside, self.armed, self.micro = False, False, None

    # dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        info = self.infos.get(func)
        if info is None:
            info = self.infos[func] = OpInfo(func)
        ins = _tensors((args, kwargs))
        meta_in = [t for t in ins if t.device.type == "meta"]
        sync = self._sync_kind(func, info.name, args, kwargs, meta_in) \
            if info.may_sync and (meta_in or info.name == "_to_copy") else None
        if sync is not None:
            out = self._answer(sync, func, info.name, args, kwargs, meta_in)
        else:
            out = self._run(func, info, args, kwargs, ins, meta_in)
            self._propagate(func, info, args, kwargs, meta_in, out)
        self._record(info, ins, out, sync)
        return out

    def _run(self, func, info, args, kwargs, ins, meta_in):
        if not (info.cacheable and meta_in and len(meta_in) == len(ins)):
            return func(*args, **kwargs)
        try:
            key = (func, _freeze(args), _freeze(kwargs))
            hash(key)
        except TypeError:
            return func(*args, **kwargs)
        meta = self.shapes.get(key)
        if meta is None:
            out = func(*args, **kwargs)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            if all(_is_meta(t) for t in outs):
                self.shapes[key] = (type(out), [(tuple(t.shape), t.stride(), t.dtype) for t in outs])
            return out
        kind, metas = meta
        outs = [torch.empty_strided(s, st, dtype=d, device="meta") for s, st, d in metas]
        return outs[0] if kind is torch.Tensor else kind(outs)

    def _record(self, info, ins, out, sync):
        if self.phase is None:
            return
        st = self.stats[self.phase]
        if sync is not None:
            st["sync_inside" if self.inside else "sync_outside"][f"{info.name}:{sync}"] += 1
        if info.name in NO_KERNEL or (info.view and sync in (None, "h2d")):
            return
        outs = _tensors(out)
        if not any(t.device.type == "meta" for t in ins) and not any(t.device.type == "meta" for t in outs):
            st["host_ops"] += 1
            return
        st["ops"] += 1
        st["ops_inside" if self.inside else "ops_outside"] += 1
        if self.micro is not None:
            st["micro_ops"][self.micro] += 1
        for t in outs:
            if t.device.type == "meta":
                size = t.numel() * t.element_size()
                if size > st["largest"][0]:
                    st["largest"] = (size, info.name, tuple(t.shape), t.dtype)

    def _sync_kind(self, func, name, args, kwargs, meta_in):
        """Why this op makes the host wait (None: it does not)."""
        if name in ("_to_copy", "copy_", "_copy_from", "_copy_from_and_resize"):
            dst = kwargs.get("device") if name == "_to_copy" else args[0 if name == "copy_" else 1].device
            src = args[0] if name == "_to_copy" else args[1 if name == "copy_" else 0]
            dst = torch.device(dst) if dst is not None else src.device
            if _is_meta(src) and dst.type == "cpu":
                return "to_host"
            non_blocking = kwargs.get("non_blocking", args[2] if name == "copy_" and len(args) > 2 else False)
            if src.device.type == "cpu" and dst.type == "meta" and not non_blocking and not self.in_send:
                return "h2d"  # a host copy to the device that is not batching.send's: blocking on CUDA
            return None
        if name == "_local_scalar_dense":
            return "item"
        if name in DATA_DEPENDENT:
            return "shape"
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            idx = args[1] if len(args) > 1 else kwargs.get("indices")
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in idx or ()):
                return "bool_index"
        if name == "repeat_interleave" and kwargs.get("output_size") is None and \
                func._overloadname in ("Tensor", "self_Tensor"):
            return "shape"
        return None

    def _twin_of(self, t, what):
        if not _is_meta(t):
            return t
        if t in self.twins:
            return self.twins[t]
        raise DataDependent(f"{what} on a meta tensor {tuple(t.shape)} {t.dtype} without known values")

    def _placeholder(self, t):
        """The values of a meta tensor read by the host: its twin, else ones."""
        if t in self.twins:
            return self.twins[t].clone()
        return torch.ones(t.shape, dtype=t.dtype)

    def _answer(self, sync, func, name, args, kwargs, meta_in):
        if sync == "h2d":
            out = func(*args, **kwargs)
            self._propagate(func, self.infos[func], args, kwargs, meta_in, out)
            return out
        if sync == "to_host":
            if name == "_to_copy":
                return func(self._placeholder(args[0]), *args[1:], **kwargs)
            dst, src = (args[0], args[1]) if name == "copy_" else (args[1], args[0])
            return dst.copy_(self._placeholder(src))
        if sync == "item":
            t = args[0]
            return self.twins[t].item() if t in self.twins else (True if t.dtype == torch.bool else 1)
        # data-dependent shapes: computed on the twins, with zeros standing in for values that do not decide them
        if sync == "bool_index":
            decide = [i for i in (args[1] or ())
                      if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
        elif name == "repeat_interleave":
            decide = [args[1] if func._overloadname == "self_Tensor" else args[0]]
        elif name == "masked_select":
            decide = [args[1]]
        else:
            decide = [args[0]]
        decide_ids = {id(t) for t in decide}
        if name in ("index_put", "index_put_", "_index_put_impl_"):
            # the bool index as long indices on the device (their twins known), then the ordinary op
            idx = []
            for i in args[1]:
                if id(i) in decide_ids:
                    idx.extend(self._to_meta(j) for j in self._twin_of(i, name).nonzero().unbind(1))
                else:
                    idx.append(i)
            new = (args[0], idx, *args[2:])
            out = func(*new, **kwargs)
            self._propagate(func, self.infos[func], new, kwargs, [t for t in _tensors(new) if _is_meta(t)], out)
            return out

        def host(t):
            if not _is_meta(t):
                return t
            if id(t) in decide_ids:
                return self._twin_of(t, name)
            return self.twins[t] if t in self.twins else torch.zeros((), dtype=t.dtype).expand(t.shape)
        exact = all(t in self.twins for t in meta_in)
        res = func(*tree_map(host, args), **tree_map(host, kwargs))
        if exact and isinstance(res, torch.Tensor):
            return self._to_meta(res)
        return tree_map(lambda r: torch.empty(r.shape, dtype=r.dtype, device="meta")
                        if isinstance(r, torch.Tensor) else r, res)

    def _to_meta(self, cpu):
        return self.register(torch.empty(cpu.shape, dtype=cpu.dtype, device="meta"), cpu)

    def _propagate(self, func, info, args, kwargs, meta_in, out):
        """Keep twins: run the op on the twins too when every meta input has one (and it is small)."""
        written = [args[i] for i in info.written if i < len(args) and _is_meta(args[i])]
        if info.name == "copy_" and _is_meta(args[0]) and args[0] not in self.twins:
            src = args[1]  # a whole tensor overwritten: its twin is the source's values (a host copy to the device)
            if not _is_meta(src) or src in self.twins:
                val = self.twins[src] if _is_meta(src) else src
                if args[0].numel() <= TWIN_LIMIT:
                    self.twins[args[0]] = val.to(args[0].dtype).broadcast_to(args[0].shape).clone()
            return
        if meta_in and not any(t in self.twins for t in meta_in):
            return  # the common case: nothing known in, so nothing known written
        if meta_in and not all(t in self.twins for t in meta_in):
            for t in written:
                self.twins.pop(t, None)
            return
        outs = [t for t in _tensors(out) if t.device.type == "meta"]
        if not outs and not written:
            return
        if info.name in NO_KERNEL or info.random or any(t.numel() > TWIN_LIMIT for t in outs):
            for t in written:
                self.twins.pop(t, None)
            return
        swap = lambda t: self.twins[t] if _is_meta(t) else t  # noqa: E731
        kw = {k: (torch.device("cpu") if k == "device" else v) for k, v in kwargs.items()}
        try:
            res = func(*tree_map(swap, args), **tree_map(swap, kw))
        except Exception:  # an op the CPU does not run the same way: no twin
            for t in written:
                self.twins.pop(t, None)
            return
        if info.mutable:
            return  # the twins were written in place
        for m, c in zip(_tensors(out), _tensors(res)):
            if _is_meta(m) and isinstance(c, torch.Tensor):
                self.twins[m] = c


@contextlib.contextmanager
def markers(counter):
    """What the counter cannot see by itself, reported to it while a phase runs: the loops' boundaries
    (split arms, the micro-batch builder starts a micro-batch: micro_batch, or take in an older checkout;
    _step ends the loop), batching.send's copies (pinned and non-blocking on CUDA: no sync), and
    tensors made on the device from host data by torch.tensor / torch.as_tensor (no dispatch shows
    their copy; on CUDA it is a blocking one, a sync)."""
    saved = []

    def patch(module, name, wrapped):
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, wrapped)

    def marked(fn, before=None, after=None):
        def wrapped(*args, **kwargs):
            if before is not None:
                before()
            try:
                return fn(*args, **kwargs)
            finally:
                if after is not None:
                    after()
        return wrapped

    def from_host_data(fn):
        def wrapped(data, *args, **kwargs):
            out = fn(data, *args, **kwargs)
            if isinstance(out, torch.Tensor) and out.device.type == "meta" and not isinstance(data, torch.Tensor):
                with _disable_current_modes():  # the same values on the host: the twin (not counted)
                    host = {k: v for k, v in kwargs.items() if k not in ("device", "requires_grad")}
                    cpu = fn(data, *args[:1], **host)
                counter.host_data_to_device(out, cpu)
            return out
        return wrapped

    loop = batching if hasattr(batching, "agreed_micro_batches") else workers  # where the loop looks them up
    patch(loop, "split", marked(loop.split, after=counter.split_ran))
    builder = "micro_batch" if hasattr(loop, "micro_batch") else "take"
    patch(loop, builder, marked(getattr(loop, builder), before=counter.built_micro_batch))
    patch(workers, "_step", marked(workers._step, before=counter.loop_ended))
    for module in (workers, batching):
        if hasattr(module, "send"):
            patch(module, "send", marked(module.send, before=lambda: counter.sending(True),
                                         after=lambda: counter.sending(False)))
    patch(torch, "tensor", from_host_data(torch.tensor))
    patch(torch, "as_tensor", from_host_data(torch.as_tensor))
    try:
        yield
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)


@contextlib.contextmanager
def cuda_like():
    """The meta device taken for CUDA where the code asks: packed attention by the varlen kernel, the
    for-each kernels (clip_grad_norm_'s norms and scaling, for-each AdamW) and fused AdamW allowed."""
    import torch.optim.optimizer as optimizer
    import torch.utils._foreach_utils as foreach_utils
    saved = [(A, "packed_kernel"), (optimizer, "_get_fused_kernels_supported_devices"),
             (optimizer, "_get_foreach_kernels_supported_devices"),
             (foreach_utils, "_get_foreach_kernels_supported_devices")]
    saved = [(m, name, getattr(m, name)) for m, name in saved]
    fused, foreach = saved[1][2], saved[3][2]
    A.packed_kernel = lambda q: "varlen"
    optimizer._get_fused_kernels_supported_devices = lambda: fused() + ["meta"]
    optimizer._get_foreach_kernels_supported_devices = foreach_utils._get_foreach_kernels_supported_devices = \
        lambda: foreach() + ["meta"]
    try:
        yield
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)


# ---------------------------------------------------------------------------------------------
# One step


def make_batch(counter):
    """The step's batch on the meta device; the attention mask registered with its real values."""
    mask = torch.zeros(N, P + R, dtype=torch.long)
    for i, n in enumerate(prompt_lengths()):
        mask[i, P - n:] = 1
    meta = torch.device("meta")

    def empty(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device=meta)
    return {"sequences": empty(N, P + R, dtype=torch.long),
            "attention_mask": counter.register(mask.to(meta), mask),
            "position_ids": empty(N, P + R, dtype=torch.long), "responses": empty(N, R, dtype=torch.long),
            "response_mask": empty(N, R, dtype=torch.long), "is_weights": None}


def adamw(model, lr, kind):
    """make_optimizer's CUDA optimizer: fused AdamW (kind "fused") or the for-each one ("foreach"), its
    state made by one step on zero gradients (uncounted): the step counted is a steady-state one."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=kind == "fused" or None,
                            foreach=kind == "foreach" or None)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def ratio_watch() -> dict:
    """The KL monitor's ratio-band reading the trainer passes to the policy update (train_ppo.py), where
    this checkout's update takes one (`watch`, since the ratio band left nanokl/ppo.py); older checkouts
    computed it inside the update."""
    if "watch" not in inspect.signature(workers.update_actor).parameters:
        return {}
    from nanokl.harness.hacking import watch_ratio
    return {"watch": watch_ratio}


def count_step(setting, shape="0.5b", layers=1, config=CONFIG, adamw_kind="fused"):
    """{phase: stats} of one step under `setting` (see `settings`), plus "_dropped": spec fields this
    checkout does not know. `config` gives the losses' hyper-parameters (actor, critic)."""
    from nanokl.harness.config.load import load_config
    cfg = load_config(str(config), [])
    a, c = cfg.actor_rollout_ref.actor, cfg.critic
    mcfg = M.ModelConfig(**dict(SHAPES[shape], num_hidden_layers=layers))
    with torch.device("meta"):
        actor, ref, critic = M.CausalLM(mcfg).train(), M.CausalLM(mcfg), M.ValueModel(mcfg).train()
    ref.eval().requires_grad_(False)
    actor.model.gradient_checkpointing = setting["checkpointing"]["actor"]
    critic.model.gradient_checkpointing = setting["checkpointing"]["critic"]
    specs, dropped = {}, set()
    for k in SPEC.values():
        specs[k], d = make_spec(setting[k])
        dropped.update(d)
    counter = StepCounter()
    with cuda_like():
        actor_opt, critic_opt = adamw(actor, 1e-6, adamw_kind), adamw(critic, 1e-5, adamw_kind)
        batch = make_batch(counter)
        gen = torch.Generator().manual_seed(0)

        def run(phase, fn):
            counter.start(phase)
            try:
                with counter, markers(counter):
                    return fn()
            finally:
                counter.stop()
        batch["old_log_probs"], _ = run("old_log_prob", lambda: forwards.compute_log_probs(
            actor, batch, 1.0, spec=specs["old"], with_entropy=True))
        batch["ref_log_probs"], _ = run("ref", lambda: forwards.compute_log_probs(ref, batch, 1.0, spec=specs["ref"]))
        batch["values"] = run("values", lambda: forwards.compute_values(critic, batch, spec=specs["values"]))
        batch["advantages"], batch["returns"] = torch.empty(N, R, device="meta"), torch.empty(N, R, device="meta")
        run("update_critic", lambda: workers.update_critic(critic, critic_opt, batch, c, mini_size=MINI,
                                                           spec=specs["critic"], generator=gen, horizon=R))
        run("update_actor", lambda: workers.update_actor(actor, actor_opt, batch, a, 1.0, mini_size=MINI,
                                                         spec=specs["actor"], generator=gen, horizon=R,
                                                         kl_loss_coef=0.0, ref=ref, **ratio_watch()))
    out = dict(counter.stats)
    out["_dropped"] = sorted(dropped)
    return out


LAYER_KEYS = ("ops", "host_ops", "ops_inside", "ops_outside")


def summarize(stats):
    """Per phase: the numbers the tables print (micro_ops: each micro-batch's ops, in order)."""
    out = {}
    for ph in PHASES:
        st = stats[ph]
        out[ph] = {k: st[k] for k in LAYER_KEYS}
        out[ph].update(micro=st["micro"], micro_ops=[st["micro_ops"][i] for i in range(st["micro"])],
                       sync_inside=sum(st["sync_inside"].values()), sync_outside=sum(st["sync_outside"].values()),
                       sync_kinds_inside=dict(st["sync_inside"]), sync_kinds_outside=dict(st["sync_outside"]),
                       largest=st["largest"])
    out["_dropped"] = stats["_dropped"]
    return out


def measure(setting, shape="0.5b", build=(1, 2, 3), L=None, config=CONFIG, adamw_kind="fused"):
    """Summaries at L layers (default: the shape's) from steps built with `build` layers: one count is
    reported as built; two or more give the ops a layer adds, extrapolated linearly to L (three: the
    linearity checked); syncs, micro-batches and the largest tensor checked independent of the layers.
    Each phase also gets `per_layer` (ops a layer adds to the phase) and `micro_fixed` / `micro_per_layer`
    (the first micro-batch's ops: its part without layers and its part per layer)."""
    runs = {n: summarize(count_step(setting, shape, n, config, adamw_kind)) for n in build}
    lo, hi = min(runs), max(runs)
    L = L or (SHAPES[shape]["num_hidden_layers"] if hi > lo else lo)
    res = {}
    for ph in PHASES:
        base, top = runs[lo][ph], runs[hi][ph]
        r = dict(top)
        for n, other in runs.items():
            for k in ("micro", "sync_inside", "sync_outside", "largest"):
                assert other[ph][k] == base[k], (ph, k, n, other[ph][k], base[k])
        if hi > lo:
            per = {k: (top[k] - base[k]) / (hi - lo) for k in LAYER_KEYS}
            per_micro = [(t - b) / (hi - lo) for t, b in zip(top["micro_ops"], base["micro_ops"])]
            for n, other in runs.items():
                assert all(other[ph][k] - base[k] == per[k] * (n - lo) for k in LAYER_KEYS), \
                    (ph, "op count not linear in the layer count")
            for k in LAYER_KEYS:
                r[k] = base[k] + per[k] * (L - lo)
            r["micro_ops"] = [b + p * (L - lo) for b, p in zip(base["micro_ops"], per_micro)]
        else:
            per, per_micro = {k: 0 for k in LAYER_KEYS}, [0] * base["micro"]
        r["per_layer"] = per["ops"]
        r["micro_per_layer"] = per_micro[0] if per_micro else 0
        r["micro_fixed"] = base["micro_ops"][0] - lo * r["micro_per_layer"] if base["micro_ops"] else 0
        res[ph] = r
    res["_dropped"] = runs[lo]["_dropped"]
    return res, L


def fmt_bytes(n):
    return f"{n / 2 ** 30:.2f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.0f} MiB"


def largest_cell(lg):
    size, name, shape, dtype = lg
    return f"{fmt_bytes(size)} `{name}` {list(shape)} {str(dtype).replace('torch.', '')}"


def tables(results, L, shape):
    """The markdown tables of {setting: measure(...)[0]}."""
    names = list(results)
    lines = [f"# one PPO step's training side, shape={shape}, {L} layers, {N} responses of {R} tokens "
             f"(prompts {min(prompt_lengths())}..{max(prompt_lengths())} of {P}), mini-batch {MINI}; "
             f"meta device, fp32; torch {torch.__version__}", ""]
    head = ["phase"] + [f"ops {n}" for n in names]
    if len(names) == 2:
        head.append(f"ratio {names[0]}/{names[1]}")
    head += [f"micro-batches {n}" for n in names] + [f"syncs in loops {n}" for n in names] + \
            [f"syncs outside {n}" for n in names] + [f"largest tensor {n}" for n in names]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    totals = {n: 0 for n in names}
    for ph in PHASES:
        row = [ph] + [f"{results[n][ph]['ops']:,.0f}" for n in names]
        for n in names:
            totals[n] += results[n][ph]["ops"]
        if len(names) == 2:
            row.append(f"{results[names[0]][ph]['ops'] / results[names[1]][ph]['ops']:.2f}x")
        row += [str(results[n][ph]["micro"]) for n in names]
        row += [str(results[n][ph]["sync_inside"]) for n in names]
        row += [str(results[n][ph]["sync_outside"]) for n in names]
        row += [largest_cell(results[n][ph]["largest"]) for n in names]
        lines.append("| " + " | ".join(row) + " |")
    row = ["**step**"] + [f"**{totals[n]:,.0f}**" for n in names]
    if len(names) == 2:
        row.append(f"**{totals[names[0]] / totals[names[1]]:.2f}x**")
    row += [str(sum(results[n][ph]["micro"] for ph in PHASES)) for n in names]
    row += [str(sum(results[n][ph]["sync_inside"] for ph in PHASES)) for n in names]
    row += [str(sum(results[n][ph]["sync_outside"] for ph in PHASES)) for n in names]
    row += [largest_cell(max((results[n][ph]["largest"] for ph in PHASES), key=lambda x: x[0])) for n in names]
    lines += ["| " + " | ".join(row) + " |", ""]
    for n in names:
        if results[n].get("_dropped"):
            lines += [f"{n}: this checkout's Batching has no {', '.join(results[n]['_dropped'])}: dropped", ""]
    lines += ["| setting | phase | micro-batches | ops per micro-batch (min..max) "
              "| first micro-batch: fixed + per layer "
              "| ops outside the loops | ops per layer (phase) | host ops | syncs (kind: count) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for n in names:
        for ph in PHASES:
            r = results[n][ph]
            mo = r["micro_ops"]
            kinds = {**{f"in {k}": v for k, v in r["sync_kinds_inside"].items()},
                     **{f"out {k}": v for k, v in r["sync_kinds_outside"].items()}}
            lines.append(f"| {n} | {ph} | {r['micro']} | {min(mo):,.0f}..{max(mo):,.0f} | "
                         f"{r['micro_fixed']:,.0f} + {r['micro_per_layer']:,.0f} x {L} | {r['ops_outside']:,.0f} | "
                         f"{r['per_layer']:,.0f} | {r['host_ops']:,.0f} | "
                         f"{', '.join(f'{k}: {v}' for k, v in sorted(kinds.items())) or '-'} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="build this many layers instead of extrapolating")
    ap.add_argument("--settings", default="first,config", help="comma-separated: first, config")
    ap.add_argument("--config", default=str(CONFIG), help="the config of the `config` setting and of the losses")
    args = ap.parse_args(argv)
    build = (1, 2, 3) if args.layers is None else (1, args.layers) if args.layers > 1 else (1,)
    results, L = {}, None
    for name in args.settings.split(","):
        results[name], L = measure(settings(name, args.config), args.shape, build, args.layers, args.config)
    print(tables(results, L, args.shape))
    for name in results:
        specs = settings(name, args.config)
        print(f"\n{name}: " + "; ".join(f"{k} {v}" for k, v in specs.items()))
    return results


if __name__ == "__main__":
    main()

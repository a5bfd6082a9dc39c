"""The CUDA-graph engine: capture a step over static buffers once, then replay it.

Why. A decode step is hundreds of small kernels, and eagerly the CPU launches each one, every
token: at small batch the GPU waits on the launches. If a step's tensors have fixed shapes and
storage, the whole step can be captured once into a `torch.cuda.CUDAGraph` and replayed: one launch
per token instead of hundreds. This module is that mechanism and nothing of the algorithm: it knows
the model's KV cache (nanokl/engine/model.py) and how to capture, not what a step does. nanokl/rollout.py
(its `generate`) hands it the step to capture (`decode_step` over the engine's buffers) and the
class of its step state (`DecodeState`), and drives prefill, replays and trimming itself.

The engine of a model
---------------------
A graph replays kernels on fixed *addresses*, so everything it touches must be allocated once and
kept: the engine of a model (`GraphEngine`, one per model, `engine_for(model, rows, slots)`) owns

- the buffers, sized once: a KV cache of `max_batch` rows (rounded up to a bucket) by `max_len` =
  longest prompt + response slots, and the caller's step state of the same size (`static(make)`:
  made by the caller's `make(rows, slots, device)` on first use, kept until a rebuild). A training
  run sizes it from its config before the first step (`make_engine`, called by
  nanokl/harness/run.py: rows per rank train_batch_size / W x n, or the validation chunk if
  larger). Batch buckets follow nano-vllm: 1, 2, 4, 8, then multiples of 16 up to the first one
  that holds max_batch; a batch runs in the smallest bucket that fits it (165 rows run in 176, not
  256), the extra rows computing garbage that is never read.
- the graphs: one captured step per key (`graph(key, make_step)`; rollout's key is bucket, slot
  span, sampling settings, EOS ids, pad id), captured on its first use and then replayed for the
  engine's life. `make_step()` runs only at that capture and returns the callable captured; the
  engine keeps it with its graph, and with it whatever it reads (the EOS ids' tensor). Nothing in
  a key names an object: a fresh generator every PPO step must not mean a fresh capture every step.
  The span (`span(filled)`) is how much of the cache a step attends over: the first multiple of
  `SLOT_SPAN` (256) slots that holds the filled ones, capped at max_len, so a step at slot 300 of a
  1024-slot cache reads 512 slots, not 1024. A capture's warm-up runs write into the buffers, so a
  caller captures every span it will reach before it fills them.
- its own random generator `gen`, registered with every graph (a graph replays the random kernels
  of the generators registered with it, advancing their offsets); the captured step must draw from
  it. rollout copies the caller's generator state into it before the prefill and back after the
  last step, so a seed chooses the tokens exactly as in eager decoding and the caller's generator
  advances as if it had drawn them. (Exactly, when the batch fills its bucket. A smaller batch
  draws noise for the whole bucket every step, so its tokens are a different draw from the same
  distribution as eager decoding's.)

Memory. The engine's buffers are the rollout's largest allocation after the weights: per row and
slot, every layer keeps a key and a value vector per KV head,

    KV cache bytes = layers x 2 x kv_heads x head_dim x slots x rows x bytes per element

(Qwen2.5-0.5B in bf16: 24 x 2 x 2 x 64 x 2 = 12 KiB per row-slot, so 256 rows x 1536 slots hold
4.5 GiB), plus 13 bytes per row-slot for the valid mask and rollout's decode outputs. vLLM bounds
its weights, activations and KV cache by `gpu_memory_utilization` x the device's memory. nanokl's
rollout weights are already allocated when the engine is sized, and the trainer's models share the
device, so `make_engine(..., memory_fraction=f)` checks that the buffers fit in f x total memory
minus what is in use on the device (`torch.cuda.mem_get_info`, after the caching allocator returns
its free blocks): once they exist (the cache at once, the step state at the first generation) the
device is at most f full, and the rest is for the gradients, Adam's moments (created at the first
optimizer step) and the activations. Buffers that do not fit are refused (`KVBudgetError`), not
capped: the training rollout generates all of a rank's rows in one call, so a smaller engine would
be rebuilt at full size by the first step (below). Only the sizing is checked, not a rebuild.

A call that does not fit (more rows or more slots than sized, or weights moved to new storage by
`model.to()` / a new module: their old addresses are what the graphs read) *rebuilds* the engine:
new buffers, every graph dropped and captured again on use, `rebuilds` counted. Rebuilding rather
than refusing keeps `generate` a plain library call (generate.py and the benchmarks never size an
engine; the first call sizes it, slots rounded up to 128); in training it is a sizing bug, which
`engine_stats` shows and tests/test_rollout_graphs.py keeps at zero. The PPO update must change the
parameters in place (`optimizer.step()`, `param.copy_()`) so the next replay sees the new weights
for free.

`engine_stats(model)` -> {"captures", "rebuilds", "graphs", "buckets", "max_len"}: graphs captured
and rebuilds since `make_engine` (or the first call), live graphs, and the sizing; a 4-step PPO run
should show one capture per (bucket, span, sampling setting) it used and no rebuild.

The CUDA graph API is reached through `graph_api` only (`on_graph_device` too), so the CPU tests
can swap in a stand-in that records the step's aten ops at capture and re-executes them on replay.

Tests: tests/test_rollout_graphs.py (on CPU, with the recording stand-in: captures once per bucket
over a simulated PPO run with new seeds each step; seeds honoured; replay equals eager, across
spans too; the step never syncs with the host and writes only into the engine's buffers; a CPU
train_ppo run sizes the engine once; the memory check against a patched `device_memory`, and
the bytes against a hand computation and the allocated tensors) and tests/test_rollout_cuda.py (on
a GPU: replay equals eager in fp32, and in bf16 the graph's tokens agree with a teacher-forced
forward; a weight update is seen by the replayed graph; moved weights are captured again).
"""

import weakref
from types import SimpleNamespace

import torch

from nanokl.engine.model import KVCache

# The CUDA graph API, reached only through here: tests/test_rollout_graphs.py swaps in a stand-in
# that records and replays on CPU. Graphs run on `device_type`.
graph_api = SimpleNamespace(device_type="cuda", CUDAGraph=torch.cuda.CUDAGraph, graph=torch.cuda.graph,
                            Stream=torch.cuda.Stream, stream=torch.cuda.stream,
                            current_stream=torch.cuda.current_stream, graph_pool_handle=torch.cuda.graph_pool_handle)

_ENGINES = weakref.WeakKeyDictionary()  # model -> its GraphEngine, dropped with the model
SLOT_SPAN = 256  # a decode graph attends over the first multiple of this many slots that holds the filled ones


def on_graph_device(device):
    """Whether tensors on `device` can be captured (read at call time: the tests swap `graph_api`)."""
    return device.type == graph_api.device_type


def make_engine(model, max_batch, max_len, memory_fraction=None, key="memory_fraction"):
    """Size `model`'s graph engine for calls of at most `max_batch` rows (prompts x n) and
    `max_len` slots (prompt + response), replacing any engine it had. Returns it, or None on a
    device without graphs (CPU decodes eagerly and needs none). With `memory_fraction`, first
    checks the buffers against that share of the device's memory (the module docstring's
    "Memory"), raising KVBudgetError, whose message names `key`, when they do not fit."""
    p = next(model.parameters())
    if not on_graph_device(p.device):
        return None
    memory = device_memory(p.device) if memory_fraction is not None else None
    if memory is not None:
        rows = batch_buckets(max(max_batch, 1))[-1]  # the engine allocates its top bucket
        free, total = memory
        budget, need = memory_fraction * total - (total - free), engine_bytes(model.config, rows, max_len, p.dtype)
        if need > budget:
            raise KVBudgetError(
                f"{key}={memory_fraction} leaves {_gib(max(budget, 0))} for the rollout's KV cache "
                f"({memory_fraction:.0%} of {_gib(total)} minus {_gib(total - free)} in use), but {rows} rows x "
                f"{max_len} slots need {_gib(need)}: raise it, or size the rollout for fewer rows or slots")
    _ENGINES[model] = GraphEngine(model, max_batch, max_len)
    return _ENGINES[model]


class KVBudgetError(ValueError):
    """The graph engine's buffers do not fit in the memory share they were given."""


def kv_cache_bytes(cfg, rows, slots, dtype):
    """layers x 2 (K and V) x kv_heads x head_dim x slots x rows x bytes per element."""
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * slots * rows * dtype.itemsize


def engine_bytes(cfg, rows, slots, dtype):
    """What an engine of `rows` x `slots` allocates: the KV cache, its valid mask (bool) and the
    step state rollout makes in it, whose output columns are a long token and a float log-prob per
    row-slot; a few bytes per row besides."""
    return kv_cache_bytes(cfg, rows, slots, dtype) + rows * slots * (1 + 8 + 4)


def device_memory(device):
    """(free, total) bytes of a CUDA device once the caching allocator has returned its unused
    blocks, so that "in use" counts live tensors (and other processes); None elsewhere."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)


def _gib(n):
    return f"{n / 2**30:.2f} GiB"


def engine_stats(model) -> dict:
    """Captures and rebuilds of `model`'s engine so far, its live graphs and its sizing (zeros and
    no buckets when it has none: CPU, or graphs off)."""
    eng = _ENGINES.get(model)
    if eng is None:
        return {"captures": 0, "rebuilds": 0, "graphs": 0, "buckets": [], "max_len": 0}
    return {"captures": eng.captures, "rebuilds": eng.rebuilds, "graphs": len(eng.graphs),
            "buckets": list(eng.buckets), "max_len": eng.max_len}


def batch_buckets(max_batch):
    """1, 2, 4, 8, then multiples of 16, up to the first bucket that holds max_batch rows."""
    sizes = [1, 2, 4, 8, *range(16, max_batch + 16, 16)]
    top = next(b for b in sizes if b >= max_batch)
    return [b for b in sizes if b <= top]


def engine_for(model, rows, length):
    """The engine of this model, made by this call when there is none, rebuilt when the call does
    not fit it (see the module docstring)."""
    eng = _ENGINES.get(model)
    roomy = -(-length // 128) * 128  # slots rounded up: a slightly longer prompt next time still fits
    if eng is None:
        eng = _ENGINES[model] = GraphEngine(model, rows, roomy)
    elif not eng.fits(model, rows, length):
        eng.rebuild(model, max(rows, eng.buckets[-1]), eng.max_len if length <= eng.max_len else roomy)
    return eng


def _weight_ptrs(model):
    return [t.data_ptr() for t in (*model.parameters(), *model.buffers())]


class GraphEngine:
    """The static buffers of one model's rollout and the steps captured over them."""

    def __init__(self, model, max_batch, max_len):
        self.captures = self.rebuilds = 0
        self._allocate(model, max_batch, max_len)

    def _allocate(self, model, max_batch, max_len):
        self.graphs, self.cache, self.state = {}, None, None  # free the old ones before allocating anew
        p = next(model.parameters())
        self.buckets, self.max_len = batch_buckets(max(max_batch, 1)), max_len
        self.ptrs = _weight_ptrs(model)
        self.cache = KVCache(model.config, self.buckets[-1], max_len, device=p.device, dtype=p.dtype)
        self.gen = torch.Generator(p.device)
        self.pool = graph_api.graph_pool_handle()

    def rebuild(self, model, max_batch, max_len):
        self.rebuilds += 1
        self._allocate(model, max_batch, max_len)

    def fits(self, model, rows, length):
        return rows <= self.buckets[-1] and length <= self.max_len and self.ptrs == _weight_ptrs(model)

    def bucket(self, rows):
        return next(b for b in self.buckets if b >= rows)

    def span(self, filled):
        """Cache slots a decode step attends over when `filled` slots are in use."""
        return min(-(-filled // SLOT_SPAN) * SLOT_SPAN, self.max_len)

    def static(self, make):
        """The caller's step state, `make(rows, slots, device)` at the engine's full size: made on
        first use (make_engine cannot know its class) and kept, at fixed addresses, until a rebuild."""
        if self.state is None:
            self.state = make(self.buckets[-1], self.max_len, self.cache.k.device)
        return self.state

    def graph(self, key, make_step):
        """The graph captured under `key`; on its first use, of the callable `make_step()` returns
        (a step over this engine's buffers that draws from `self.gen`). The step is kept with its
        graph: the tensors it closes over are read at their addresses on every replay."""
        if key not in self.graphs:
            self.captures += 1
            step = make_step()
            self.graphs[key] = (self._capture(step), step)
        return self.graphs[key][0]

    def _capture(self, step):
        s = graph_api.Stream()
        s.wait_stream(graph_api.current_stream())
        with graph_api.stream(s):  # warm-up (cuBLAS handles, allocator) off the capture stream
            for _ in range(2):
                step()
        graph_api.current_stream().wait_stream(s)
        graph = graph_api.CUDAGraph()
        graph.register_generator_state(self.gen)
        with graph_api.graph(graph, pool=self.pool):
            step()
        return graph

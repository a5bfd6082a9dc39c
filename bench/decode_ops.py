"""Kernels per decode step: the aten ops of ONE `nanokl.rollout.decode_step`, counted on the CPU.

    python bench/decode_ops.py                 # Qwen2.5-0.5B shape (1, 2 and 3 layers built, 24 extrapolated)
    python bench/decode_ops.py --layers 24     # build all 24 layers instead (~1.5 GB)
    python bench/decode_ops.py --shape tiny    # smoke (tests/test_decode_ops.py)

A CUDA graph replays every kernel the step launched, so at batch 1 the step's time is roughly
kernels x a few microseconds plus the bytes it reads; the count is what fusion can cut. This
counts the step the graph captures: a KVCache at full, fixed length (256 slots, writing slot 128),
batch 32, sampling at temperature 1 (the default config), random-init weights.

What is counted. A TorchDispatchMode records every aten op below autograd (CompositeImplicit ops
such as `matmul` and `scaled_dot_product_attention` appear as the ops they decompose into).
Left out, because they launch no kernel: ops whose outputs all alias an input without writing it
(views: view, t, transpose, select, slice, split, unsqueeze, expand, a `to` that is a no-op, ...),
allocations (empty, empty_like) and SDPA's backend choice. Two columns:
  cpu ops       every remaining op, as the CPU runs it;
  cuda kernels  the same, except that the ops inside one `F.rms_norm` count once: on CUDA it is
                the single `_fused_rms_norm` kernel, on the CPU a composite of pow, mean, add,
                rsqrt and two products (plus casts in bf16).
Not visible from the CPU: on CUDA the memory-efficient SDPA kernel returns its output in
[B, M, H, K] layout, so the reshape before o_proj copies (+1 per layer), and SDPA may pad a mask
whose length is not a multiple of 16 (the graph engine's cache length is). Treat the CUDA column
as +-1 per layer; the GPU check counts kernels per replay with the profiler.

Rows: the actor as CPU rollouts run it (fp32, q/k/v and gate/up separate) and the rollout copy
as CUDA rollouts run it (bf16 weights, `fused.fuse_for_rollout`). Ops are split into per layer,
the rest of the forward (embedding, RoPE tables, masks, final norm, LM head) and sampling plus
bookkeeping (`sample_tokens`, `record`); the total is for the model's layer count, from counts at
1, 2 and 3 layers (they must differ by the same per-layer count, which is checked).
"""

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanokl.engine import model as M  # noqa: E402
from nanokl.rollout import DecodeState, decode_step  # noqa: E402

try:
    from nanokl.engine.fused import fuse_for_rollout  # noqa: E402
except ImportError:  # an older checkout: in model.py, or not at all
    fuse_for_rollout = getattr(M, "fuse_for_rollout", None)

SHAPES = {
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),  # Qwen2.5-0.5B
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=24,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}
NO_KERNEL = {"empty", "empty_like", "empty_strided", "_fused_sdp_choice"}


class OpCounter(TorchDispatchMode):
    """Kernel-launching aten ops, each tagged with the phase it ran in and its rms_norm group."""

    def __init__(self):
        super().__init__()
        self.ops = []  # (name, phase, group): group is an rms_norm call's id, or None
        self.phase, self.group = "other", None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        aliases = bool(outs) and all(t.untyped_storage().data_ptr() in ins for t in outs)
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL and not (aliases and not func._schema.is_mutable):
            self.ops.append((name, self.phase, self.group))
        return out


def grouping_norms(counter):
    """F.rms_norm wrapped so that the ops it issues are marked as one group (one CUDA kernel)."""
    rms_norm = F.rms_norm
    calls = itertools.count(1)

    def grouped(*args, **kwargs):
        counter.group = next(calls)
        try:
            return rms_norm(*args, **kwargs)
        finally:
            counter.group = None
    return rms_norm, grouped


def count_step(shape, layers, dtype, fused, batch=32, slots=256):
    """(cpu ops, cuda kernels) of one decode step, each as {"forward": n, "sampling": n}."""
    cfg = M.ModelConfig(**dict(SHAPES[shape], num_hidden_layers=layers))
    torch.manual_seed(0)
    model = M.init_weights(M.CausalLM(cfg)).to(dtype).eval().requires_grad_(False)
    if fused:
        fuse_for_rollout(model)
    cache = M.KVCache(cfg, batch, slots, dtype=dtype)
    cache.valid[:, :slots // 2] = True
    state = DecodeState(batch, 64, "cpu")
    state.slot.fill_(slots // 2)
    state.positions.fill_(slots // 2)
    eos = torch.tensor([1])
    sampling = dict(temperature=1.0, top_k=-1, top_p=1.0, do_sample=True)
    counter = OpCounter()

    def enter(*_):
        counter.phase = "forward"

    def leave(*_):
        counter.phase = "sampling"

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave)
    with torch.no_grad():
        decode_step(model, cache, state, eos, 0, sampling)  # warm-up: lazy buffers, first-call paths
        counter.phase = "other"
        plain, F.rms_norm = grouping_norms(counter)  # model.py calls F.rms_norm: patched for this step
        try:
            with counter:
                decode_step(model, cache, state, eos, 0, sampling)
        finally:
            F.rms_norm = plain
    cpu = {p: sum(1 for o in counter.ops if o[1] == p) for p in ("forward", "sampling")}
    cuda = {p: len({(o[2] if o[2] is not None else ("op", i)) for i, o in enumerate(counter.ops) if o[1] == p})
            for p in ("forward", "sampling")}
    assert not any(o[1] == "other" for o in counter.ops), "ops outside the model call and sampling"
    return cpu, cuda


def breakdown(shape, dtype, fused, layers=None):
    """Per layer, rest of the forward, sampling and total for the shape's layer count."""
    L = SHAPES[shape]["num_hidden_layers"]
    if layers:
        full = count_step(shape, layers, dtype, fused)
        one = count_step(shape, 1, dtype, fused)
        per = [(f["forward"] - o["forward"]) / (layers - 1) for f, o in zip(full, one)]
        return [dict(layer=p, rest=c["forward"] - p * layers, sampling=c["sampling"], total=c["forward"] + c["sampling"])
                for p, c in zip(per, full)]
    c1, c2, c3 = (count_step(shape, n, dtype, fused) for n in (1, 2, 3))
    rows = []
    for a, b, c in zip(c1, c2, c3):
        per = b["forward"] - a["forward"]
        assert c["forward"] - b["forward"] == per, "op count not linear in the layer count"
        rest = a["forward"] - per
        rows.append(dict(layer=per, rest=rest, sampling=a["sampling"], total=rest + per * L + a["sampling"]))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="build this many layers instead of extrapolating")
    args = ap.parse_args(argv)
    configs = [("actor, fp32 (CPU rollouts)", torch.float32, False)]
    if fuse_for_rollout is not None:
        configs.append(("rollout copy, bf16, fused (CUDA rollouts)", torch.bfloat16, True))
    else:  # an older checkout: its rollout copy is the plain model in bf16
        configs.append(("rollout copy, bf16 (CUDA rollouts)", torch.bfloat16, False))
    L = args.layers or SHAPES[args.shape]["num_hidden_layers"]
    print(f"# ops per decode step, shape={args.shape}, {L} layers, batch 32, torch {torch.__version__}")
    print("| model | count | per layer | rest of forward | sampling + record | per step |")
    print("|---|---|---|---|---|---|")
    for name, dtype, fused in configs:
        for col, r in zip(("cpu ops", "cuda kernels"), breakdown(args.shape, dtype, fused, args.layers)):
            print(f"| {name} | {col} | {r['layer']:g} | {r['rest']:g} | {r['sampling']} | {r['total']:g} |")


if __name__ == "__main__":
    main()

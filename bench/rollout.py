"""Rollout throughput: nanokl vs a no-cache loop vs Hugging Face `generate`, side by side.

    python bench/rollout.py                      # CPU: 4M and 25M models, batch 1/8/32
    python bench/rollout.py --device cuda        # GPU: + 0.5B shape, batch 1/32/128/256; the peers
                                                 #   (no graphs, naive, HF) at one batch each
    python bench/rollout.py --sizes tiny --batches 1,4 --new-tokens 8 --rounds 1   # smoke (tests/test_bench.py)

With --out, the markdown table is written row by row as each (model, batch) finishes, so a run cut
short by a timeout keeps what it measured.

Every row decodes greedily from random-init Qwen2-shaped weights, EOS ignored, prompt 32 tokens,
128 new tokens. The peers run the *same weights*: nanokl writes them with `save_pretrained`,
`transformers` loads that directory. Columns: tokens/s = batch * new tokens / wall time of the
whole generation (prefill included); peak memory = what the generation itself added (CUDA:
`max_memory_allocated` above the weights; CPU: peak RSS above the RSS before the call, each
measurement in a fresh process so that no allocator cache hides memory).

What nanokl runs is what PPO training samples with: the rollout copy of the policy as
nanokl/harness/run.py makes it, `fuse_for_rollout(from_pretrained(path, dtype=...))` (q|k|v and
gate|up fused, residual adds in the GEMMs, nanokl/engine/fused.py), in bf16 on CUDA, in fp32 on the CPU
(where training makes a rollout copy under fsdp2), its graph engine sized once on CUDA.
`--plain` runs the model as loaded instead (unfused; what the 2026-12-02 CPU table measured).

The batch-1 decode step (the nanokl row at batch 1, on every device): ms per token of the fused
rollout copy, with graphs (CUDA) and without, against its memory-bandwidth floor, (weight bytes +
KV-cache bytes) over the device's copy bandwidth measured in the same run, and the kernels one
decode step launches: on CUDA the profiler's kernels of an eager generation of 9 tokens minus those
of 1 token, over 8 (= what one graph replay runs); on the CPU the kernel-launching aten ops, counted
the same way with bench/decode_ops.py's counter. The step is counted as training samples
(temperature 1), so the CUDA figure checks bench/decode_ops.py's prediction for the fused bf16 copy
(356-357 at the 0.5B shape, +-1 a layer). The model as loaded (unfused, same dtype) is measured
the same way as the second line, to show what the fusions buy.

The implementations:
  nanokl        nanokl.rollout.generate on the fused rollout copy: one prefill, fixed-shape decode
                on the static KV cache (and CUDA graphs on CUDA)
  nanokl-eager  the same on CUDA without graphs (to show what the graphs buy)
  naive         the model as loaded re-run on the whole sequence for every new token (no cache)
  hf            transformers' model.generate(do_sample=False) with its default dynamic cache
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanokl.harness import hf_format as H  # noqa: E402
from nanokl.engine import model as M  # noqa: E402
from nanokl import rollout  # noqa: E402
from nanokl.engine.fused import fuse_for_rollout  # noqa: E402
from nanokl.engine.graphs import make_engine  # noqa: E402
from nanokl.rollout import generate  # noqa: E402

SHAPES = {  # Qwen2-shaped (GQA, qkv bias, tied embeddings); parameter counts printed in the table
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),  # the smoke test's: seconds on a CPU
    "4m": dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2),
    "25m": dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=2),
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2),  # Qwen2.5-0.5B's shape
}


def make_checkpoint(size, root):
    path = Path(root) / size
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        cfg = M.ModelConfig(model_type="qwen2", tie_word_embeddings=True, rope_theta=1e6,
                            max_position_embeddings=4096, **SHAPES[size])
        H.save_pretrained(M.init_weights(M.CausalLM(cfg)), path)
    return path


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Sample the resident set every millisecond while generation runs (CPU peak memory)."""

    def __enter__(self):
        self.base, self.peak, self.stop = rss_bytes(), rss_bytes(), False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()
        return self

    def _run(self):
        while not self.stop:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.stop = True
        self.t.join()
        self.added = self.peak - self.base


def naive_generate(model, ids, new_tokens):
    """The baseline with no cache: the whole sequence through the model for every token."""
    for _ in range(new_tokens):
        nxt = model(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
    return ids


def dtype_for(dev):
    return torch.bfloat16 if dev.type == "cuda" else torch.float32  # the rollout copy's: rollout.dtype / fp32


def rollout_model(path, dev, fused=True):
    """The policy as training samples with it (nanokl/harness/run.py): loaded at the rollout dtype,
    eval, frozen, fused in place (after the last move); `fused=False`: the model as loaded."""
    model = H.from_pretrained(path, device=dev, dtype=dtype_for(dev)).eval().requires_grad_(False)
    return fuse_for_rollout(model) if fused else model


def load(impl, args, dev):
    path = make_checkpoint(args.size, args.ckpt_dir)
    if impl == "hf":
        import transformers
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype_for(dev)).to(dev).eval()
    model = rollout_model(path, dev, fused=impl != "naive" and not args.plain)
    if impl == "nanokl":  # as training does: the graph engine sized once for this run's calls
        make_engine(model, args.batch, args.prompt_len + args.new_tokens)
    return model


def runner(impl, model, args, dev):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, SHAPES[args.size]["vocab_size"], (args.batch, args.prompt_len), generator=g).to(dev)
    mask = torch.ones_like(ids)
    N = args.new_tokens

    @torch.inference_mode()
    def run():
        if impl == "hf":
            return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=N, min_new_tokens=N,
                                  eos_token_id=None, pad_token_id=0)
        if impl == "naive":
            return naive_generate(model, ids, N)
        return generate(model, ids, mask, N, do_sample=False, eos_token_id=None, pad_token_id=0,
                        use_cuda_graph=impl == "nanokl")
    return run


def worker(args):
    """Timing: every implementation loaded in this one process, run in alternation for `rounds`
    rounds (after one warm-up each), so that a slow spell of a shared machine hits all of them
    alike; each keeps its best round. The naive loop is timed once: it is slow and its ratio to
    the others is large. Prints one JSON line per implementation."""
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    impls = args.impls.split(",")
    models = {i: load(i, args, dev) for i in impls}
    runs = {i: runner(i, models[i], args, dev) for i in impls}
    best = {}
    for rnd in range(args.rounds + 1):  # round 0 warms up (and captures graphs); it is not timed
        for impl in impls:
            if impl == "naive" and rnd != 1:  # minutes per run at 25M: one timed run, no warm-up
                continue
            sync()
            t = time.perf_counter()
            runs[impl]()
            sync()
            dt = time.perf_counter() - t
            if rnd > 0:
                best[impl] = min(best.get(impl, dt), dt)
    peak = {}
    if dev.type == "cuda":  # allocator statistics are exact on CUDA: no fresh process needed
        for impl in impls:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            runs[impl]()
            torch.cuda.synchronize()
            peak[impl] = (torch.cuda.max_memory_allocated() - base) / 2**20
    for impl in impls:
        params = sum(p.numel() for p in models[impl].parameters())
        out = dict(impl=impl, size=args.size, batch=args.batch, params=params, seconds=best[impl],
                   tok_s=args.batch * args.new_tokens / best[impl])
        if impl in peak:
            out["peak_mb"] = peak[impl]
        if args.batch == 1 and impl == "nanokl":
            out.update(bandwidth_floor(models[impl], args, dev))
        print(json.dumps(out), flush=True)


def memory_worker(args):
    """Peak memory of one generation, in a fresh process with one implementation (CPU: freed pages
    would otherwise be reused and hide the peak; CUDA: max_memory_allocated above the weights)."""
    dev = torch.device(args.device)
    model = load(args.impl, args, dev)
    run = runner(args.impl, model, args, dev)
    if args.impl == "naive":  # its peak is its last, longest forward: run just that one
        ids = torch.randint(3, SHAPES[args.size]["vocab_size"], (args.batch, args.prompt_len + args.new_tokens), device=dev)
        run = torch.inference_mode()(lambda: model(ids)[:, -1].argmax(-1))
    with torch.no_grad():  # page the weights in (safetensors maps the file lazily): not the generation's memory
        sum(p.float().sum() for p in model.parameters())
    if dev.type == "cuda":
        run()  # CUDA graphs: capture first, so the peak is the steady state's
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        added = torch.cuda.max_memory_allocated() - base
    else:
        with PeakRSS() as mem:
            run()
        added = mem.added
    print(json.dumps(dict(impl=args.impl, peak_mb=added / 2**20)), flush=True)


def copy_bandwidth(dev):
    """Bytes per second a device-to-device copy moves (read + write): the floor's denominator."""
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    x = torch.empty((1 << 30) if cuda else (1 << 27), dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    reps = 20 if cuda else 5
    for _ in range(3):
        y.copy_(x)
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    sync()
    return 2 * x.numel() * reps / (time.perf_counter() - t)


def bandwidth_floor(model, args, dev):
    """The batch-1 decode step of the fused rollout copy (top-level keys, which bench/gpu_summary.py
    reads) and of the model as loaded ("unfused"), each against its bandwidth floor."""
    path = make_checkpoint(args.size, args.ckpt_dir)
    fused = model if not args.plain else rollout_model(path, dev, fused=True)
    plain = model if args.plain else rollout_model(path, dev, fused=False)
    bw = copy_bandwidth(dev)
    out = dict(copy_gb_s=bw / 1e9, rollout_model=f"fused {str(dtype_for(dev)).split('.')[-1]}",
               kernel_count="cuda kernels (profiler)" if dev.type == "cuda" else "cpu aten ops",
               **decode_step_figures(fused, args, dev, bw))
    out["unfused"] = decode_step_figures(plain, args, dev, bw)
    return out


def decode_step_figures(model, args, dev, bw):
    """Batch-1 decode step time (with graphs on CUDA, and without) vs its floor: bytes that must be
    read per step (weights + the KV cache at full length) / copy bandwidth; kernels per step."""
    cfg = model.config
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    w_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    elt = next(model.parameters()).element_size()
    kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elt * (args.prompt_len + args.new_tokens)
    # time one decode step: (generation of N tokens - generation of 1 token) / (N - 1)
    ids = torch.randint(3, cfg.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(2)).to(dev)
    mask = torch.ones_like(ids)

    def timed(n, graphs):
        best = float("inf")
        for _ in range(3 if graphs else 2):  # the first call with graphs captures: best of 3 leaves it out
            sync()
            t = time.perf_counter()
            generate(model, ids, mask, n, do_sample=False, eos_token_id=None, pad_token_id=0, use_cuda_graph=graphs)
            sync()
            best = min(best, time.perf_counter() - t)
        return best

    N = args.new_tokens
    eager_step = (timed(N, False) - timed(1, False)) / (N - 1)
    step = (timed(N, True) - timed(1, True)) / (N - 1) if cuda else eager_step  # no graphs on the CPU
    floor = (w_bytes + kv_bytes) / bw
    return dict(step_ms=step * 1e3, eager_step_ms=eager_step * 1e3, floor_ms=floor * 1e3,
                step_over_floor=step / floor, kernels_per_step=kernels_per_step(model, ids, mask))


def kernels_per_step(model, ids, mask, n=9):
    """Kernels one decode step launches, as training samples (temperature 1): those of an eager
    generation of n tokens minus those of 1 token, over n - 1. CUDA: kernels the profiler saw (what
    one graph replay runs); CPU: kernel-launching aten ops (bench/decode_ops.py's counter and its
    "cpu ops" column: views, allocations and SDPA's backend choice left out; counted under no_grad,
    as decode_ops does, since inference_mode would hide what composite ops such as rms_norm and
    linear decompose into; the CPU decode loop adds its per-step `done.all()` check, 2 ops)."""
    sampling = dict(temperature=1.0, top_k=-1, top_p=1.0, do_sample=True)

    def gen(tokens):  # nanokl.rollout.generate, eager, without its inference_mode
        with torch.no_grad():
            rollout._generate(model, ids, mask, tokens, sampling, rollout.eos_list(None), 0, None, 1)

    if ids.device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        def count(tokens):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                gen(tokens)
                torch.cuda.synchronize()
            return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    else:
        from decode_ops import OpCounter  # bench/ is this script's folder, first on sys.path

        def count(tokens):
            with OpCounter() as counter:
                gen(tokens)
            return len(counter.ops)

    gen(n)  # warm-up: lazy buffers and first-call paths are not the step's
    return (count(n) - count(1)) / (n - 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", default=None, help="comma list of tiny,4m,25m,0.5b (default: CPU 4m,25m; CUDA 4m,25m,0.5b)")
    ap.add_argument("--batches", default=None, help="comma list (default: CPU 1,8,32; CUDA 1,32,128,256)")
    ap.add_argument("--impls", default=None, help="comma list of nanokl,nanokl-eager,naive,hf")
    ap.add_argument("--impl-batches", default=None,
                    help="restrict implementations to some batches, e.g. 'hf=32,nanokl-eager=1' (default on CUDA: "
                         "hf=32,naive=1,nanokl-eager=1: the peers at one batch, graphs measured everywhere)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds, implementations alternating; best kept")
    ap.add_argument("--memory", choices=["auto", "on", "off"], default="auto",
                    help="CPU peak memory in a fresh process per implementation (auto: on for CPU; CUDA measures "
                         "peak memory in the timing process)")
    ap.add_argument("--plain", action="store_true",
                    help="nanokl runs the model as loaded, unfused, instead of the fused rollout copy training samples with")
    ap.add_argument("--naive-max-batch", type=int, default=1 << 30, help="skip the naive loop above this batch")
    ap.add_argument("--ckpt-dir", default=os.path.join(tempfile.gettempdir(), "nanokl_bench_ckpts"))
    ap.add_argument("--out", default=None, help="write the markdown table here, row by row as measured")
    ap.add_argument("--worker", choices=["time", "memory"], help=argparse.SUPPRESS)
    ap.add_argument("--impl", help=argparse.SUPPRESS)
    ap.add_argument("--size", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker == "time":
        return worker(args)
    if args.worker == "memory":
        return memory_worker(args)

    cuda = args.device.startswith("cuda")
    sizes = (args.sizes or ("4m,25m,0.5b" if cuda else "4m,25m")).split(",")
    batches = [int(b) for b in (args.batches or ("1,32,128,256" if cuda else "1,8,32")).split(",")]
    impls = (args.impls or ("nanokl,nanokl-eager,naive,hf" if cuda else "nanokl,naive,hf")).split(",")
    only = parse_impl_batches(args.impl_batches if args.impl_batches is not None
                              else ("hf=32,naive=1,nanokl-eager=1" if cuda else ""))
    if "hf" in impls and importlib.util.find_spec("transformers") is None:  # the GPU machine may lack it
        impls.remove("hf")
        print("# no transformers here: the hf column is left out", flush=True)
    memory = args.memory == "on" or (args.memory == "auto" and not cuda)
    print(f"# rollout benchmark: device={args.device} prompt={args.prompt_len} new={args.new_tokens} "
          f"torch={torch.__version__} threads={torch.get_num_threads()} nanokl runs "
          f"{'the model as loaded' if args.plain else 'the fused rollout copy'}", flush=True)
    common = ["--device", args.device, "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
              "--ckpt-dir", args.ckpt_dir] + (["--plain"] if args.plain else [])
    rows = []
    table = Table(args.out, impls)
    for size in sizes:
        make_checkpoint(size, args.ckpt_dir)
        for batch in batches:
            todo = [i for i in impls if batch in only.get(i, [batch])
                    and (i != "naive" or batch <= args.naive_max_batch)]  # naive: minutes per run at big shapes
            if not todo:
                continue
            cmd = [sys.executable, __file__, "--worker", "time", "--impls", ",".join(todo), "--size", size,
                   "--batch", str(batch), "--rounds", str(args.rounds)] + common
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                print(f"{size} b{batch} failed:\n{res.stderr[-3000:]}", flush=True)
                table.note(f"{size} batch {batch}: failed ({res.stderr.strip().splitlines()[-1] if res.stderr.strip() else res.returncode})")
                continue
            got = [json.loads(line) for line in res.stdout.strip().splitlines() if line.startswith("{")]
            for row in got:
                if memory:
                    mem = subprocess.run([sys.executable, __file__, "--worker", "memory", "--impl", row["impl"],
                                          "--size", size, "--batch", str(batch)] + common, capture_output=True, text=True)
                    row["peak_mb"] = json.loads(mem.stdout.strip().splitlines()[-1])["peak_mb"] \
                        if mem.returncode == 0 else float("nan")
                rows.append(row)
                print(json.dumps(row), flush=True)
            table.add(got)
    text = format_table(rows, impls)
    print(text)
    return rows


def parse_impl_batches(spec):
    """'hf=32,nanokl-eager=1' -> {"hf": [32], "nanokl-eager": [1]} (implementations not named: every batch)."""
    only = {}
    for item in filter(None, spec.split(",")):
        impl, _, batch = item.partition("=")
        only.setdefault(impl, []).append(int(batch))
    return only


class Table:
    """The markdown table written row by row as each (size, batch) is measured, so that a run cut
    short by a timeout still leaves every row it finished (the JSON of every row below it)."""

    def __init__(self, path, impls):
        self.path, self.impls, self.rows, self.notes, self.json = (Path(path) if path else None), impls, [], [], []
        self._write()

    def add(self, got):
        self.rows.append(format_row(got, self.impls))
        self.notes += [format_floor(r) for r in got if "floor_ms" in r]
        self.json += [json.dumps(r) for r in got]
        self._write()

    def note(self, text):
        self.notes.append(text)
        self._write()

    def _write(self):
        if self.path:
            parts = [table_head(self.impls), *self.rows, "", *self.notes, "", "```", *self.json, "```"]
            self.path.write_text("\n".join(parts) + "\n")


def table_head(impls):
    head = "| model | params | batch | " + " | ".join(f"{i} tok/s" for i in impls) + " | nanokl / hf | " + \
           " | ".join(f"{i} peak MB" for i in impls) + " |"
    return head + "\n|" + "---|" * (head.count("|") - 1)


def format_row(got, impls):
    by = {r["impl"]: r for r in got}
    first = next(iter(by.values()))
    ratio = by["nanokl"]["tok_s"] / by["hf"]["tok_s"] if "nanokl" in by and "hf" in by else float("nan")
    return (f"| {first['size']} | {first['params'] / 1e6:.1f}M | {first['batch']} | "
            + " | ".join(f"{by[i]['tok_s']:.0f}" if i in by else "-" for i in impls)
            + (f" | {ratio:.2f}x | " if ratio == ratio else " | - | ")
            + " | ".join(f"{by[i]['peak_mb']:.0f}" if i in by and "peak_mb" in by[i] else "-" for i in impls) + " |")


def format_floor(r):
    """The batch-1 decode step lines of a nanokl row: the fused rollout copy, then the model as loaded."""
    cuda = r["kernel_count"].startswith("cuda")
    unit = "CUDA kernels per decode step (= per replay)" if cuda else "aten ops per decode step"
    dtype = r["rollout_model"].split()[-1]

    def line(name, f):
        steps = (f"{f['step_ms']:.3f} ms/token with graphs, {f['eager_step_ms']:.3f} ms without" if cuda
                 else f"{f['eager_step_ms']:.3f} ms/token (eager: no graphs on the CPU)")
        return (f"batch-1 decode step, {r['size']}, {name}: {steps}, vs floor {f['floor_ms']:.3f} ms "
                f"({f['step_over_floor']:.2f}x floor); {f['kernels_per_step']:.0f} {unit}")
    lines = [line(f"fused {dtype} rollout copy (what training samples with)", r)]
    if "unfused" in r:
        lines.append(line(f"model as loaded (unfused {dtype})", r["unfused"]))
    return "\n".join(lines) + f"\n(copy bandwidth {r['copy_gb_s']:.0f} GB/s)\n"


def format_table(rows, impls):
    keys = sorted({(r["size"], r["batch"]) for r in rows}, key=lambda k: (list(SHAPES).index(k[0]), k[1]))
    lines = [table_head(impls)]
    lines += [format_row([r for r in rows if (r["size"], r["batch"]) == k], impls) for k in keys]
    lines += [""] + [format_floor(r) for r in rows if "floor_ms" in r]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

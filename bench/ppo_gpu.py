"""End-to-end PPO throughput on one GPU: GSM8K prompts, a Qwen2.5-0.5B-shaped random-init model.

    python bench/ppo_gpu.py --data ../shared/data/gsm8k/train.jsonl --out OUT   # on a lent GPU
    python bench/ppo_gpu.py --shape tiny --device cpu --data ... --out /tmp/x   # CPU smoke of the script
    python bench/ppo_gpu.py ... --settings first --out A; ... --settings config --out B   # same work, two settings

No real checkpoint can be downloaded on the benchmark machine, so the policy is random-init with
Qwen2.5-0.5B's exact shape (what the speed depends on) and a byte-level BPE trained here on the
GSM8K questions. A random policy rarely emits EOS, so every response runs to
max_response_length: the step does the most work it can. Runs `train_ppo.main` with the GSM8K
config (fsdp2 strategy at world size 1, bf16 rollout copy, CUDA graphs) for a few steps and prints
perf/throughput (tokens/s/GPU), the timing_s/* breakdown and peak GPU memory of the steps after the first,
and how the actor was wrapped: under `torchrun --nproc_per_node=1` fsdp2 must really shard (every
parameter a DTensor on a 1-rank mesh); plain `python` has no process group and leaves it unwrapped.
It also runs one actor micro-batch forward to name its attention kernels, reads the rollout graph
engine's captures and rebuilds, and the first step's KL (0 when the reference runs at the actor's
precision). These figures also go to OUT/summary.json (keys strategy, world, sharded, mesh, ...), which
bench/gpu_summary.py reads. It writes no checkpoint (trainer.save_freq=-1: a 0.5B one with both
Adam states is ~12 GB, minutes of the GPU check's budget); summary.json counts any that appeared
as `checkpoints`. bench/gpu_check.sh runs it as `python3 -m torch.distributed.run --standalone
--nproc_per_node=1 bench/ppo_gpu.py ...` (the GPU machine has no `torchrun` or `python`).

Settings (each a list of config overrides, recorded in summary.json as `settings`, named by `label`):
  --settings config   the config file as it is (token budgets 16k/32k, chunked log-probs, no checkpointing)
  --settings first    the first GPU run's (bench/RESULTS.md, 2,289 tokens/s/GPU): 4 responses per training
                      micro-batch (gcd with the mini-batch), 4 per reference and 8 per old-log-prob forward,
                      no dynamic batch size, whole fp32 logits, the actor's activations checkpointed, eager
                      (use_torch_compile false). The critic ran *without* checkpointing then:
                      critic.model.enable_gradient_checkpointing was read nowhere before issue 38, so
                      `first` sets it false, as that run had it.
  on top: --token-budget N (training N, no-grad forwards 2N, dynamic batch size on), --micro N (training
  N, no-grad 2N responses, dynamic off), --checkpointing on|off (actor and critic), --chunk N (0: whole
  logits; N: use_fused_kernels with fused_chunk_size N), --compile on|off (actor.use_torch_compile and
  ref.use_torch_compile; there is no critic key: the trainer compiles the critic by the actor's; CUDA only).

Setup cache (--cache DIR, default OUT/../cache): the tokenizer is trained once (DIR/tokenizer.json,
loaded when present) and the random-init model is built on the device, saved once into
DIR/<shape>-<dtype>/ (bf16 on CUDA) and reused by every later run with that cache, so that two
settings' runs measure the same weights and the second pays no build.

Profile (--profile, on by default on CUDA): the last step (never the first) runs under
torch.profiler (CPU + CUDA activities, no trace file written); throughput, timings and MFU come from
the unprofiled steps only, and summary.json is written before the profiled step starts, so a run cut
short there keeps them. The profile adds to summary.json the top 15 kernels by device time (on CPU:
ops by self time) and the host syncs the profiler saw by name. --time-limit S (default
$STEP_TIMEOUT_S, which bench/gpu_check.sh sets to the step's timeout) skips the profiled step when
1.5 x the slowest step + 20 s would not fit in what is left.

MFU: model FLOPs per phase / (phase seconds x peak x GPUs). A forward costs 2 x (non-embedding
parameters) x (real tokens) + 2 x V x H x (response tokens: the LM head runs on those only) for the
actor and reference, 2 x (non-embedding parameters, value head included) x (real tokens) for the
critic, each + 2 x layers x (heads x head_dim) x s^2 per sequence of causal attention, with s the mean
real length (sum s^2 taken as n x mean^2: a slight under-count). An update is 3 forwards per PPO epoch
(recomputed activations and chunks are not model FLOPs); rollout is one forward over every token.
Peak: --peak-tflops, else bf16 dense by GPU name (H100 SXM / H200 989, H100 PCIe 756, A100 312); on CPU null.

summary.json: label, settings {overrides, specs (each pass's micro_size / token_budget / packed / chunk),
gradient_checkpointing {actor, critic} as set on the models, use_fused_kernels, fused_chunk_size,
use_torch_compile {actor, ref}}, setup
(tokenizer / model: cached or built in s), setup_s (process start to the first step), steps, timed_steps,
throughput, tokens_per_step, timing {timing_s/*}, phases {phase: s, tflop, tflops, mfu}, flops_model
(parameter and token counts used), device_name, peak_tflops, peak_gib, torch, profile {step, wall_s, events,
device_ms, top_kernels [{name, ms, calls}], kernels_by, host_syncs {name: count}, host_syncs_total,
analysis_s, timing} (or {skipped} / {error}), and as before strategy, world, sharded, mesh, kl_step0,
log_prob_max_diff, checkpoints, attention_kernel, engine, wall_s.
"""

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import torch

T0 = time.monotonic()
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train_ppo  # noqa: E402
from nanokl import forwards  # noqa: E402
from nanokl.engine import dist, shard  # noqa: E402
from nanokl.engine.attention import record_kernels  # noqa: E402
from nanokl.engine.graphs import engine_stats  # noqa: E402
from nanokl.harness.hf_format import save_pretrained  # noqa: E402
from nanokl.engine.model import CausalLM, ModelConfig, init_weights  # noqa: E402
from nanokl.harness.tokenizer import load_tokenizer, train_tokenizer  # noqa: E402

SHAPES = {
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2),
    "tiny": dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}
# bf16 dense tensor-core peak (TFLOP/s) by a substring of torch.cuda.get_device_name(), most specific first
PEAK_TFLOPS = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("GH200", 989.0), ("H200", 989.0), ("H100", 989.0),
               ("H800", 989.0), ("A100", 312.0)]


def is_sync(name):
    """A host-side call that waits for the device: cuda{Stream,Device,Event}Synchronize (and their driver
    API names), or the synchronous cudaMemcpy."""
    return name.endswith("Synchronize") or name in ("cudaMemcpy", "cuMemcpyDtoH_v2")


A, C, R, REF = "actor_rollout_ref.actor.", "critic.", "actor_rollout_ref.rollout.", "actor_rollout_ref.ref."


def setting_overrides(args, mini):
    """(config overrides, label) of --settings and the individual flags on top of it, in that order."""
    ov, label = [], [args.settings]
    if args.settings == "first":
        m = math.gcd(4, mini)  # 4 in the first run (mini-batch 64); the CPU smoke's mini-batch is 2
        ov += [f"{A}use_dynamic_bsz=false", f"{REF}log_prob_use_dynamic_bsz=false",
               f"{R}log_prob_use_dynamic_bsz=false", f"{C}use_dynamic_bsz=false",
               f"{A}ppo_micro_batch_size_per_gpu={m}", f"{C}ppo_micro_batch_size_per_gpu={m}",
               f"{REF}log_prob_micro_batch_size_per_gpu=4", f"{R}log_prob_micro_batch_size_per_gpu=8",
               "actor_rollout_ref.model.enable_gradient_checkpointing=true",
               f"{C}model.enable_gradient_checkpointing=false",  # read nowhere at the time: the critic ran without
               "actor_rollout_ref.model.use_fused_kernels=false",
               f"{A}use_torch_compile=false", f"{REF}use_torch_compile=false"]  # eager, as every run then
    if args.token_budget is not None:
        n = args.token_budget
        ov += [f"{A}use_dynamic_bsz=true", f"{A}ppo_max_token_len_per_gpu={n}",
               f"{C}use_dynamic_bsz=true", f"{C}ppo_max_token_len_per_gpu={n}",
               f"{C}forward_max_token_len_per_gpu={2 * n}",
               f"{REF}log_prob_use_dynamic_bsz=true", f"{REF}log_prob_max_token_len_per_gpu={2 * n}",
               f"{R}log_prob_use_dynamic_bsz=true", f"{R}log_prob_max_token_len_per_gpu={2 * n}"]
        label.append(f"token-budget={n}")
    if args.micro is not None:
        m = math.gcd(args.micro, mini)
        ov += [f"{A}use_dynamic_bsz=false", f"{C}use_dynamic_bsz=false", f"{REF}log_prob_use_dynamic_bsz=false",
               f"{R}log_prob_use_dynamic_bsz=false", f"{A}ppo_micro_batch_size_per_gpu={m}",
               f"{C}ppo_micro_batch_size_per_gpu={m}", f"{C}forward_micro_batch_size_per_gpu={2 * args.micro}",
               f"{REF}log_prob_micro_batch_size_per_gpu={2 * args.micro}",
               f"{R}log_prob_micro_batch_size_per_gpu={2 * args.micro}"]
        label.append(f"micro={args.micro}")
    if args.checkpointing is not None:
        on = "true" if args.checkpointing == "on" else "false"
        ov += [f"actor_rollout_ref.model.enable_gradient_checkpointing={on}",
               f"{C}model.enable_gradient_checkpointing={on}"]
        label.append(f"checkpointing={args.checkpointing}")
    if args.chunk is not None:
        ov += ["actor_rollout_ref.model.use_fused_kernels=" + ("true" if args.chunk > 0 else "false")]
        ov += [f"actor_rollout_ref.model.fused_chunk_size={args.chunk}"] if args.chunk > 0 else []
        label.append(f"chunk={args.chunk}")
    if args.compile is not None:
        on = "true" if args.compile == "on" else "false"
        ov += [f"{A}use_torch_compile={on}", f"{REF}use_torch_compile={on}"]  # the critic follows the actor's
        label.append(f"compile={args.compile}")
    return ov, args.label or ",".join(label)


def prepare(args, rows, cache):
    """The model directory (config.json, bf16 safetensors on CUDA, tokenizer) from the cache, built there
    once: the tokenizer trained on the questions, the model initialised on the device. Returns (dir, setup)."""
    cache.mkdir(parents=True, exist_ok=True)
    setup, t = {}, time.perf_counter()
    if (cache / "tokenizer.json").is_file():
        tok, setup["tokenizer"] = load_tokenizer(cache), "cached"
    else:
        tok = train_tokenizer([r["question"] + "\n" + r["answer"] for r in rows[:4000]], vocab_size=2048)
        tok.save(cache)
        setup["tokenizer"] = f"trained in {time.perf_counter() - t:.1f} s"
    dtype = torch.bfloat16 if args.device.startswith("cuda") else None
    model_dir = cache / f"{args.shape}-{str(dtype or torch.float32).removeprefix('torch.')}"
    t = time.perf_counter()
    if (model_dir / "config.json").is_file():
        setup["model"] = "cached"
    else:
        cfg = ModelConfig(model_type="qwen2", attention_bias=True, tie_word_embeddings=True, rope_theta=1e6,
                          **SHAPES[args.shape])
        torch.manual_seed(0)
        with torch.device(args.device):  # normal_ on the GPU, not on a few CPU cores
            model = init_weights(CausalLM(cfg))
        tmp = cache / f".{model_dir.name}.{os.getpid()}"
        save_pretrained(model, tmp, dtype=dtype)
        tok.save(tmp)
        del model
        try:
            os.replace(tmp, model_dir)  # whole or absent: a run killed mid-save leaves only the hidden tmp
        except OSError:  # another process saved it first
            shutil.rmtree(tmp, ignore_errors=True)
        setup["model"] = f"built on {args.device} and saved in {time.perf_counter() - t:.1f} s"
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # the fp32 build on the GPU is not the run's peak
    return model_dir, setup


def sharding(model):
    """(sharded, mesh size, how many parameters are DTensors, how many parameters)."""
    params = list(shard.unwrap(model).parameters())
    dtensors = [p for p in params if type(p).__name__ == "DTensor"]
    mesh = dtensors[0].device_mesh.size() if dtensors else None
    return len(dtensors) == len(params) > 0, mesh, len(dtensors), len(params)


def actor_kernels(run):
    """The attention kernels one actor micro-batch runs (the update's forward, under its autocast and
    packing setting): a left-padded micro-batch of 4 responses of different lengths."""
    spec, dev = run.specs["actor"], run.device
    P, R, V = 24, 16, run.actor_vocab
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(3, V, (4, P + R), generator=g)
    mask = torch.ones(4, P + R, dtype=torch.long)
    for i in range(4):
        mask[i, :3 * i] = 0  # left padding
        mask[i, P + R - 2 * i:] = 0  # shorter responses
    mb = {"sequences": seqs, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
          "responses": seqs[:, P:], "response_mask": mask[:, P:]}
    mb = {k: v.to(dev) for k, v in mb.items()}
    with torch.no_grad(), forwards.autocast(dev), record_kernels() as names:
        forwards.response_logits(run.actor, mb, 1.0, spec.packed)
    return f"{'packed' if spec.packed else 'padded'}: " + ", ".join(sorted(set(names)))


def resolved_settings(run, overrides):
    """What the run really did: each pass's batching spec, and the checkpointing of the models themselves."""
    m = run.cfg.actor_rollout_ref.model
    return dict(overrides=overrides, specs={k: dataclasses.asdict(v) for k, v in run.specs.items()},
                gradient_checkpointing={"actor": bool(shard.unwrap(run.actor).model.gradient_checkpointing),
                                        "critic": bool(shard.unwrap(run.critic).model.gradient_checkpointing)
                                        if run.critic is not None else None},
                use_fused_kernels=m.use_fused_kernels, fused_chunk_size=m.fused_chunk_size,
                use_torch_compile={"actor": run.cfg.actor_rollout_ref.actor.use_torch_compile,
                                   "ref": run.cfg.actor_rollout_ref.ref.use_torch_compile})


def peak_tflops(args):
    """(device name, bf16 dense peak TFLOP/s or None): --peak-tflops, else by the GPU's name; None on CPU."""
    if not torch.cuda.is_available() or not args.device.startswith("cuda"):
        return "cpu", args.peak_tflops
    name = torch.cuda.get_device_name()
    return name, args.peak_tflops or next((v for k, v in PEAK_TFLOPS if k in name), None)


def phase_flops(run, m):
    """Model FLOPs of each timed phase of one step (see the module docstring), from its metrics."""
    cfg, W = run.cfg, run.world
    n_resp = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    tokens = m["perf/total_num_tokens"]  # real prompt + response tokens of the step, all ranks
    resp = m.get("response_length/mean", 0.0) * n_resp
    lm = shard.unwrap(run.actor)
    c = lm.config
    s = tokens / n_resp
    attn = 2 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * s * s * n_resp

    def body(model):
        return sum(p.numel() for n, p in shard.unwrap(model).named_parameters()
                   if "embed_tokens" not in n and "lm_head" not in n)
    fwd_actor = 2 * body(run.actor) * tokens + 2 * c.vocab_size * c.hidden_size * resp + attn
    flops = {"gen": fwd_actor, "old_log_prob": fwd_actor, "ref": fwd_actor,
             "update_actor": 3 * cfg.actor_rollout_ref.actor.ppo_epochs * fwd_actor}
    if run.critic is not None:
        fwd_critic = 2 * body(run.critic) * tokens + attn
        flops |= {"values": fwd_critic,
                  "update_critic": 3 * (cfg.critic.ppo_epochs or cfg.actor_rollout_ref.actor.ppo_epochs) * fwd_critic}
    return flops, dict(actor_body_params=body(run.actor), critic_body_params=body(run.critic) if run.critic else None,
                       lm_head=c.vocab_size * c.hidden_size, tokens=tokens, response_tokens=resp, mean_length=s,
                       world=W)


def phases(timing, flops, peak, world):
    """{phase: seconds, TFLOP, TFLOP/s per GPU, MFU} for every timed phase; the step's FLOPs are the sum."""
    total = sum(flops.values())
    out = {}
    for k, secs in timing.items():
        name = k.split("/", 1)[1]
        f = total if name == "step" else flops.get(name)
        rate = f / secs / world / 1e12 if f and secs else None
        out[name] = dict(s=secs, tflop=f / 1e12 if f else None, tflops=rate,
                         mfu=rate / peak if rate is not None and peak else None)
    return out


def aggregate(events, top=15):
    """The profiled step's events -> (top kernels by device time, host syncs by name, device ms in all).
    `events` are (name, on the device?, ns) triples: kernels, copies and memsets on the device; ops and
    runtime calls (cudaStreamSynchronize, ...) on the host."""
    kern, syncs = {}, Counter()
    for name, on_device, ns in events:
        if on_device:
            k = kern.setdefault(name, [0, 0])
            k[0] += ns
            k[1] += 1
        if on_device and name.startswith("Memcpy DtoH"):
            syncs["Memcpy DtoH (device side)"] += 1
        elif not on_device and is_sync(name):
            syncs[name] += 1
    ranked = sorted(kern.items(), key=lambda kv: -kv[1][0])[:top]
    return ([dict(name=n[:160], ms=round(ns / 1e6, 3), calls=calls) for n, (ns, calls) in ranked], dict(syncs),
            sum(ns for ns, _ in kern.values()) / 1e6)


def profile_summary(prof, cuda, wall_s):
    """summary.json's `profile`: read from kineto's raw events (no trace file, no FunctionEvent tree on CUDA)."""
    from torch.autograd import DeviceType
    t = time.perf_counter()
    raw = []
    for e in prof.profiler.kineto_results.events():
        if any(getattr(e, f, lambda: False)() for f in ("is_user_annotation", "is_hidden_event")):
            continue  # GPU-side ranges of record_function, not kernels
        raw.append((e.name(), e.device_type() != DeviceType.CPU, e.duration_ns()))
    kernels, syncs, device_ms = aggregate(raw)
    if not cuda:  # no device: the ops by self time (inclusive times would rank the outermost ops first)
        ranked = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:15]
        kernels = [dict(name=a.key[:160], ms=round(a.self_cpu_time_total / 1e3, 3), calls=a.count) for a in ranked]
        device_ms = None
    return dict(wall_s=wall_s, events=len(raw), device_ms=device_ms, top_kernels=kernels,
                kernels_by="device time" if cuda else "CPU self time (no device)", host_syncs=syncs,
                host_syncs_total=sum(v for k, v in syncs.items() if is_sync(k)),
                analysis_s=round(time.perf_counter() - t, 2))


def mean(rows, k):
    vals = [r[k] for r in rows if k in r]
    return sum(vals) / len(vals) if vals else None


def write_summary(out, new):
    summary = out / "summary.json"  # in parts: setup, the timed steps, the profile, the probes at the end
    fields = json.loads(summary.read_text()) if summary.exists() else {}
    fields.update({k: v for k, v in new.items() if v is not None})  # absent, not null: readers use defaults
    summary.write_text(json.dumps(fields, indent=1))


def train(argv, args, out, overrides, label):
    """train_ppo.main's loop, keeping the Run and each step's metrics. summary.json gets the unprofiled
    steps' figures before the profiled step (the last) starts, then the profile. Returns (run, rows)."""
    run = train_ppo.setup(train_ppo.parse_cli(argv), stages=train_ppo.train_missing_stages)
    t_setup = time.monotonic() - T0
    cuda = run.device.type == "cuda"
    profile = args.profile == "on" or (args.profile == "auto" and cuda)
    prof_step = run.total_steps - 1 if profile and run.total_steps >= 2 else None  # never the first step
    rows, step_s, reported = [], [], False
    for step in train_ppo.steps(run):
        t = time.perf_counter()
        if step != prof_step:
            metrics = train_ppo.ppo_step(run, step)
        else:
            report(run, args, out, overrides, label, rows, t_setup)
            reported = True
            left = args.time_limit - (time.monotonic() - T0) if args.time_limit else math.inf
            need = 1.5 * max(step_s) + 20  # the step under the profiler, its analysis, the probes after it
            if need > left:
                write_summary(out, {"profile": {"skipped": f"{left:.0f} s left of --time-limit {args.time_limit:.0f}, "
                                                           f"the profiled step needs ~{need:.0f}"}})
                break
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            try:
                with torch.profiler.profile(activities=acts) as prof:
                    metrics = train_ppo.ppo_step(run, step)
                found = profile_summary(prof, cuda, time.perf_counter() - t)
            except Exception as e:  # noqa: BLE001 - the run's figures are written already; say why no profile
                write_summary(out, {"profile": {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}})
                break
            del prof
            timing = {k: v for k, v in metrics.items() if k.startswith("timing_s/")}
            write_summary(out, {"profile": dict(step=step, **found, timing=timing)})
        step_s.append(time.perf_counter() - t)
        go_on = train_ppo.end_step(run, step, metrics)
        rows.append(dict(metrics, _step=step))
        if not go_on:
            break
    run.tracker.close()
    if not reported:
        report(run, args, out, overrides, label, rows, t_setup)
    return run, rows


def report(run, args, out, overrides, label, rows, t_setup):
    """Print the unprofiled steady steps' table and write their figures to summary.json."""
    steady = rows[1:] or rows  # the first step captures CUDA graphs and warms the allocator
    keys = sorted({k for r in steady for k in r if k.startswith("timing_s/")})
    timed = [r["_step"] for r in steady]
    print(f"{label}: mean over steps {timed} (0-based, unprofiled)\n| metric | mean |\n|---|---|")
    for k in ["perf/throughput", "perf/total_num_tokens", "response_length/mean", *keys]:
        v = mean(steady, k)
        if v is not None:
            print(f"| {k} | {v:.2f} |")
    peak = torch.cuda.max_memory_allocated() / 2**30 if run.device.type == "cuda" else None
    if peak is not None:
        print(f"| peak GPU memory (GiB) | {peak:.1f} |")
    timing = {k: mean(steady, k) for k in keys}
    name, peak_tf = peak_tflops(args)
    per_step = [phase_flops(run, r) for r in steady if "perf/total_num_tokens" in r]
    flops = {k: sum(f[0][k] for f in per_step) / len(per_step) for k in per_step[0][0]} if per_step else {}
    sharded, mesh, n_dt, n_p = sharding(run.actor)  # before any no-grad probe forward (actor_kernels)
    write_summary(out, dict(
        label=label, settings=resolved_settings(run, overrides), steps=len(rows), timed_steps=timed,
        strategy=run.cfg.actor_rollout_ref.actor.strategy, world=dist.world(), sharded="yes" if sharded else "no",
        mesh=mesh, sharded_params=f"{n_dt}/{n_p}", throughput=mean(steady, "perf/throughput"),
        tokens_per_step=mean(steady, "perf/total_num_tokens"), peak_gib=peak, timing=timing,
        phases=phases(timing, flops, peak_tf, run.world) if flops else None,
        flops_model=per_step[-1][1] if per_step else None, device_name=name, peak_tflops=peak_tf,
        torch=torch.__version__, setup_s=round(t_setup, 1),
        kl_step0=rows[0].get("actor/reward_kl_penalty") if rows else None,
        log_prob_max_diff=max((r["rollout/log_prob_max_diff"] for r in rows if "rollout/log_prob_max_diff" in r),
                              default=None)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="GSM8K train.jsonl")
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache", help="tokenizer and random-init model, built once (default OUT/../cache)")
    ap.add_argument("--shape", default="0.5b", choices=SHAPES)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=128, help="prompts per step")
    ap.add_argument("--response", type=int, default=256, help="max response tokens")
    ap.add_argument("--strategy", choices=["none", "ddp", "fsdp2"], help="actor (and critic, reference) strategy; "
                    "default: the config's (fsdp2)")
    ap.add_argument("--settings", choices=["first", "config"], default="config",
                    help="first: the first GPU run's micro-batches, checkpointing and whole logits; config: the file's")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--token-budget", type=int, help="tokens per training micro-batch (2x for no-grad forwards)")
    size.add_argument("--micro", type=int, help="responses per training micro-batch (2x for no-grad forwards)")
    ap.add_argument("--checkpointing", choices=["on", "off"], help="activation checkpointing, actor and critic")
    ap.add_argument("--chunk", type=int, help="0: whole fp32 logits; N: log-probs chunked by N tokens")
    ap.add_argument("--compile", choices=["on", "off"], help="torch.compile each decoder layer (CUDA only): "
                    "actor (and critic) and reference")
    ap.add_argument("--label", help="the run's name in summary.json (default: the settings and flags)")
    ap.add_argument("--profile", choices=["on", "off", "auto"], default="auto", help="profile the last step "
                    "(auto: on CUDA only)")
    ap.add_argument("--peak-tflops", type=float, help="the GPU's peak for MFU (default: by its name)")
    ap.add_argument("--time-limit", type=float, default=float(os.environ.get("STEP_TIMEOUT_S") or 0) or None,
                    help="seconds this process may take; the profiled step is skipped when it would not fit")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    model_dir, setup = prepare(args, rows, Path(args.cache) if args.cache else out.resolve().parent / "cache")
    print(f"setup: tokenizer {setup['tokenizer']}, model {setup['model']} ({model_dir})")
    run_dir = out / "run"
    B, mini = args.batch, max(1, args.batch // 2)
    argv = ["--config", str(ROOT / "configs" / "gsm8k_qwen2.5_0.5b.yaml"),
            f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={args.data}",
            f"data.val_files={args.data}", f"data.train_batch_size={B}", f"data.max_response_length={args.response}",
            "data.max_prompt_length=256", "data.truncation=left", "data.prompt_template=plain",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}", f"critic.ppo_mini_batch_size={mini}",
            # the config's micro-batch of 4 must divide the mini-batch (the CPU smoke runs --batch 4)
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={math.gcd(4, mini)}",
            f"critic.ppo_micro_batch_size_per_gpu={math.gcd(4, mini)}",
            f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
            # no checkpoint: a 0.5B one (actor, critic, their Adam states) is ~12 GB, minutes of the GPU check
            "trainer.save_freq=-1", f"trainer.device={args.device}", f"trainer.default_local_dir={run_dir}",
            "trainer.logger=[jsonl]", "trainer.resume_mode=disable"]
    if args.strategy:
        argv.append(f"actor_rollout_ref.actor.strategy={args.strategy}")
    overrides, label = setting_overrides(args, mini)
    argv += overrides
    (out / "summary.json").unlink(missing_ok=True)  # this run's figures only, not a rerun's into the same OUT
    write_summary(out, dict(label=label, setup=setup))
    run, rows = train(argv, args, out, overrides, label)
    strategy, world = run.cfg.actor_rollout_ref.actor.strategy, dist.world()
    sharded, mesh, n_dt, n_p = sharding(run.actor)  # before any no-grad forward, which leaves the root unsharded
    run.actor_vocab = SHAPES[args.shape]["vocab_size"]
    kernels = actor_kernels(run)
    engine = engine_stats(shard.unwrap(run.rollout_model))
    print(f"actor micro-batch attention: {kernels}\nrollout graph engine over {len(rows)} steps: {engine}")
    print(f"{strategy} at world size {world} ({'torchrun' if dist.active() else 'no process group'}): sharded "
          f"{'yes' if sharded else 'no'} ({n_dt}/{n_p} actor parameters DTensor, mesh of {mesh}); "
          f"rollout copy {'yes' if run.rollout_copy else 'no'}")
    del run
    # none expected (save_freq=-1), in verl's layout or the older checkpoints/ one
    saved = sorted(p.name for p in [*run_dir.glob("global_step_*"), *(run_dir / "checkpoints").glob("global_step_*")])
    if saved:
        print(f"checkpoints written despite trainer.save_freq=-1: {saved}")
    write_summary(out, dict(steps=len(rows), checkpoints=len(saved), attention_kernel=kernels, engine=engine,
                            wall_s=round(time.monotonic() - T0, 1)))
    prof = json.loads((out / "summary.json").read_text()).get("profile")
    if prof and "top_kernels" in prof:
        print(f"profiled step {prof['step']} ({prof['wall_s']:.2f} s, {prof['events']} events, analysed in "
              f"{prof['analysis_s']} s); host syncs {prof['host_syncs']}; top kernels by {prof['kernels_by']}:")
        for k in prof["top_kernels"][:5]:
            print(f"  {k['ms']:10.2f} ms {k['calls']:7d}x  {k['name'][:100]}")
    dist.destroy()  # torchrun started us: leave the process group before exiting


if __name__ == "__main__":
    main()

"""The GPU check's two ends: probe the machine first, then fold every log into one screen.

    python bench/gpu_summary.py env OUT/env.json      # versions, attention backends (gpu_check.sh step 0)
    python bench/gpu_summary.py summary OUT           # OUT/summary.md from the files the steps wrote
    python bench/gpu_summary.py compare OUT           # OUT/summary.md: ppo_first vs ppo_config (--ppo-only)

bench/gpu_check.sh runs this at its start and at its end. Each step of the check leaves a file in
OUT (env.json, cuda_tests.log, rollout.md, ppo/summary.json); the summary reads whichever exist, so a
step that timed out shows as "missing" rather than hiding the others. The screen answers, in order:
versions and attention backends (varlen_attn's signature, the packed kernel nanokl chose by it, one
packed bf16 forward and backward through that kernel); the CUDA tests; the 0.5B batch-1 decode step
with and without graphs against the bandwidth floor and the kernels one replay runs; tokens/s by
batch and HF at one batch; graph captures and rebuilds over the PPO run; the attention kernel of an
actor micro-batch; the PPO timing breakdown, tokens/s/GPU and peak memory; step-0 KL and the
rollout/training log-prob gap; whether fsdp2 really sharded under torchrun at world size 1.
`compare` (gpu_check.sh --ppo-only) puts the two PPO runs side by side instead: the first GPU run's
settings and the config's, on the same data and weights: tokens/s/GPU, seconds and MFU per phase,
peak memory, host syncs and the top 5 kernels of each run's profiled step.
"""

import json
import re
import sys
from pathlib import Path


def probe_env(path):
    import torch
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": "cpu"}
    for mod in ("transformers", "flash_attn"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from nanokl.engine import attention as A
    # the varlen_attn this torch has and whether nanokl calls it (by its signature, not its presence)
    env["varlen_attn_signature"] = A.varlen_signature()
    api = A.varlen_api()
    env["torch_varlen_attn"] = ("absent" if env["varlen_attn_signature"] is None else "unused (no window_size)"
                                if api is None else "GQA by enable_gqa" if api.gqa else "GQA by K/V heads repeated")
    env["packed_kernel"] = {"bf16": A.cuda_packed_kernel(torch.bfloat16), "fp32": A.cuda_packed_kernel(torch.float32)}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1))
        b = torch.backends.cuda
        env["sdpa_enabled"] = {k: getattr(b, f"{k}_sdp_enabled")() for k in ("flash", "mem_efficient", "math", "cudnn")
                               if hasattr(b, f"{k}_sdp_enabled")}
        env["sdpa_mask_with_gqa"] = _mask_gqa_kernels(torch)
        env["packed_check"] = _packed_check(torch, A)
    Path(path).write_text(json.dumps(env, indent=1))
    print(json.dumps(env))


def _mask_gqa_kernels(torch):
    """Which fused SDPA kernels accept a boolean mask together with enable_gqa=True on this torch
    (the combination nanokl's model avoids: transformers PR #39412), and which take the mask alone."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(2, 14, 64, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(2, 1, 64, 64, device="cuda", dtype=torch.bool).tril()
    out = {}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        for label, kw, kk in (("mask+gqa", dict(enable_gqa=True), k), ("mask", {}, k.repeat_interleave(7, 1))):
            try:
                with sdpa_kernel([getattr(SDPBackend, name)]):
                    F.scaled_dot_product_attention(q, kk, kk, attn_mask=mask, **kw)
                out[f"{name.lower()} {label}"] = "yes"
            except Exception:  # noqa: BLE001 - "no kernel available" is the answer we probe for
                out[f"{name.lower()} {label}"] = "no"
    return out


def _packed_check(torch, A):
    """One packed bf16 forward and backward with the 0.5B's heads (14 query, 2 KV) through the kernel
    nanokl chose, against per-document SDPA in fp32: the call that crashed on torch 2.11."""
    import torch.nn.functional as F
    lengths = [37, 64, 27]
    ids = torch.repeat_interleave(torch.arange(1, 4), torch.tensor(lengths))[None].cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, sum(lengths), 64, device="cuda", generator=g).bfloat16().requires_grad_()
               for h in (14, 2, 2))
    try:
        with A.record_kernels() as names:
            y = A.attend(q, k, v, A.layout(ids))
        y.float().pow(2).sum().backward()
        ref, start = [], 0
        for n in lengths:
            s = slice(start, start + n)
            ref.append(F.scaled_dot_product_attention(*(t[:, :, s].float() for t in (q, k, v)), is_causal=True,
                                                      enable_gqa=True))
            start += n
        err = (y.float() - torch.cat(ref, 2)).abs().max().item()
        return f"{names[0]}: max |err| {err:.2e} vs fp32 per document, backward ran"
    except Exception as e:  # noqa: BLE001 - the failure is the answer
        return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


def _tests(out):
    log = out / "cuda_tests.log"
    if not log.exists():
        return "missing"
    lines = [ln for ln in log.read_text().splitlines()
             if re.search(r"\d+ (passed|failed|skipped|error)|tests? collected", ln)]
    failed = [ln for ln in log.read_text().splitlines() if ln.startswith(("FAILED", "ERROR"))]
    return (lines[-1].strip("= ") if lines else "no result line (timeout?)") + "".join(f"\n    {f}" for f in failed[:6])


def _rollout(out):
    path = out / "rollout.md"
    if not path.exists():
        return ["rollout: missing"]
    text = path.read_text()
    rows = [json.loads(ln) for ln in text.split("```")[1].strip().splitlines()] if "```" in text else []
    lines = []
    for r in rows:
        if "floor_ms" in r:  # the fused rollout copy (what training samples with), then the model as loaded
            unit = "kernels" if "cuda" in r.get("kernel_count", "") else "aten ops"
            for name, f in ((r.get("rollout_model", "fused"), r), ("unfused", r.get("unfused"))):
                if f:
                    lines.append(f"batch-1 {r['size']} {name}: {f['step_ms']:.2f} ms/token (graphs where the device "
                                 f"has them), {f['eager_step_ms']:.2f} eager; floor {f['floor_ms']:.2f} ms "
                                 f"({f['step_over_floor']:.1f}x floor, {r['copy_gb_s']:.0f} GB/s copy); "
                                 f"{f['kernels_per_step']:.0f} {unit} per decode step")
    by = {}
    for r in rows:
        by.setdefault((r["size"], r["impl"]), []).append(f"b{r['batch']} {r['tok_s']:.0f}")
    for (size, impl), cells in by.items():
        lines.append(f"tok/s {size} {impl}: " + ", ".join(cells))
    return lines or ["rollout: no rows (see rollout.log)"]


def _ppo(out):
    path = out / "ppo" / "summary.json"
    if not path.exists():
        return ["ppo: missing (see ppo.log)"]
    s = json.loads(path.read_text())
    lines = [f"ppo {s.get('steps')} steps, strategy {s.get('strategy')}, world {s.get('world')}: "
             f"fsdp2 sharded: {s.get('sharded')}",
             f"graphs: {s.get('engine')}",
             f"actor micro-batch attention kernel: {s.get('attention_kernel')}",
             f"tokens/s/GPU {s.get('throughput', float('nan')):.0f}; peak GPU memory {s.get('peak_gib', float('nan')):.1f} GiB",
             f"step-0 KL {s.get('kl_step0')}; rollout/log_prob_max_diff {s.get('log_prob_max_diff')}",
             "timing_s: " + ", ".join(f"{k.split('/', 1)[1]} {v:.2f}" for k, v in s.get("timing", {}).items())]
    if s.get("phases"):
        lines.append(f"settings {s.get('label')}: {_settings(s)}; MFU (peak {s.get('peak_tflops')} TFLOP/s): " + ", ".join(
            f"{k} {_pct(v.get('mfu'))}" for k, v in s["phases"].items() if v.get("tflop")))
    prof = s.get("profile")
    if prof:
        lines.append("profiled step: " + (_profile(prof) if "top_kernels" in prof else json.dumps(prof)))
    return lines


def _pct(x):
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _settings(s):
    """One line for a run's resolved settings: the training and no-grad batching, checkpointing, the LM head."""
    st = s.get("settings") or {}
    sp, ck = st.get("specs") or {}, st.get("gradient_checkpointing") or {}
    if not sp:
        return "?"

    def cut(spec):
        return f"{spec['token_budget']} tok" if spec.get("token_budget") else f"{spec.get('micro_size')} seq"
    chunk = (sp.get("actor") or {}).get("chunk")
    return (f"train {cut(sp['actor'])}, old {cut(sp['old'])}, ref {cut(sp['ref'])}; ckpt actor "
            f"{'on' if ck.get('actor') else 'off'} critic {'on' if ck.get('critic') else 'off'}; "
            + (f"logits chunked by {chunk}" if chunk else "whole logits"))


def _profile(prof):
    top = "; ".join(f"{k['name'][:60]} {k['ms']:.0f} ms x{k['calls']}" for k in prof["top_kernels"][:3])
    return (f"step {prof.get('step')} {prof.get('wall_s', 0):.1f} s, host syncs {prof.get('host_syncs_total')}"
            f" {prof.get('host_syncs')}; top by {prof.get('kernels_by')}: {top}")


RUNS = ("ppo_first", "ppo_config")
PHASES = ("step", "gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor")


def compare(out):
    """summary.md of gpu_check.sh --ppo-only: the two runs' figures as columns of one table."""
    out = Path(out)
    runs = {r: json.loads((out / r / "summary.json").read_text()) if (out / r / "summary.json").exists() else None
            for r in RUNS}
    got = [s for s in runs.values() if s]
    head = got[0] if got else {}

    def row(what, fn):
        cells = []
        for r, s in runs.items():
            try:
                cells.append(fn(s) if s else f"missing (see {r}.log in logs.tar.gz)")
            except (KeyError, TypeError, ValueError, IndexError):
                cells.append("-")
        return f"| {what} | " + " | ".join(str(c).replace("|", "/") for c in cells) + " |"

    def phase(name):
        def fn(s):
            p = (s.get("phases") or {}).get(name)
            return "-" if p is None else f"{p['s']:.2f} s" + (f" ({_pct(p['mfu'])})" if p.get("tflop") else "")
        return fn

    def kernel(i):
        def fn(s):
            prof = s.get("profile") or {}
            if "top_kernels" not in prof:
                return (prof.get("skipped") or prof.get("error") or "not profiled")[:80] if i == 0 else ""
            k = prof["top_kernels"]
            return f"{k[i]['name'][:70]}: {k[i]['ms']:.1f} ms x{k[i]['calls']}" if i < len(k) else ""
        return fn
    lines = ["# nanokl GPU check, PPO only: the first GPU run's settings vs the config's",
             f"{head.get('device_name')}; torch {head.get('torch')}; "
             + (f"MFU = model FLOPs / (seconds x {head['peak_tflops']:.0f} TFLOP/s bf16 dense)"
                if head.get("peak_tflops") else "MFU n/a (no peak known: --peak-tflops)")
             + f"; {head.get('tokens_per_step', float('nan')):.0f} tokens a step; "
             "same data, same cached random-init weights; means over the unprofiled steps after the first",
             "", f"| | {' | '.join(RUNS)} |", "|---|---|---|",
             row("label", lambda s: s["label"]), row("settings", _settings),
             row("steps (timed)", lambda s: f"{s['steps']} ({', '.join(map(str, s['timed_steps']))})"),
             row("tokens/s/GPU", lambda s: f"{s['throughput']:.0f}"),
             *(row(f"{p} s (MFU)", phase(p)) for p in PHASES),
             row("peak GPU memory", lambda s: f"{s['peak_gib']:.1f} GiB" if s.get("peak_gib") is not None else "n/a (CPU)"),
             row("setup", lambda s: f"{s['setup_s']:.0f} s to the first step; tokenizer {s['setup']['tokenizer']}, "
                                    f"model {s['setup']['model']}"),
             row("profiled step", lambda s: f"step {s['profile']['step']}, {s['profile']['wall_s']:.1f} s, "
                                            f"{s['profile']['events']} events" if "step" in s.get("profile", {}) else
                 "-"),
             row("host syncs", lambda s: f"{s['profile']['host_syncs_total']} "
                                         f"{s['profile']['host_syncs']}" if "host_syncs" in s.get("profile", {}) else "-"),
             *(row(f"kernel {i + 1}", kernel(i)) for i in range(5))]
    a, b = (runs[r] or {} for r in RUNS)
    if a.get("throughput") and b.get("throughput"):
        lines.append(f"\nconfig / first: {b['throughput'] / a['throughput']:.2f}x tokens/s/GPU")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    print(text)


def summarize(out):
    out = Path(out)
    env = json.loads((out / "env.json").read_text()) if (out / "env.json").exists() else {}
    lines = ["# nanokl GPU check",
             f"{env.get('device')} (cc {env.get('capability')}, {env.get('memory_gib')} GiB); torch {env.get('torch')} "
             f"cuda {env.get('cuda')}; transformers {env.get('transformers')}; flash_attn {env.get('flash_attn')}; "
             f"torch varlen_attn {env.get('torch_varlen_attn')}",
             f"varlen_attn{env.get('varlen_attn_signature')}",
             f"packed kernel on CUDA: {env.get('packed_kernel')}; "
             f"check: {env.get('packed_check', 'not run (no GPU)')}",
             f"SDPA backends enabled: {env.get('sdpa_enabled')}",
             f"SDPA with a mask: {env.get('sdpa_mask_with_gqa')}",
             f"CUDA tests: {_tests(out)}", *_rollout(out), *_ppo(out)]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("env", "summary", "compare"):
        sys.exit(__doc__.split("\n\n")[1])
    {"env": probe_env, "summary": summarize, "compare": compare}[sys.argv[1]](sys.argv[2])

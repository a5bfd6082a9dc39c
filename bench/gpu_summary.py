"""The GPU check's two ends: probe the machine first, then fold every log into one screen.

    python bench/gpu_summary.py env OUT/env.json      # versions, attention backends (gpu_check.sh step 0)
    python bench/gpu_summary.py summary OUT           # OUT/summary.md from the files the steps wrote

bench/gpu_check.sh runs this at its start and at its end. Each step of the check leaves a file in
OUT (env.json, cuda_tests.log, rollout.md, ppo/summary.json); the summary reads whichever exist, so a
step that timed out shows as "missing" rather than hiding the others. The screen answers, in order:
versions and attention backends; the CUDA tests; the 0.5B batch-1 decode step with and without
graphs against the bandwidth floor and the kernels one replay runs; tokens/s by batch and HF at one
batch; graph captures and rebuilds over the PPO run; the attention kernel of an actor micro-batch;
the PPO timing breakdown, tokens/s/GPU and peak memory; step-0 KL and the rollout/training log-prob
gap; whether fsdp2 really sharded under torchrun at world size 1.
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
    try:
        from torch.nn.attention import varlen  # noqa: F401
        env["torch_varlen_attn"] = hasattr(varlen, "varlen_attn")
    except ImportError:
        env["torch_varlen_attn"] = False
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1))
        b = torch.backends.cuda
        env["sdpa_enabled"] = {k: getattr(b, f"{k}_sdp_enabled")() for k in ("flash", "mem_efficient", "math", "cudnn")
                               if hasattr(b, f"{k}_sdp_enabled")}
        env["sdpa_mask_with_gqa"] = _mask_gqa_kernels(torch)
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
        if "floor_ms" in r:
            lines.append(f"batch-1 {r['size']}: {r['step_ms']:.2f} ms/token with graphs, {r['eager_step_ms']:.2f} "
                         f"without; floor {r['floor_ms']:.2f} ms ({r['step_over_floor']:.1f}x floor, "
                         f"{r['copy_gb_s']:.0f} GB/s copy); {r['kernels_per_step']:.0f} kernels per replay")
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
    return lines


def summarize(out):
    out = Path(out)
    env = json.loads((out / "env.json").read_text()) if (out / "env.json").exists() else {}
    lines = ["# nanokl GPU check",
             f"{env.get('device')} (cc {env.get('capability')}, {env.get('memory_gib')} GiB); torch {env.get('torch')} "
             f"cuda {env.get('cuda')}; transformers {env.get('transformers')}; flash_attn {env.get('flash_attn')}; "
             f"torch varlen_attn {env.get('torch_varlen_attn')}",
             f"SDPA backends enabled: {env.get('sdpa_enabled')}",
             f"SDPA with a mask: {env.get('sdpa_mask_with_gqa')}",
             f"CUDA tests: {_tests(out)}", *_rollout(out), *_ppo(out)]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("env", "summary"):
        sys.exit(__doc__.split("\n\n")[1])
    probe_env(sys.argv[2]) if sys.argv[1] == "env" else summarize(sys.argv[2])

"""bench/lora_memory.py runs, and its 7B counts are Qwen2.5-7B's, from a closed form written out here
independently (per layer, the weights' shapes one by one; not the script's grouping)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def qwen25_7b():
    h, inter, L, V, heads, kv_heads = 3584, 18944, 28, 152064, 28, 4
    d = h // heads  # 128
    shapes = {"q": (d * heads, h), "k": (d * kv_heads, h), "v": (d * kv_heads, h), "o": (h, d * heads),
              "gate": (inter, h), "up": (inter, h), "down": (h, inter)}  # [d_out, d_in]
    biases = d * heads + 2 * d * kv_heads  # q, k, v
    per_layer = sum(o * i for o, i in shapes.values()) + biases + 2 * h  # + input and post-attention norms
    actor = V * h + L * per_layer + h + h * V  # embeddings, layers, final norm, untied LM head
    lora = {r: L * sum(r * i + o * r for o, i in shapes.values()) for r in (8, 16, 32, 64)}
    return actor, lora


def test_lora_memory_table_runs_and_counts_7b():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "lora_memory.py")], capture_output=True, text=True,
                         cwd=ROOT, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    actor, lora = qwen25_7b()
    assert actor == 7_615_616_512  # Qwen2.5-7B's published 7.61B
    m = re.search(r"actor parameters ([\d,]+) \(closed form ([\d,]+), meta model ([\d,]+)\)", out.stdout)
    assert m and {int(g.replace(",", "")) for g in m.groups()} == {actor}, out.stdout[:500]
    rows = [ln for ln in out.stdout.splitlines() if ln.startswith(("| LoRA", "| full fine-tune"))]
    assert len(rows) == 2 * 5  # full + 4 ranks, on 1 and 8 GPUs
    for r, n in lora.items():
        assert f"| LoRA r={r}, alpha={2 * r} | {n / 1e6:.1f}M" in out.stdout
    full8 = next(ln for ln in rows if ln.startswith("| full fine-tune") and "| 8 |" in ln)
    gib = [float(c) for c in full8.strip("|").split("|")[3:]]
    assert abs(gib[0] - 16 * actor / 8 / 2 ** 30) < 0.06  # fp32 weights, grads, two moments, sharded over 8

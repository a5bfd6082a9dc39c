"""bench/decode_ops.py: the op count of one decode step, and the issue's budget.

The count per layer does not depend on the widths, so the tiny shape at 24 layers counts what the
Qwen2.5-0.5B shape does (bench/decode_ops.py prints both). The fused bf16 rollout copy must stay
within 400 CUDA kernels per decode step (the target; 1,269 before the fusions), and its count per
layer must be below the plain fp32 actor's. The count's linearity in the layer count is checked inside.
"""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_bench():
    spec = importlib.util.spec_from_file_location("decode_ops", ROOT / "bench" / "decode_ops.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fused_decode_step_within_400_kernels(capsys):
    load_bench().main(["--shape", "tiny"])  # the script's own table: the plain actor, the fused copy
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[1] in ("cpu ops", "cuda kernels"):
            rows[cells[0].split(",")[0], cells[1]] = [float(c) for c in cells[2:]]
    per_layer, per_step = 0, 3
    assert rows["rollout copy", "cuda kernels"][per_step] <= 400, rows
    for count in ("cpu ops", "cuda kernels"):
        assert rows["rollout copy", count][per_layer] < rows["actor", count][per_layer]

"""The benchmarks still run: every bench script in its tiny CPU mode, and the GPU check's shell script.

A benchmark is only run by hand (or on a lent GPU, once), so a renamed flag or a moved function
would otherwise surface there, at the worst moment: bench/gpu_check.sh once passed a flag that
bench/rollout.py did not accept and exited at once. `gpu_check.sh --smoke` runs the very same
commands with the same flags on tiny shapes on the CPU, and the test checks that every step left
its result and that the summary reads them. The numbers are not checked here (speed is what the
benchmarks measure, never the tests); only that each script runs end to end and reports.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def run(cmd, **kw):
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, **kw)
    assert res.returncode == 0, f"{cmd} exited {res.returncode}:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return res.stdout


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.sh")))
def test_shell_scripts_parse(script):
    run(["bash", "-n", str(BENCH / script)])


def fake_gsm8k(path, rows=48):
    """GSM8K-shaped rows (question, answer ending in '#### N'): the PPO benchmark's input format."""
    with open(path, "w") as f:
        for i in range(rows):
            a, b = i % 7 + 2, i % 5 + 3
            f.write(json.dumps({"question": f"Tom has {a} boxes of {b} apples. How many apples does he have?",
                                "answer": f"He has {a} * {b} = {a * b} apples.\n#### {a * b}"}) + "\n")


def test_gpu_check_smoke(tmp_path):
    """The GPU script end to end on CPU: probe, CUDA tests (collected), rollout table, PPO under
    torchrun at world size 1, summary; each step's file must exist and the summary must read it."""
    fake_gsm8k(tmp_path / "gsm8k.jsonl")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "SMOKE_DATA": str(tmp_path / "gsm8k.jsonl"),
           "OMP_NUM_THREADS": "1"}
    run(["bash", str(BENCH / "gpu_check.sh"), "--smoke"], env=env, timeout=300)
    out = tmp_path / "out"
    assert json.loads((out / "env.json").read_text())["torch"]
    assert "collected" in (out / "cuda_tests.log").read_text()
    table = (out / "rollout.md").read_text()
    rows = [json.loads(ln) for ln in table.split("```")[1].strip().splitlines()]
    assert {(r["impl"], r["batch"]) for r in rows} == {("nanokl", 1), ("nanokl-eager", 1), ("nanokl", 4), ("hf", 4)}
    assert all(r["tok_s"] > 0 for r in rows)
    ppo = json.loads((out / "ppo" / "summary.json").read_text())
    assert ppo["steps"] == 2 and ppo["throughput"] > 0 and "timing_s/step" in ppo["timing"]
    assert ppo["sharded"] == "yes" and ppo["world"] == 1  # torchrun at world size 1: fsdp2 really shards
    assert ppo["kl_step0"] == 0.0  # the reference runs at the actor's precision
    assert ppo["attention_kernel"].startswith(("packed: ", "padded: "))
    summary = (out / "summary.md").read_text()
    assert "missing" not in summary, summary


def test_memory_table():
    out = run([sys.executable, str(BENCH / "memory.py")])
    assert out.count("| Qwen2.5-") == 6


def test_step_tiny():
    """bench/step.py's smoke mode: nanokl's GRPO step timed (TRL is an optional extra, not run here)."""
    out = run([sys.executable, str(BENCH / "step.py"), "--tiny"], timeout=300)
    row = next(ln for ln in out.splitlines() if ln.startswith("| tiny |"))
    assert float(row.split("|")[3]) > 0  # nanokl s/step

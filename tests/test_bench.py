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
import torch

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


def _race():
    sys.path.insert(0, str(BENCH))
    import race
    return race


def test_race_clock_matches_a_naive_schedule():
    """The race's clock: an evaluation is due when the step-time total crosses a multiple of `every`
    or of the budget, and the race ends at horizon x budget. Checked against a plain float loop."""
    race = _race()
    durations = [0.37, 0.41, 0.29, 0.55, 0.33, 0.61, 0.18, 0.47, 0.52, 0.39, 0.44, 0.36]
    budget, every, horizon = 1.7, 0.5, 2
    clock = race.Clock(budget, horizon, every)
    got, t_prev, t = [], 0.0, 0.0
    want = []
    for d in durations:
        if clock.done():
            break
        clock.add(d)
        t += d
        got.append(clock.due())
        crossed_every = int(t // every) > int(t_prev // every)
        crossed_budget = any(t_prev < budget * k <= t for k in range(1, horizon + 1))
        want.append(crossed_every or crossed_budget)
        t_prev = t
    assert got == want and sum(want) >= 5
    assert clock.done() and t >= budget * horizon and t - durations[len(got) - 1] < budget * horizon


def test_race_test_set_is_held_out():
    """The race's test problems: the validation side of the task's hash (never a training problem),
    none of the validation set's, drawn with another seed; the same every time."""
    race = _race()
    from nanokl.harness.config import load_config
    from nanokl.tasks import arith
    cfg = load_config(ROOT / "configs" / "arith_tiny.yaml")
    train, val = arith.examples(cfg.data, seed=cfg.data.seed)
    test = race.test_set(cfg, val, 512, 7)
    prompts = [ex["prompt"] for ex in test]
    assert len(set(prompts)) == 512
    assert not set(prompts) & {ex["prompt"] for ex in val}
    assert not set(prompts) & {ex["prompt"] for ex in train}
    assert all(arith._is_val_problem(p) for p in prompts)
    assert race.test_set(cfg, val, 512, 7) == test and race.test_set(cfg, val, 512, 8) != test


def test_race_tiny(sft_dir, tmp_path):
    """bench/race.py's tiny mode end to end (TRL, the peer, is an optional extra, not run here): the
    curve starts at the warm start's own accuracy, each evaluation sits on the step that crossed its
    mark, and the table reads the curve."""
    out = run([sys.executable, str(BENCH / "race.py"), "--tiny", "--model", str(sft_dir), "--out", str(tmp_path)],
              timeout=300)
    curve = json.loads((tmp_path / "nanokl_default_s42.json").read_text())["curve"]
    race = _race()
    from nanokl.harness.config import load_config
    from nanokl.harness.hf_format import from_pretrained
    from nanokl.harness.scoring import validate
    from nanokl.harness.tokenizer import load_tokenizer
    cfg = load_config(ROOT / "configs" / "arith_tiny.yaml", [f"actor_rollout_ref.model.path={sft_dir}",
                                                             "data.num_val=8"])
    _, val = race.TASKS["arith"].examples(cfg.data, seed=cfg.data.seed)
    acc0 = validate(from_pretrained(sft_dir), load_tokenizer(sft_dir), val, cfg, torch.device("cpu"))
    assert curve[0]["t"] == 0 and curve[0]["acc_val"] == acc0[race.ACC]
    ts = [p["t"] for p in curve]
    assert ts == sorted(ts) and ts[-1] >= 2 * 3.0 and any(p["t"] >= 3.0 for p in curve[:-1])
    row = next(ln for ln in out.splitlines() if ln.startswith("| nanokl | default | 42 |"))
    one = next(p for p in curve if p["t"] >= 3.0)
    assert float(row.split("|")[4]) == round(one["acc_test"], 3) and int(row.split("|")[12]) == one["step"]

"""The benchmarks still run: every bench script in its tiny CPU mode, and the GPU check's shell script.

A benchmark is only run by hand (or on a lent GPU, once), so a renamed flag or a moved function
would otherwise surface there, at the worst moment: bench/gpu_check.sh once passed a flag that
bench/rollout.py did not accept and exited at once. `gpu_check.sh --smoke` runs the very same
commands with the same flags on tiny shapes on the CPU, and the test checks that every step left
its result and that the summary reads them. The numbers are not checked here (speed is what the
benchmarks measure, never the tests); only that each script runs end to end and reports.

The smoke also runs as the GPU machine would: with `python3` and no `python` on PATH (the machine
promises only that), and it must leave at most 8 files under $OUT, at most two folders down, with
names of [A-Za-z0-9._-] (what a device run hands back).
"""

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

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


SYSTEM_DIRS = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]
SHELL_TOOLS = ["bash", "env", "timeout", "tar", "gzip", "find", "mktemp", "cp", "mv", "rm", "mkdir", "cat",
               "dirname", "ls", "uname"]


def python3_only_path(bin_dir):
    """A PATH as on the GPU machine: `python3` (this interpreter, which has torch) and the system
    folders, but no `python` anywhere; a tool found only in a folder that also has `python` is linked
    into bin_dir instead.

    `python3` is a two-line script that execs sys.executable, not a link to it: a link to a venv's
    python from outside the venv's folder has no pyvenv.cfg beside it and starts the base interpreter,
    without the venv's packages (torch), so every step would fail in a fresh `python -m venv` checkout."""
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    dirs = [d for d in SYSTEM_DIRS if Path(d).is_dir() and not (Path(d) / "python").exists()]
    for tool in SHELL_TOOLS:
        found = shutil.which(tool)
        if found and not shutil.which(tool, path=os.pathsep.join(dirs)):
            (bin_dir / tool).symlink_to(found)
    return os.pathsep.join([str(bin_dir), *dirs])


@pytest.mark.slow  # in `pytest -m slow` (the default suite stays near 8 min on 2 cores)
def test_gpu_check_smoke(tmp_path):
    """The GPU script end to end on CPU, as the GPU machine runs it (python3, no python): probe,
    CUDA tests (collected), rollout table, PPO under torch.distributed.run at world size 1, summary;
    each step's file must exist, the summary must read it, and what $OUT holds must come back."""
    fake_gsm8k(tmp_path / "gsm8k.jsonl")
    path = python3_only_path(tmp_path / "bin")
    env = {**os.environ, "PATH": path, "OUT": str(tmp_path / "out"), "SMOKE_DATA": str(tmp_path / "gsm8k.jsonl"),
           "OMP_NUM_THREADS": "1"}
    env.pop("PY", None)
    env.pop("VIRTUAL_ENV", None)
    probe = subprocess.run(["bash", "-c", "command -v python; command -v python3"], env=env, capture_output=True,
                           text=True)
    assert probe.stdout.strip() == str(tmp_path / "bin" / "python3"), probe.stdout  # no python, our python3
    stdout = run(["bash", str(BENCH / "gpu_check.sh"), "--smoke"], env=env, timeout=300)
    out = tmp_path / "out"

    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert len(files) <= 8, files  # a device run hands back at most 8 files
    assert all(f.count("/") <= 2 and all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in f.split("/"))
               for f in files), files  # at most two folders down, plain names
    assert {"summary.md", "summary.json", "logs.tar.gz"} <= set(files)
    assert f"$OUT holds {len(files)} files" in stdout.splitlines()[-1]  # the summary is printed last

    assert json.loads((out / "env.json").read_text())["torch"]
    assert "collected" in (out / "cuda_tests.log").read_text()
    table = (out / "rollout.md").read_text()
    rows = [json.loads(ln) for ln in table.split("```")[1].strip().splitlines()]
    assert {(r["impl"], r["batch"]) for r in rows} == {("nanokl", 1), ("nanokl-eager", 1), ("nanokl", 4), ("hf", 4)}
    assert all(r["tok_s"] > 0 for r in rows)
    b1 = next(r for r in rows if (r["impl"], r["batch"]) == ("nanokl", 1))  # the batch-1 decode step
    assert b1["rollout_model"] == "fused float32" and b1["kernel_count"] == "cpu aten ops"
    assert b1["floor_ms"] > 0 and b1["unfused"]["floor_ms"] > 0
    assert 0 < b1["kernels_per_step"] < b1["unfused"]["kernels_per_step"]  # the fusions cut ops, on CPU too
    assert "fused float32 rollout copy" in table and "model as loaded (unfused float32)" in table
    ppo = json.loads((out / "ppo" / "summary.json").read_text())
    assert ppo["steps"] == 2 and ppo["throughput"] > 0 and "timing_s/step" in ppo["timing"]
    assert ppo["sharded"] == "yes" and ppo["world"] == 1  # torchrun at world size 1: fsdp2 really shards
    assert ppo["checkpoints"] == 0  # trainer.save_freq=-1: no ~12 GB checkpoint inside the PPO step
    assert ppo["kl_step0"] == 0.0  # the reference runs at the actor's precision
    assert ppo["attention_kernel"].startswith(("packed: ", "padded: "))
    summary = (out / "summary.md").read_text()
    assert "missing" not in summary and "DOES NOT FIT" not in summary, summary
    js = json.loads((out / "summary.json").read_text())
    assert js["files_fit"] and js["files"] == files and js["rollout"] == rows and js["ppo"] == ppo
    assert [s["step"] for s in js["steps"]] == ["env", "cuda_tests", "rollout", "ppo"]
    assert all(s["rc"] == 0 and s["seconds"] < s["timeout_s"] for s in js["steps"]), js["steps"]
    logs = subprocess.run(["tar", "tzf", str(out / "logs.tar.gz")], capture_output=True, text=True).stdout.split()
    assert {"./env.log", "./cuda_tests.log", "./rollout.log", "./ppo.log", "./ppo/run/metrics.jsonl"} <= set(logs), logs
    assert not any("model" in f.split("/") or "ckpts" in f.split("/") for f in logs), logs  # no weights


def test_gpu_check_ppo_only_smoke(tmp_path):
    """`gpu_check.sh --ppo-only --smoke`: the PPO step twice on CPU as the GPU machine runs it (python3,
    no python), the first GPU run's settings then the config's, on one cache (the second run builds
    nothing), each with a profiled last step; both summaries come back with their settings, and the
    side-by-side table is printed before the step times and the file list."""
    fake_gsm8k(tmp_path / "gsm8k.jsonl")
    env = {**os.environ, "PATH": python3_only_path(tmp_path / "bin"), "OUT": str(tmp_path / "out"),
           "SMOKE_DATA": str(tmp_path / "gsm8k.jsonl"), "OMP_NUM_THREADS": "1"}
    env.pop("PY", None)
    env.pop("VIRTUAL_ENV", None)
    stdout = run(["bash", str(BENCH / "gpu_check.sh"), "--ppo-only", "--smoke"], env=env, timeout=240)
    out = tmp_path / "out"
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["logs.tar.gz", "ppo_config/summary.json", "ppo_first/summary.json", "summary.json", "summary.md"]
    assert f"$OUT holds {len(files)} files" in stdout.splitlines()[-1]
    first, config = (json.loads((out / f"ppo_{s}" / "summary.json").read_text()) for s in ("first", "config"))
    for s, label in ((first, "first"), (config, "config")):
        assert s["label"] == label and s["steps"] == 3 and s["timed_steps"] == [1] and s["throughput"] > 0
        assert s["phases"]["step"]["tflop"] > 0 and s["phases"]["step"]["mfu"] is None  # no peak on CPU
        prof = s["profile"]
        assert prof["step"] == 2 and prof["top_kernels"] and all(k["ms"] >= 0 and k["calls"] > 0
                                                                  for k in prof["top_kernels"])
        assert s["sharded"] == "yes" and s["checkpoints"] == 0
    # first: 2 responses a training micro-batch (gcd(4, mini-batch 2)), 4 a reference one, 8 an old-log-prob
    # one, no token budget, whole logits, the actor checkpointed (the critic was not, in that run)
    fs, cs = first["settings"]["specs"], config["settings"]["specs"]
    assert [fs[k]["micro_size"] for k in ("actor", "critic", "ref", "old")] == [2, 2, 4, 8]
    assert all(v["token_budget"] is None and v["chunk"] is None for v in fs.values())
    assert first["settings"]["gradient_checkpointing"] == {"actor": True, "critic": False}
    # config: the file's budgets and chunk, no checkpointing
    assert [cs[k]["token_budget"] for k in ("actor", "critic", "ref", "old", "values")] == [16384] * 2 + [32768] * 3
    assert cs["actor"]["chunk"] == cs["ref"]["chunk"] == 2048
    assert config["settings"]["gradient_checkpointing"] == {"actor": False, "critic": False}
    assert "cached" not in first["setup"]["model"] and config["setup"] == {"tokenizer": "cached", "model": "cached"}
    summary = (out / "summary.md").read_text()
    assert "| tokens/s/GPU |" in summary and "| kernel 5 |" in summary and "missing" not in summary, summary
    js = json.loads((out / "summary.json").read_text())
    assert js["mode"] == "ppo-smoke" and js["files_fit"] and js["ppo_first"] == first and js["ppo_config"] == config
    assert [(s["step"], s["rc"]) for s in js["steps"]] == [("ppo_first", 0), ("ppo_config", 0)]
    logs = subprocess.run(["tar", "tzf", str(out / "logs.tar.gz")], capture_output=True, text=True).stdout.split()
    assert {"./ppo_first.log", "./ppo_config.log", "./ppo_first/run/metrics.jsonl"} <= set(logs), logs
    assert not any(f.startswith("./cache") for f in logs), logs  # no weights, no tokenizer cache


def _ppo_gpu():
    sys.path.insert(0, str(BENCH))
    import ppo_gpu
    return ppo_gpu


def test_ppo_gpu_setting_flags():
    """bench/ppo_gpu.py's flags are config overrides that load: each resolves to the batching it names."""
    ppo_gpu = _ppo_gpu()
    from nanokl.harness.config.load import load_config
    from nanokl.harness.run import batching_specs

    def specs(*argv):
        ap = argparse.Namespace(settings="config", token_budget=None, micro=None, checkpointing=None, chunk=None,
                                compile=None, label=None)
        for flag in argv:
            k, v = flag.split("=")
            setattr(ap, k, v if k in ("settings", "checkpointing", "compile") else int(v))
        ov, label = ppo_gpu.setting_overrides(ap, 64)
        cfg = load_config(ROOT / "configs" / "gsm8k_qwen2.5_0.5b.yaml", ov)
        return batching_specs(cfg), cfg, label
    sp, cfg, label = specs("settings=first")
    assert label == "first" and [sp[k].micro_size for k in ("actor", "critic", "values", "ref", "old")] == [4, 4, 4, 4, 8]
    assert not any(s.token_budget or s.chunk for s in sp.values())
    assert cfg.actor_rollout_ref.model.enable_gradient_checkpointing and not cfg.critic.model.enable_gradient_checkpointing
    assert not cfg.actor_rollout_ref.actor.use_torch_compile and not cfg.actor_rollout_ref.ref.use_torch_compile
    sp, cfg, label = specs("settings=first", "compile=on")
    assert label == "first,compile=on" and cfg.actor_rollout_ref.actor.use_torch_compile
    assert cfg.actor_rollout_ref.ref.use_torch_compile
    sp, cfg, label = specs("settings=first", "token_budget=8192", "chunk=1024", "checkpointing=off")
    assert label == "first,token-budget=8192,checkpointing=off,chunk=1024"
    assert [sp[k].token_budget for k in ("actor", "critic", "values", "ref", "old")] == [8192] * 2 + [16384] * 3
    assert sp["actor"].chunk == sp["old"].chunk == sp["ref"].chunk == 1024
    assert not cfg.actor_rollout_ref.model.enable_gradient_checkpointing and not cfg.critic.model.enable_gradient_checkpointing
    sp, cfg, label = specs("micro=8", "chunk=0", "checkpointing=on")
    assert label == "config,micro=8,checkpointing=on,chunk=0"
    assert [(sp[k].micro_size, sp[k].token_budget) for k in ("actor", "critic", "values", "ref", "old")] == \
        [(8, None)] * 2 + [(16, None)] * 3
    assert not any(s.chunk for s in sp.values()) and cfg.critic.model.enable_gradient_checkpointing
    sp, _, label = specs()
    assert label == "config" and sp["actor"].token_budget == 16384 and sp["actor"].chunk == 2048


def test_ppo_gpu_profile_aggregate():
    """The profile's kernel table and host-sync count from kineto's (name, on device, ns) events: device
    events summed by name, runtime sync calls counted on the host side, device-side D2H copies apart."""
    ppo_gpu = _ppo_gpu()
    events = [("gemm", True, 3_000_000), ("gemm", True, 1_000_000), ("elementwise", True, 500_000),
              ("Memcpy DtoH (Device -> Pageable)", True, 10_000), ("cudaStreamSynchronize", False, 1),
              ("cudaStreamSynchronize", False, 1), ("cudaDeviceSynchronize", False, 1), ("aten::mm", False, 9e9),
              ("cudaLaunchKernel", False, 5)]
    top, syncs, device_ms = ppo_gpu.aggregate(events, top=2)
    assert top == [dict(name="gemm", ms=4.0, calls=2), dict(name="elementwise", ms=0.5, calls=1)]
    assert syncs == {"cudaStreamSynchronize": 2, "cudaDeviceSynchronize": 1, "Memcpy DtoH (device side)": 1}
    assert device_ms == 4.51
    flops = {"gen": 2e12, "update_actor": 6e12}
    ph = ppo_gpu.phases({"timing_s/gen": 2.0, "timing_s/update_actor": 3.0, "timing_s/adv": 0.1, "timing_s/step": 8.0},
                        flops, 1000.0, 1)
    assert ph["gen"]["tflops"] == 1.0 and ph["update_actor"]["mfu"] == 2.0 / 1000 and ph["adv"]["mfu"] is None
    assert ph["step"]["tflop"] == 8.0 and ph["step"]["mfu"] == 1.0 / 1000


def test_gpu_check_reports_what_would_not_come_back(tmp_path):
    """The end of the GPU script on its own (a deadline of 0 skips every step): stray files in $OUT
    beyond the 8 that come back, one three folders down and an odd name are reported, the summary
    is still printed last, and the script exits 1."""
    out = tmp_path / "out"
    (out / "a" / "b" / "c").mkdir(parents=True)
    for name in ("x1", "x2", "x3", "x4", "x5", "odd name.txt", "a/b/c/deep.txt"):
        (out / name).write_text("stray\n")
    env = {**os.environ, "OUT": str(out), "DEADLINE": "0", "SMOKE_DATA": str(tmp_path / "none.jsonl"),
           "PATH": python3_only_path(tmp_path / "bin")}
    res = subprocess.run(["bash", str(BENCH / "gpu_check.sh"), "--smoke"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    last = res.stdout.strip().splitlines()
    # 7 stray files + summary.md, summary.json, logs.tar.gz and cuda_tests.log (the skipped step's note)
    assert last[-1].startswith("DOES NOT FIT: 11 files"), last[-1]
    assert "'a/b/c/deep.txt'" in last[-1] and "'odd name.txt'" in last[-1]
    js = json.loads((out / "summary.json").read_text())
    assert not js["files_fit"] and [s["rc"] for s in js["steps"]] == ["skipped", "skipped", "skipped", "no data"]


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
    from nanokl.harness.config.load import load_config
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


def test_race_setting_may_name_its_config():
    """A race setting `config=PATH` starts from that file instead of arith_tiny.yaml (the DAPO arm), the
    race's own keys and the other overrides on top."""
    race = _race()
    from nanokl.harness.config.load import load_config
    args = SimpleNamespace(out="o", model=None, common=[])
    cfg = race.base_config(args, ["config=configs/dapo_arith.yaml", "trainer.seed=7"])
    want = load_config(ROOT / "configs" / "dapo_arith.yaml")
    assert cfg.algorithm.filter_groups.enable and cfg.algorithm.adv_estimator == want.algorithm.adv_estimator == "grpo"
    assert cfg.trainer.seed == 7 and cfg.trainer.test_freq == -1 and not cfg.trainer.kl_monitor.enable
    assert race.base_config(args, []).algorithm.adv_estimator == "reinforce_plus_plus"


def test_race_tiny(sft_dir, tmp_path):
    """bench/race.py's tiny mode end to end (TRL, the peer, is an optional extra, not run here): the
    curve starts at the warm start's own accuracy, each evaluation sits on the step that crossed its
    mark, and the table reads the curve.

    The clock is real seconds of training steps, so how many steps fit (and so how many evaluations)
    depends on the machine's speed and load: one step past 6 s is a legal race of a single step. The
    checks are on what the schedule must hold given the step times the run recorded, never on speed."""
    out = run([sys.executable, str(BENCH / "race.py"), "--tiny", "--model", str(sft_dir), "--out", str(tmp_path)],
              timeout=300)
    result = json.loads((tmp_path / "nanokl_default_s42.json").read_text())
    curve, train = result["curve"], result["train"]
    race = _race()
    from nanokl.harness.config.load import load_config
    from nanokl.harness.hf_format import from_pretrained
    from nanokl.harness.scoring import evaluate
    from nanokl.harness.tokenizer import load_tokenizer
    cfg = load_config(ROOT / "configs" / "arith_tiny.yaml", [f"actor_rollout_ref.model.path={sft_dir}",
                                                             "data.num_val=8"])
    _, val = race.TASKS["arith"].examples(cfg.data, seed=cfg.data.seed)
    acc0 = evaluate(from_pretrained(sft_dir), load_tokenizer(sft_dir), val, cfg, torch.device("cpu"))
    assert curve[0]["t"] == 0 and curve[0]["acc_val"] == acc0[race.ACC]
    # the clock after each step (--tiny: budget 3 s, horizon 2, an evaluation every 1.5 s)
    budget, every, end = 3.0, 1.5, 6.0
    ts = [x["t"] for x in train]
    assert ts and all(a < b for a, b in zip([0.0, *ts], ts))  # every step adds its (positive) time
    assert ts[-1] >= end and all(t < end for t in ts[:-1])  # the race stops on the step that crosses 2x
    # an evaluation after exactly the steps that crossed a multiple of `every` or of the budget, at that
    # step's clock reading: the naive schedule replayed on the recorded step times
    want = [(0, 0.0)] + [(i + 1, t) for i, (t0, t) in enumerate(zip([0.0, *ts], ts))
                         if int(t // every) > int(t0 // every) or any(t0 < budget * k <= t for k in (1, 2))]
    assert [(p["step"], p["t"]) for p in curve] == want
    row = next(ln for ln in out.splitlines() if ln.startswith("| nanokl | default | 42 |"))
    one = next(p for p in curve if p["t"] >= budget)  # the step that crossed the budget (the last, if it was slow)
    assert float(row.split("|")[4]) == round(one["acc_test"], 3) and int(row.split("|")[12]) == one["step"]

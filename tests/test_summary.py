"""The run's summary (nanokl/harness/summary.py) against metrics.jsonl, recomputed here independently.

- a real 6-step run with a validation every 2 steps: every figure of the summary.json it writes
  (accuracy first / best / last, the second half's mean KL and target, beta's path, the monitor's
  events, the reference checks, the KL-accuracy pairs and r) is recomputed from the raw lines of
  metrics.jsonl by the loops below; `python -m nanokl.harness.summary RUN_DIR` writes the same file.
- synthetic rows: r against statistics.correlation (a known linear relation gives exactly +-1), no
  validation, one validation, a constant KL, NaN written as a string, events with and without an action.
"""

import json
import math
import statistics
import sys
from pathlib import Path

import pytest

import train_ppo
from nanokl.harness import summary

ROOT = Path(__file__).resolve().parents[1]
TINY = ["data.num_train=64", "data.num_val=16", "data.train_batch_size=8", "data.max_response_length=32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.logger=[jsonl]", "trainer.test_freq=2", "trainer.save_freq=-1", "trainer.device=cpu",
        "trainer.total_training_steps=6", "trainer.kl_monitor.ref_check_freq=2"]


def raw_rows(run_dir):
    """metrics.jsonl's lines, the rows of one step merged by hand (validation at step 0 has its own)."""
    by_step = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row["training/global_step"], {}).update(row)
    return [by_step[s] for s in sorted(by_step)]


def test_the_summary_of_a_real_run_matches_metrics_jsonl(sft_dir, tmp_path, capfd):
    capfd.readouterr()
    train_ppo.main(["--config", str(ROOT / "configs" / "arith_tiny.yaml"), *TINY,
                    "algorithm.kl_ctrl.hold=0",  # beta moves from step 1, so its path in the summary is not one point
                    f"actor_rollout_ref.model.path={sft_dir}", f"trainer.default_local_dir={tmp_path}"])
    err = capfd.readouterr().err
    s = json.loads((tmp_path / "summary.json").read_text())
    rows = raw_rows(tmp_path)
    assert "run summary: finished (last logged step 6 of 6)" in err
    assert f"plot: python -m nanokl.harness.plot {tmp_path}" in err
    assert s["ended"] == "finished" and s["last_step"] == 6

    acc_key = "val-core/arith/acc/mean@1"
    vals = [(r["training/global_step"], r[acc_key]) for r in rows if acc_key in r]
    assert [v[0] for v in vals] == [0, 2, 4, 6]
    best = vals[0]
    for v in vals:
        if v[1] > best[1]:
            best = v
    a = s["accuracy"][acc_key]
    assert (a["first"], a["best"], a["last"], a["n"]) == (list(vals[0]), list(best), list(vals[-1]), 4)

    kl = [(r["training/global_step"], r["actor/reward_kl_penalty"]) for r in rows if "actor/reward_kl_penalty" in r]
    assert [k[0] for k in kl] == [1, 2, 3, 4, 5, 6]
    second = [v for step, v in kl if step > 3]  # steps 4-6: the second half of 6
    target = [r["actor/target_kl"] for r in rows if r["training/global_step"] > 3]
    k = s["kl"]
    assert (k["key"], k["from_step"], k["to_step"], k["n"]) == ("actor/reward_kl_penalty", 4, 6, 3)
    assert k["mean"] == pytest.approx(math.fsum(second) / 3, rel=1e-12)
    assert k["target_mean"] == pytest.approx(math.fsum(target) / 3, rel=1e-12)
    assert k["ratio"] == pytest.approx(k["mean"] / k["target_mean"], rel=1e-12)

    betas = [(r["training/global_step"], r["actor/reward_kl_penalty_coeff"]) for r in rows
             if "actor/reward_kl_penalty_coeff" in r]
    lo = hi = betas[0]
    for b in betas:
        lo, hi = (b if b[1] < lo[1] else lo), (b if b[1] > hi[1] else hi)
    b = s["beta"]
    assert (b["start"], b["min"], b["max"], b["end"]) == (list(betas[0]), list(lo), list(hi), list(betas[-1]))
    assert b["min"][1] < b["max"][1]  # the adaptive controller moved beta: the path is not one point

    events = {}
    for r in rows:
        for key, v in r.items():
            if key.startswith("monitor/action/"):
                name = key.split("/")[2]
                act = {1: "warn", 2: "adjust", 3: "rollback", 4: "stop"}[int(v)]
                events.setdefault(name, {}).setdefault(act, 0)
                events[name][act] += 1
        for key, v in r.items():
            name = key[len("monitor/"):-len("_fired")] if key.startswith("monitor/") and key.endswith("_fired") else None
            if name and v == 1 and f"monitor/action/{name}" not in r:
                events.setdefault(name, {}).setdefault("unknown", 0)
                events[name]["unknown"] += 1
    assert s["monitor_events"] == events
    assert sum(n for acts in events.values() for n in acts.values()) > 0  # KL starts below the band: kl_band fires

    assert s["ref_checks"] == {"run": 3, "failed": 0}  # steps 2, 4, 6

    pairs = []
    for (prev, _), (step, acc) in zip([(None, None)] + vals[:-1], vals):
        since = [v for st, v in kl if (prev is None or st > prev) and st <= step]
        if since:
            pairs.append([step, math.fsum(since) / len(since), acc])
    c = s["kl_accuracy"][acc_key]
    assert c["n"] == 3 and [p[0] for p in c["pairs"]] == [2, 4, 6]
    assert c["pairs"] == [[p[0], pytest.approx(p[1], rel=1e-12), p[2]] for p in pairs]
    accs = [p[2] for p in pairs]
    want = None if len(set(accs)) == 1 else statistics.correlation([p[1] for p in pairs], accs)
    assert c["pearson"] == (None if want is None else pytest.approx(want, rel=1e-9))

    (tmp_path / "summary.json").rename(tmp_path / "first.json")
    summary.main([str(tmp_path)])  # recomputed later from the files alone: the same summary
    again = json.loads((tmp_path / "summary.json").read_text())
    assert again == {**json.loads((tmp_path / "first.json").read_text()), "ended": None}


def rows_of(kls, vals):
    """Synthetic rows: KL at steps 1..len(kls), a validation accuracy at each step of `vals` {step: acc}."""
    rows = [{"training/global_step": s, **({"val-core/x/acc/mean@1": vals[s]} if s in vals else {})}
            for s in sorted(vals) if s == 0]
    for i, kl in enumerate(kls, start=1):
        rows.append({"training/global_step": i, "actor/reward_kl_penalty": kl,
                     **({"val-core/x/acc/mean@1": vals[i]} if i in vals else {})})
    return rows


def test_correlation_against_statistics():
    kls = [0.01, 0.03, 0.02, 0.05, 0.04, 0.06, 0.08, 0.07]
    vals = {0: 0.0, 2: 0.2, 4: 0.5, 6: 0.4, 8: 0.9}
    c = summary.summarize(rows_of(kls, vals))["kl_accuracy"]["val-core/x/acc/mean@1"]
    means = [(0.01 + 0.03) / 2, (0.02 + 0.05) / 2, (0.04 + 0.06) / 2, (0.08 + 0.07) / 2]
    assert c["n"] == 4  # step 0's validation has no training step before it
    assert [p[1] for p in c["pairs"]] == pytest.approx(means, rel=1e-12)
    assert c["pearson"] == pytest.approx(statistics.correlation(means, [0.2, 0.5, 0.4, 0.9]), rel=1e-12)
    lin = summary.summarize(rows_of(kls, {2: 1 - 3 * means[0], 4: 1 - 3 * means[1], 6: 1 - 3 * means[2]}))
    assert lin["kl_accuracy"]["val-core/x/acc/mean@1"]["pearson"] == pytest.approx(-1.0, abs=1e-12)


def test_edge_cases():
    none = summary.summarize(rows_of([0.01, 0.02, 0.03], {}))
    assert none["accuracy"] == {} and none["kl_accuracy"] == {}
    assert "no validation logged" in summary.format_text(none)
    one = summary.summarize(rows_of([0.01, 0.02, 0.03], {3: 0.5}))
    c = one["kl_accuracy"]["val-core/x/acc/mean@1"]
    assert (c["n"], c["pearson"]) == (1, None)
    assert one["accuracy"]["val-core/x/acc/mean@1"] == {"first": [3, 0.5], "best": [3, 0.5], "last": [3, 0.5], "n": 1}
    flat = summary.summarize(rows_of([0.02] * 6, {2: 0.1, 4: 0.3, 6: 0.2}))
    assert flat["kl_accuracy"]["val-core/x/acc/mean@1"]["pearson"] is None  # r undefined, not 0
    assert flat["kl"] == {"key": "actor/reward_kl_penalty", "from_step": 4, "to_step": 6, "n": 3,
                          "mean": pytest.approx(0.02, rel=1e-12), "target_key": None, "target_mean": None,
                          "ratio": None}
    odd = summary.summarize(rows_of([0.1, "nan", 0.3, 0.5, 0.7], {}))  # a NaN KL is logged as "nan"
    assert (odd["kl"]["n"], odd["kl"]["from_step"], odd["kl"]["mean"]) == (2, 4, pytest.approx(0.6))
    assert summary.summarize([])["kl"] is None


def test_events_by_check_and_action():
    rows = [{"training/global_step": 1, "monitor/kl_band_fired": 1.0, "monitor/action/kl_band": 1,
             "monitor/kl_stop_fired": 0.0},
            {"training/global_step": 2, "monitor/kl_band_fired": 1.0, "monitor/action/kl_band": 2,
             "monitor/kl_stop_fired": 1.0, "monitor/action/kl_stop": 4},
            {"training/global_step": 3, "monitor/kl_band_fired": 1.0, "monitor/entropy_fired": 0.0}]
    assert summary.summarize(rows)["monitor_events"] == {"kl_band": {"warn": 1, "adjust": 1, "unknown": 1},
                                                         "kl_stop": {"stop": 1}}

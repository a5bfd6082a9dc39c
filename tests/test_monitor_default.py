"""The KL checklist is on by default, warning only (issue 41, item 7): every run gets trainer.kl_monitor,
a verl command with no --config included; its warnings change no result, and acting stays opt-in.

- the defaults: enable true and every *_action "warn" (kl_stop_action's old default was "stop");
- a start-up line says the monitor is on, how to turn it off and how to make it act, once, only where
  neither the config file nor the command set trainer.kl_monitor.enable (the CPU demo's file sets it);
- a verl-style run (no --config, data files and a model given) logs monitor/* and the reference check,
  and every other metric equals the same run's with trainer.kl_monitor.enable=false, bit for bit;
- a run whose KL blows up goes on to its last step under the default (warnings only), and stops at the
  end of the streak when the command sets trainer.kl_monitor.kl_stop_action=stop (enable not given).
"""

import dataclasses
import json
from pathlib import Path

import pytest

from nanokl.harness.config.schema import KLMonitorConfig
from nanokl.harness.config.load import parse_cli
from nanokl.harness.config.notes import startup_notes
from nanokl.harness.tracking import read_metrics
from test_bad_input import train_cli
from test_monitor_runs import first_streak_end

ROOT = Path(__file__).resolve().parents[1]
NOTE = "note: trainer.kl_monitor (the KL checklist"


def verl_args(sft_dir, tmp_path, run_dir, *extra):
    """A verl-style command (no --config: verl's defaults) on 16 rows of small sums, CPU-sized."""
    rows = [{"data_source": "arith", "prompt": f"Q: {i % 10}+{3 * i % 10}=?\nA:",
             "reward_model": {"ground_truth": str(i % 10 + 3 * i % 10)}} for i in range(16)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [f"data.train_files={train}", f"actor_rollout_ref.model.path={sft_dir}", "data.train_batch_size=8",
            "data.max_prompt_length=24", "data.max_response_length=16", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "trainer.logger=[console,jsonl]",
            "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.device=cpu",
            f"trainer.default_local_dir={run_dir}", *extra]


def test_the_monitor_is_on_and_only_warns_by_default():
    c = KLMonitorConfig()
    actions = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name.endswith("_action")}
    assert c.enable and c.ref_check_freq == 10
    assert len(actions) >= 10 and set(actions.values()) == {"warn"}, actions


@pytest.mark.parametrize("argv, noted", [
    (["data.train_files=t.jsonl", "actor_rollout_ref.model.path=m"], True),  # a verl command: verl's defaults
    (["data.train_files=t.jsonl", "actor_rollout_ref.model.path=m", "trainer.kl_monitor.enable=true"], False),
    (["data.train_files=t.jsonl", "actor_rollout_ref.model.path=m", "trainer.kl_monitor.enable=false"], False),
    (["--config", str(ROOT / "configs" / "gsm8k_qwen2.5_0.5b.yaml")], True),  # a file that leaves it be
    ([], False),  # the CPU demo: configs/arith_tiny.yaml sets enable itself
    (["--config", str(ROOT / "configs" / "presets" / "conservative.yaml")], False),
    (["~trainer.kl_monitor.enable"], True),  # back to its default: on, by default
])
def test_the_startup_line_only_where_nobody_set_enable(argv, noted, capsys):
    cfg = parse_cli(argv)
    lines = [line for line in startup_notes(cfg) if line.startswith(NOTE)]
    assert len(lines) == int(noted), lines
    if noted:
        assert "on by default, in warn mode" in lines[0] and "changing no result" in lines[0]
        assert "trainer.kl_monitor.enable=false turns it off" in lines[0]
        assert "trainer.kl_monitor.kl_stop_action=stop" in lines[0]  # how to make it act
        assert "rechecks the reference every 10 steps" in lines[0]


def test_an_action_given_without_enable_is_named_in_the_line(capsys):
    cfg = parse_cli(["data.train_files=t.jsonl", "actor_rollout_ref.model.path=m",
                     "trainer.kl_monitor.kl_stop_action=stop"])
    (line,) = [line for line in startup_notes(cfg) if line.startswith(NOTE)]
    assert "acting where set (kl_stop_action=stop), warning elsewhere" in line


@pytest.mark.parametrize("kl", [[], ["algorithm.use_kl_in_reward=true", "actor_rollout_ref.actor.optim.lr=1e-3"]],
                         ids=["verl_defaults", "kl_in_reward"])  # verl's defaults have no KL: the KL checks skip
def test_a_verl_run_gets_the_checklist_and_its_metrics_are_unchanged(sft_dir, tmp_path, capfd, monkeypatch, kl):
    runs = {}
    for name, extra in (("default", []), ("off", ["trainer.kl_monitor.enable=false"])):
        code, err = train_cli(verl_args(sft_dir, tmp_path, tmp_path / name, "trainer.total_training_steps=10", *kl,
                                        *extra), capfd, monkeypatch)
        assert code == 0, err[-3000:]
        runs[name] = ([r for r in read_metrics(tmp_path / name) if "actor/pg_loss" in r], err)
    (on, err_on), (off, err_off) = runs["default"], runs["off"]
    if kl:  # the checks had something to say: warnings, and no action
        assert "kl_monitor step" in err_on and ": warn: " in err_on
        assert not any(h in ("adjust", "stop", "rollback") for h in (r["monitor/health"] for r in on))
    assert sum(line.startswith(NOTE) for line in err_on.splitlines()) == 1  # once
    assert NOTE not in err_off
    assert [r["training/global_step"] for r in on] == list(range(1, 11))
    assert all("monitor/health" in r for r in on) and not any(k.startswith("monitor/") for r in off for k in r)
    assert on[-1]["monitor/ref_consistent"] == 1.0  # the reference check ran at step 10 (ref_check_freq)
    for a, b in zip(on, off, strict=True):  # the warnings change nothing: every other metric bit-equal
        keys = {k for k in b if not k.startswith(("timing", "perf"))}
        assert keys <= set(a) and {k: a[k] for k in keys} == {k: b[k] for k in keys}


BLOW_UP = ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0", "actor_rollout_ref.actor.optim.lr=0.05",
           "trainer.total_training_steps=12", "trainer.kl_monitor.kl_stop_patience=2"]




def test_a_runaway_only_warns_by_default_and_stops_where_asked(sft_dir, tmp_path, capfd, monkeypatch):
    code, err = train_cli(verl_args(sft_dir, tmp_path, tmp_path / "warn", *BLOW_UP), capfd, monkeypatch)
    assert code == 0, err[-3000:]
    rows = [r for r in read_metrics(tmp_path / "warn") if "actor/pg_loss" in r]
    fired = first_streak_end(rows)
    assert fired is not None and fired < 12, "the blow-up run never crossed kl_stop twice in a row"
    assert len(rows) == 12 and f"kl_monitor step {fired}: warn: kl_stop" in err  # warned, went on
    code, err = train_cli(verl_args(sft_dir, tmp_path, tmp_path / "stop", *BLOW_UP,
                                "trainer.kl_monitor.kl_stop_action=stop"), capfd, monkeypatch)
    assert code == 0, err[-3000:]
    rows = [r for r in read_metrics(tmp_path / "stop") if "actor/pg_loss" in r]
    assert rows[-1]["training/global_step"] == fired == first_streak_end(rows)
    assert f"kl_monitor stopped the run at step {fired} (check: kl_stop)" in err

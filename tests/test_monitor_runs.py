"""The KL monitor acting on a real run (train_ppo.py) that is made to blow up.

A policy with a learning rate of 0.05 and no KL penalty (fixed beta = 0) leaves its reference in a
few steps: the per-token KL goes 0 -> ~0.2 -> ~1 (tests/test_monitor.py covers the checks on
scripted streams; here the trainer's response to them is tested).

- rollback: when KL > kl_stop for kl_stop_patience=2 steps, the run reloads the last healthy
  checkpoint (the forced step-0 one, i.e. the reference weights, so the next step measures a KL
  of exactly 0), raises beta from 0 to rollback_min_beta * rollback_beta_factor, and goes on; one
  rollback past max_rollbacks becomes a stop.
- stop: the run ends with exit status 0 at the first step whose streak reaches the patience, with
  a checkpoint of that step and a message naming the check.

Both run in this process and under torchrun with 2 gloo processes, with the same assertions: the
checks read metrics reduced over all ranks, so every rank takes the same action at the same step,
and the KL of exactly 0 after a rollback (a mean over both ranks' responses) shows that every rank
reloaded the weights.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train_ppo
from nanokl.harness.checkpoint import latest_checkpoint, load_state
from nanokl.harness.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[1]
BLOW_UP = ["data.num_train=64", "data.num_val=16", "data.train_batch_size=8", "data.max_response_length=32",
           "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
           "trainer.logger=[console,jsonl]", "trainer.test_freq=-1", "trainer.val_before_train=false",
           "algorithm.kl_ctrl.type=fixed", "algorithm.kl_ctrl.kl_coef=0", "actor_rollout_ref.actor.optim.lr=0.05",
           "trainer.kl_monitor.enable=true", "trainer.kl_monitor.kl_stop_patience=2", "trainer.device=cpu",
           "algorithm.adv_estimator=gae"]  # the step with a critic: rollback restores its weights and lr too


def first_streak_end(rows, threshold=0.2, patience=2):
    """The first step that ends `patience` consecutive steps with KL > threshold (independent of monitor.py)."""
    streak = 0
    for r in rows:
        streak = streak + 1 if r["actor/reward_kl_penalty"] > threshold else 0
        if streak == patience:
            return r["training/global_step"]
    return None


def blow_up(nproc, sft_dir, tmp_path, capfd, *extra):
    """(exit status, stderr) of the blow-up run: the CLI in this process, or torchrun with `nproc`."""
    argv = ["--config", str(ROOT / "configs" / "arith_tiny.yaml"), *BLOW_UP, f"actor_rollout_ref.model.path={sft_dir}",
            f"trainer.default_local_dir={tmp_path}", "trainer.total_training_steps=12", *extra]
    if nproc > 1:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc_per_node={nproc}", str(ROOT / "train_ppo.py"), *argv], capture_output=True,
                              text=True, cwd=ROOT, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return proc.returncode, proc.stderr
    capfd.readouterr()
    old, sys.argv = sys.argv, ["train_ppo.py", *argv]
    try:
        with pytest.raises(SystemExit) as exit_info:  # the command line's own exit path
            train_ppo.cli(train_ppo.main)
    finally:
        sys.argv = old
    return exit_info.value.code, capfd.readouterr().err


@pytest.mark.parametrize("nproc", [1, 2])
def test_rollback_reloads_the_healthy_checkpoint_and_raises_beta(sft_dir, tmp_path, capfd, nproc):
    code, err = blow_up(nproc, sft_dir, tmp_path, capfd, "trainer.save_freq=-1",
                        "trainer.kl_monitor.kl_stop_action=rollback", "trainer.kl_monitor.max_rollbacks=1",
                        "trainer.kl_monitor.rollback_min_beta=0.01")
    assert code == 0, err[-3000:]
    rows = [r for r in read_metrics(tmp_path) if "actor/reward_kl_penalty" in r]
    fired = first_streak_end(rows)
    assert fired is not None, "the blow-up run never crossed kl_stop twice in a row"
    at = {r["training/global_step"]: r for r in rows}
    assert at[fired]["monitor/health"] == "rollback" and at[fired]["monitor/rollbacks"] == 0
    assert f"rolled back to {tmp_path / 'global_step_0'}" in err
    after = at[fired + 1]
    assert after["monitor/rollbacks"] == 1
    assert after["actor/reward_kl_penalty_coeff"] == pytest.approx(0.02)  # max(0, 0.01) * factor 2
    assert all(r["actor/reward_kl_penalty_coeff"] == 0 for r in rows if r["training/global_step"] <= fired)
    # the rollout right after the rollback sampled from the reference weights again: KL exactly 0
    assert abs(after["actor/reward_kl_penalty"]) < 1e-6
    # the second time the streak completes, max_rollbacks=1 turns the rollback into a stop
    assert rows[-1]["monitor/health"] == "stop" and "max_rollbacks" in err


@pytest.mark.parametrize("nproc", [1, 2])
def test_stop_ends_cleanly_with_a_checkpoint_and_says_why(sft_dir, tmp_path, capfd, nproc):
    code, err = blow_up(nproc, sft_dir, tmp_path, capfd, "trainer.save_freq=2", "trainer.kl_monitor.kl_stop_action=stop")
    assert code == 0, err[-3000:]
    rows = [r for r in read_metrics(tmp_path) if "actor/reward_kl_penalty" in r]
    fired = first_streak_end(rows)
    assert fired is not None and rows[-1]["training/global_step"] == fired  # not a step before, none after
    assert latest_checkpoint(tmp_path).name == f"global_step_{fired}"
    assert f"kl_monitor stopped the run at step {fired} (check: kl_stop)" in err


def test_reference_recipe_reloads_the_reference_and_lowers_the_learning_rates(sft_dir, tmp_path, capfd):
    code, err = blow_up(1, sft_dir, tmp_path, capfd, "trainer.save_freq=1000",  # one checkpoint: the last step's
                        "trainer.kl_monitor.kl_stop_action=rollback", "trainer.kl_monitor.max_rollbacks=1",
                        "trainer.kl_monitor.rollback_recipe=reference", "trainer.kl_monitor.rollback_actor_lr=1e-5",
                        "trainer.kl_monitor.rollback_critic_lr=2e-4")
    assert code == 0, err[-3000:]
    rows = [r for r in read_metrics(tmp_path) if "actor/reward_kl_penalty" in r]
    fired = first_streak_end(rows)
    assert fired is not None
    at = {r["training/global_step"]: r for r in rows}
    assert "rolled back to the reference weights (reference)" in err
    assert all(at[s]["actor/lr"] == 0.05 for s in at if s <= fired)
    assert all(at[s]["actor/lr"] == 1e-5 for s in at if s > fired)  # the constant schedule times the new base lr
    assert abs(at[fired + 1]["actor/reward_kl_penalty"]) < 1e-6  # the actor sampled with the reference weights
    assert all(r["actor/reward_kl_penalty_coeff"] == 0 for r in rows)  # beta left as it was
    state = torch.load(latest_checkpoint(tmp_path) / "optim.pt", weights_only=True)
    assert [g["lr"] for g in state["actor"]["param_groups"]] == [1e-5]
    assert [g["lr"] for g in state["critic"]["param_groups"]] == [2e-4]


def test_fixed_kl_recipe_freezes_beta_and_arms_the_stop(sft_dir, tmp_path, capfd):
    code, err = blow_up(1, sft_dir, tmp_path, capfd, "trainer.save_freq=-1", "algorithm.kl_ctrl.type=adaptive",
                        "algorithm.kl_ctrl.kl_coef=0.001", "algorithm.kl_ctrl.target_kl=0.05",
                        "algorithm.kl_ctrl.horizon=640", "trainer.kl_monitor.kl_stop_action=rollback",
                        "trainer.kl_monitor.max_rollbacks=3", "trainer.kl_monitor.rollback_recipe=fixed_kl")
    assert code == 0, err[-3000:]
    rows = [r for r in read_metrics(tmp_path) if "actor/reward_kl_penalty" in r]
    fired = first_streak_end(rows)
    assert fired is not None
    at = {r["training/global_step"]: r for r in rows}
    coeffs = [at[s]["actor/reward_kl_penalty_coeff"] for s in sorted(at) if s <= fired]
    assert len(set(coeffs)) > 1  # adaptive before the rollback
    frozen = at[fired + 1]["actor/reward_kl_penalty_coeff"]  # beta as the fired step's update left it
    assert frozen > 0 and all(at[s]["actor/reward_kl_penalty_coeff"] == frozen for s in at if s > fired)
    assert abs(at[fired + 1]["actor/reward_kl_penalty"]) < 1e-6  # the healthy (step 0) weights again
    assert all(at[s]["actor/lr"] == 0.05 for s in at)  # the learning rate is left alone
    # the second runaway stops the run (the armed stop) although kl_stop_action says rollback and
    # max_rollbacks (3) is far away
    second = first_streak_end([r for r in rows if r["training/global_step"] > fired])
    assert second is not None and rows[-1]["training/global_step"] == second
    assert rows[-1]["monitor/health"] == "stop" and "armed by the fixed_kl rollback" in err
    _, state = load_state(latest_checkpoint(tmp_path))
    assert state["kl_ctrl"]["type"] == "fixed" and state["kl_ctrl"]["value"] == frozen
    assert state["monitor"]["stop_armed"] is True and state["monitor"]["rollbacks"] == 1


ADJUST = ["trainer.kl_monitor.kl_band_action=adjust", "trainer.kl_monitor.kl_stop=10",
          "trainer.kl_monitor.kl_high_adjust.cooldown=2", "algorithm.kl_ctrl.type=adaptive",
          "algorithm.kl_ctrl.kl_coef=0.001", "algorithm.kl_ctrl.horizon=640",
          "algorithm.kl_ctrl.target_kl=[[0, 0.1], [0.5, 0.03]]", "actor_rollout_ref.actor.optim.lr=0.01"]


def test_adjustments_and_the_schedule_survive_a_resume(sft_dir, tmp_path, capfd, monkeypatch):
    """A drifting run whose kl_high adjust raises beta: 8 steps straight, and the same run preempted
    (SIGTERM) during step 3 then resumed, give the same rows (every adjustment at the same step, with the
    same value) and the same final controller."""
    def go(out):
        return blow_up(1, sft_dir, out, capfd, *ADJUST, "trainer.total_training_steps=8", "trainer.save_freq=8")
    assert go(tmp_path / "a")[0] == 0
    monkeypatch.setenv("NANOKL_FAULT", "sigterm@3")
    code, err = go(tmp_path / "b")
    assert code == 0 and "preempted (SIGTERM): step 4 finished" in err
    monkeypatch.delenv("NANOKL_FAULT")
    assert go(tmp_path / "b")[0] == 0
    ra, rb = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    quiet = ("timing", "perf/throughput", "perf/time_per_step", "perf/cpu_memory", "perf/max_memory")
    assert [{k: v for k, v in r.items() if not k.startswith(quiet)} for r in ra] == \
        [{k: v for k, v in r.items() if not k.startswith(quiet)} for r in rb]
    steps = {r["training/global_step"]: r for r in ra if "actor/target_kl" in r}
    adjusted = [s for s, r in steps.items() if "monitor/adjust/kl_weight" in r]
    assert adjusted and any(s > 4 for s in adjusted), "the drift never crossed the band after the resume"
    for s, r in steps.items():  # the adjusted beta is what the next step used (before its own update)
        if "monitor/adjust/kl_weight" in r and s + 1 in steps:
            assert steps[s + 1]["actor/reward_kl_penalty_coeff"] == r["monitor/adjust/kl_weight"]
    # the schedule: 0.1 for steps 0-3 (fractions 0..0.375 of 8 steps), 0.03 after; no low-KL adjust scaled it
    assert [steps[s]["actor/target_kl"] for s in sorted(steps)] == [0.1 if s - 1 < 4 else 0.03 for s in sorted(steps)]
    assert load_state(latest_checkpoint(tmp_path / "a"))[1]["kl_ctrl"] == \
        load_state(latest_checkpoint(tmp_path / "b"))[1]["kl_ctrl"]

"""The reference-consistency check (nanokl/harness/ref_check.py) in real runs and on its own.

- planted: a run whose reference shares its parameters' memory with the actor (tied after setup's
  storage test, so only the probe can see it) stops at the first recheck after the actor's first
  update (step 1, ref_check_freq=1), with exit status 0, a checkpoint of that step, and one line
  naming shared storage; monitor/ref_consistent is 0 on that step.
- untouched: the same run without the tie passes every recheck (monitor/ref_consistent 1 on every
  step) and runs to its last step.
- at setup: a reference that *is* the actor stops the run before any step (exit status 1).
- diagnose, on hand-built models: shared storage, a parameter that requires grad, a parameter in an
  optimizer, train mode, and none of these.
"""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import train_ppo
from nanokl.harness import ref_check
from nanokl.harness import run as run_mod
from nanokl.harness.run_state import TrainingStopped
from nanokl.harness.tracking import read_metrics
from test_faults import run_cli

ROOT = Path(__file__).resolve().parents[1]
TINY = ["data.num_train=64", "data.num_val=16", "data.train_batch_size=8", "data.max_response_length=32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.logger=[jsonl]", "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1",
        "trainer.device=cpu", "trainer.kl_monitor.ref_check_freq=1"]


def cli(sft_dir, run_dir, capfd, steps=3):
    """(exit status, stderr) of train_ppo's command line in this process (test_faults.run_cli)."""
    return run_cli(["--config", str(ROOT / "configs" / "arith_tiny.yaml"), *TINY,
                    f"actor_rollout_ref.model.path={sft_dir}", f"trainer.default_local_dir={run_dir}",
                    f"trainer.total_training_steps={steps}"], capfd)


def tie_after_setup(monkeypatch):
    """Plant the bug after setup's storage test: the reference's tensors become the actor's memory, as a
    reference built from the actor's state dict without a copy would be (requires_grad stays False)."""
    real_setup = train_ppo.setup

    def setup(cfg, **kw):
        run = real_setup(cfg, **kw)
        actor = dict(run.actor.named_parameters())
        for name, p in run.ref.named_parameters():
            p.data = actor[name].data
        return run
    monkeypatch.setattr(train_ppo, "setup", setup)


def test_a_reference_sharing_the_actors_memory_stops_the_run_at_the_first_recheck(sft_dir, tmp_path, capfd,
                                                                                   monkeypatch):
    tie_after_setup(monkeypatch)
    code, err = cli(sft_dir, tmp_path, capfd)
    assert code == 0, err[-3000:]  # a clean stop, as the monitor's
    lines = re.findall(r"reference check stopped the run .*", err)
    assert len(lines) == 1, err[-3000:]
    # the probe was recorded before the tie, from equal weights: only the update of step 1 moves it
    assert "at step 1:" in lines[0] and "shares storage with the actor" in lines[0]
    assert f"checkpoint saved to {tmp_path / 'global_step_1'}" in lines[0]
    assert (tmp_path / "global_step_1").is_dir()
    rows = read_metrics(tmp_path)
    assert [r["training/global_step"] for r in rows] == [1] and rows[0]["monitor/ref_consistent"] == 0.0
    assert "run summary: reference check stop at step 1" in err


def test_an_untouched_reference_passes_every_recheck(sft_dir, tmp_path, capfd):
    code, err = cli(sft_dir, tmp_path, capfd)
    assert code == 0, err[-3000:]
    rows = read_metrics(tmp_path)
    assert [r["training/global_step"] for r in rows] == [1, 2, 3]
    assert [r["monitor/ref_consistent"] for r in rows] == [1.0, 1.0, 1.0]
    assert rows[-1]["actor/reward_kl_penalty"] != 0  # the actor did move: the checks compared something
    assert "reference check stopped" not in err and "reference checks: 3 run, 0 failed" in err


def test_a_reference_that_is_the_actor_stops_at_setup(sft_dir, tmp_path, capfd, monkeypatch):
    loaded = []
    real = run_mod.from_pretrained

    def same_model(path, **kw):  # the actor's load, then the reference's: the same module
        loaded.append(loaded[0] if loaded else real(path, **kw))
        return loaded[-1]
    monkeypatch.setattr(run_mod, "from_pretrained", same_model)
    code, err = cli(sft_dir, tmp_path, capfd)
    assert code == 1, err[-3000:]
    assert "error: reference check at setup: the reference shares storage with the actor" in err
    assert not (tmp_path / "metrics.jsonl").exists() or read_metrics(tmp_path) == []


def _models():
    torch.manual_seed(0)
    actor, ref = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    ref.eval().requires_grad_(False)
    opt = torch.optim.SGD(actor.parameters(), lr=0.1)
    return SimpleNamespace(actor=actor, ref=ref, rollout_model=actor, rollout_copy=False, critic=None,
                           actor_opt=opt, critic_opt=None)


def test_diagnose_names_each_cause():
    run = _models()
    assert ref_check.diagnose(run) is None
    ref_check.check_setup(run)  # nothing to say: no raise

    run = _models()
    run.ref.bias.data = run.actor.bias.data
    assert "shares storage with the actor (reference bias is actor bias)" in ref_check.diagnose(run)
    with pytest.raises(TrainingStopped, match="shares storage with the actor"):
        ref_check.check_setup(run)

    run = _models()
    run.ref.weight.requires_grad_(True)
    assert "reference parameter weight requires grad (1 do)" in ref_check.diagnose(run)

    run = _models()
    run.actor_opt.add_param_group({"params": [run.ref.bias]})
    assert "reference parameter bias sits in the actor's optimizer" in ref_check.diagnose(run)

    run = _models()
    run.ref.train()
    assert "train mode" in ref_check.diagnose(run)

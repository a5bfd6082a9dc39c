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
import subprocess
import sys
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


# ---------------------------------------------------------------------------------------------
# the recheck: the weights exactly (checksum), the outputs within what kernels guarantee
# ---------------------------------------------------------------------------------------------

def naive_checksum(model):
    """ref_check.checksum written out: Python integers over numpy's view of each parameter's bits, reduced
    modulo 2^64 into int64's range at the end."""
    import numpy as np
    plain = weighted = 0
    for p in model.parameters():
        flat = p.detach().reshape(-1)
        # numpy has no bfloat16: torch reinterprets the bits, numpy and Python do the sums
        bits = flat.view({2: torch.int16, 4: torch.int32}[flat.element_size()]).numpy().astype(np.int64).tolist()
        for i, b in enumerate(bits):
            plain += b
            weighted += b * (i % 65521 + 1)
    wrap = lambda v: (v + 2 ** 63) % 2 ** 64 - 2 ** 63  # noqa: E731
    return [wrap(plain), wrap(weighted)]


def test_checksum_equals_a_naive_loop_and_sees_one_ulp_and_a_swap(monkeypatch):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3).to(torch.bfloat16))
    monkeypatch.setattr(ref_check, "_CHUNK", 8)  # several chunks per parameter, as a large embedding has
    assert ref_check.checksum(model).tolist() == naive_checksum(model)
    before = ref_check.checksum(model)
    w = model[0].weight.data
    w[2, 3] = torch.nextafter(w[2, 3], torch.tensor(1.0))  # one ulp
    assert not torch.equal(ref_check.checksum(model), before)
    w[2, 3] = torch.nextafter(w[2, 3], torch.tensor(-1.0))
    assert torch.equal(ref_check.checksum(model), before)
    w[0, 0], w[1, 1] = w[1, 1].clone(), w[0, 0].clone()  # the plain sum cannot see a swap; the weighted one does
    assert not torch.equal(ref_check.checksum(model), before)


@pytest.fixture
def probe_run(sft_dir, tmp_path):
    """A set-up run (no step taken) with the reference's probe recorded at setup."""
    from nanokl.harness.config.load import parse_cli
    from nanokl.harness.run import setup
    run = setup(parse_cli(["--config", str(ROOT / "configs" / "arith_tiny.yaml"), *TINY,
                           f"actor_rollout_ref.model.path={sft_dir}", f"trainer.default_local_dir={tmp_path}"]))
    assert run.ref_probe is not None and run.ref_probe[1] is not None
    return run


def test_the_recheck_stays_quiet_under_load_and_another_thread_count(probe_run):
    """The false alarm seen on a busy 2-core node: the same reference, rechecked while other processes spin
    and with another intra-op thread count than the record's, is not stopped; and the log-probs' last bits
    (here moved by 1e-6, the size of a float32 sum split another way) are not what the check compares."""
    threads = torch.get_num_threads()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            metrics = {}
            assert ref_check.recheck(probe_run, 10, metrics) is None
            assert metrics["monitor/ref_consistent"] == 1.0 and metrics["monitor/ref_logp_diff"] < 1e-4
    finally:
        for p in busy:
            p.kill()
        torch.set_num_threads(threads)
    summed, batch, recorded = probe_run.ref_probe
    probe_run.ref_probe = summed, batch, recorded + 1e-6 * torch.randn_like(recorded)
    assert ref_check.recheck(probe_run, 10, {}) is None  # bit-for-bit would have stopped this healthy run


def test_the_recheck_stops_on_an_in_place_write_a_hook_and_a_reference_in_the_optimizer(probe_run):
    ref = probe_run.ref
    p = next(ref.parameters())
    keep = p.data.clone()
    with torch.no_grad():
        p.view(-1)[5] = torch.nextafter(p.view(-1)[5], torch.tensor(1.0))  # one ulp of one weight
    metrics = {}
    line = ref_check.recheck(probe_run, 10, metrics)
    assert metrics["monitor/ref_consistent"] == 0.0
    assert "checksum differs" in line and "changed by something outside the trainer" in line, line
    assert metrics["monitor/ref_logp_diff"] < 1e-4  # an ulp the probe's outputs do not show: the checksum does
    p.data.copy_(keep)
    assert ref_check.recheck(probe_run, 10, {}) is None  # restored, it passes again

    probe_run.actor_opt.add_param_group({"params": [p], "lr": 1e-12})  # a reference trained by mistake
    with torch.no_grad():
        p.add_(1e-12 * torch.ones_like(p))  # what that optimizer's tiny step does to it
    line = ref_check.recheck(probe_run, 10, {})
    assert "checksum differs" in line and "sits in the actor's optimizer" in line, line
    probe_run.actor_opt.param_groups.pop()
    p.data.copy_(keep)

    # a hook on the last norm (the fused head reads its output): weights untouched, outputs not
    hook = ref.model.norm.register_forward_hook(lambda mod, args, out: out * 1.1)
    try:
        metrics = {}
        line = ref_check.recheck(probe_run, 10, metrics)
        assert "moved by up to" in line and "parameters unchanged" in line, line
        assert metrics["monitor/ref_logp_diff"] > 1e-4
    finally:
        hook.remove()

"""Data parallelism on CPU: gloo processes spawned by torchrun from pytest.

- One PPO update (critic, then actor; 2 epochs) on a fixed batch of 8 responses: 2 processes with
  DDP or FSDP2, each on 4 responses, end with the parameters of 1 process on all 8
  (max |delta| <= 1e-5 fp32) and log the same metrics (tests/dist_worker.py does the update).
  The `budget` variant packs micro-batches under a token budget chosen so that the two ranks need
  different micro-batch counts, which exercises the agreed count and the masked filler row.
- FSDP2 under `torchrun --nproc_per_node=1` joins a process group and really shards: its
  parameters are DTensors on a 1-rank mesh, and the update equals the unwrapped one.
- FSDP2's collectives, counted inside the processes (check_collectives): at world size 1 the
  gradients of the micro-batches of a mini-batch (4) are reduced once per unit per optimizer step
  (shard.no_sync), 3 a step, not 3 per micro-batch; over 2 processes each micro-batch (2, or 4 in
  the `budget` case) reduce-scatters; at world size 1 no unit reshards after forward (one gather per unit - torch 2.13
  copies and casts a 1-rank shard - for a no-grad pass over 4 micro-batches, against 9 with
  resharding), except with offloaded shards.
- FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over 2 processes against
  one process computing in bf16 from fp32 masters through casts (tests/dist_worker.py).
- CPU offload (shard.wrap's CPUOffloadPolicy; shard.offload_optimizer's state between steps): the
  FSDP2 update with either equals the one without (<= 1e-6) and the 1-process one, the shards and
  the optimizer state sit on CPU, and - since on a CPU-only box everything does - every FSDP2
  module's param group carries the CPUOffloadPolicy (absent without offload), so a flag that never
  reached `fully_shard` fails; the optimizer-only mode has its step hooks. The rollout-sync and
  checkpoint checks run offloaded too. What the fsdp_config keys do per strategy (the notes for
  none / ddp / fsdp2 without torchrun) is checked in-process.
- After the update and after a no-grad forward, the rollout copy holds the updated weights;
  a checkpoint restored by run._restore over 2 processes continues exactly like the
  uninterrupted run, and rank 1 never opens optim.pt or the weights (its loaders raise).
- `torchrun train_ppo.py` on the default config (ddp over 2 processes, fsdp2 over 1) writes one
  metrics file and one checkpoint, and a single process resumes from that checkpoint.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanokl.harness.checkpoint import latest_checkpoint
from nanokl.harness.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")


def torchrun(*args, nproc=2, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The 1-process updates on the whole batch (no process group), one per worker REFERENCES entry."""
    out = tmp_path_factory.mktemp("ref")
    subprocess.run([sys.executable, str(ROOT / "tests" / "dist_worker.py"), "--reference", str(out)],
                   check=True, cwd=ROOT, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return {p.stem: torch.load(p) for p in out.glob("*.pt")}


def max_diff(a, b, keys=None):
    return max((a[k] - b[k]).abs().max().item() for k in (keys or a))


# bf16 tolerance. With untied embeddings the 2-process FSDP2 bf16 update and the 1-process cast
# reference agree bit for bit (same micro-batch shapes, so the same bf16 GEMMs; Adam's m/sqrt(v)
# hides the fp32 order of summing micro-batch gradients). With tied embeddings (Qwen2.5's, and the
# worker's) FSDP2 sums the embedding's and lm_head's gradient contributions in bf16 (one unsharded
# bf16 parameter) where the reference casts each to fp32 first: measured 4.7e-4 after two Adam
# steps at lr 3e-3 (eps 1e-6). 1e-3 leaves a 2x margin; the result must also be > 4x closer to the
# bf16 reference than to the fp32 one (measured 13x: 4.7e-4 vs 6.1e-3), so a policy that silently
# computed in fp32 fails.
BF16_TOL = 1e-3


@pytest.mark.parametrize("strategy,spec,mode,nproc,dtypes,checks,offloads", [
    ("ddp", "fixed", "token-mean", 2, "float32", True, "none"),
    ("fsdp2", "fixed", "token-mean", 2, "float32,bfloat16", True, "none,params,optimizer"),
    ("ddp", "budget", "seq-mean-token-mean", 2, "float32", False, "none"),
    ("fsdp2", "budget", "seq-mean-token-mean", 2, "float32", False, "none"),
    ("fsdp2", "fixed", "token-mean", 1, "float32", False, "none,params"),  # torchrun at world size 1 still shards
])
def test_processes_match_one(reference, tmp_path, strategy, spec, mode, nproc, dtypes, checks, offloads):
    out = tmp_path / "w.pt"
    torchrun(str(ROOT / "tests" / "dist_worker.py"), "--strategy", strategy, "--spec", spec, "--mode", mode,
             "--param-dtypes", dtypes, "--offloads", offloads, *(["--checks"] if checks else []), "--out", str(out),
             nproc=nproc)
    results = torch.load(out)
    for (dtype, offload), got in results.items():
        if strategy == "fsdp2":
            check_offload(got, offload, results[(dtype, "none")])
            check_collectives(got["collectives"], nproc, spec, offload)
        bf16 = dtype == "bfloat16"
        ref = reference[mode + ("-bf16" if bf16 else "")]
        assert got["world"] == nproc
        assert ref["params"].keys() == got["params"].keys()
        moved = max_diff(ref["params"], got["params"])
        assert moved <= (BF16_TOL if bf16 else 1e-5), f"{strategy}/{spec}/{dtype}: parameters differ by {moved:.2e}"
        # the update really moved the weights (lr 3e-3), so matching them is not trivially true
        assert min((ref["params"][k] - ref["init"][k]).abs().max().item() for k in ref["params"]) > 1e-4
        if strategy == "fsdp2":  # sharded even at world size 1: every parameter a DTensor on an nproc mesh
            assert all(got["dtensor"]) and got["mesh"] == nproc
        if bf16:  # the policy really computed in bf16: far closer to the bf16 reference than to the fp32 one
            assert max_diff(reference[mode]["params"], got["params"]) > 4 * moved
        else:
            assert ref["metrics"].keys() == got["metrics"].keys()
            for k, v in ref["metrics"].items():
                assert got["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
        if checks:
            actor = [k for k in got["params"] if k.startswith("actor.")]
            # the rollout copy holds the fp32 masters right after the update and right after a no-grad
            # forward (FSDP2 then leaves the root gathered in bf16: a sync that read those is 2e-3 off)
            assert max_diff(got["params"], got["rollout_after_update"], actor) == 0
            assert max_diff(got["params"], got["rollout_after_forward"], actor) == 0
            # the checkpoint restored into fresh models over 2 processes (rank 0 reads, broadcasts)
            assert max_diff(got["params"], got["restored_rollout"], actor) == 0
            assert max_diff(got["straight"], got["params"]) > 1e-4  # the second update moved them
            assert max_diff(got["straight"], got["resumed"]) == 0  # and resuming changed nothing
            assert got["replica_spread"] == 0  # rank 1's replica agrees (DDP: rank 0 alone is saved)
            assert got["guarded_ranks"] == nproc - 1  # rank 1 ran with its loaders booby-trapped


def check_collectives(c, nproc, spec, offload):
    """At world size 1 FSDP2's gradient reduction happens once per unit per optimizer step, in the last
    micro-batch (shard.no_sync; over 2 ranks once per micro-batch), and at world size 1 the units stay gathered from a forward to the next backward
    (shard.wrap's reshard_after_forward=False) unless their shards are offloaded."""
    units, layers = 3, 2  # the two decoder layers and the root
    # the critic's 2 epochs, then the actor's, each one mini-batch of several micro-batches
    assert len(c["steps"]) == 4
    for step in c["steps"]:
        assert step["micro_batches"] == (4 if nproc == 1 or spec == "budget" else 2)
        # at world size 1 one reduction (a copy) per unit, not one per micro-batch; with 2 ranks each
        # micro-batch reduce-scatters (accumulating unsharded would hold 4 bytes/parameter per rank)
        per_step = units if nproc == 1 else units * step["micro_batches"]
        assert step["reductions"] == per_step, c["steps"]
        assert step["reduce_scatters"] == (per_step if nproc > 1 else 0), c["steps"]
    keep = nproc == 1 and offload != "params"
    # FSDP2's default for several ranks (and offloaded shards): the layers reshard, the root does not
    assert c["reshard_after_forward"] == ([False] * units if keep else [False] + [True] * layers)  # root first
    # a no-grad pass over K micro-batches gathers (at world size 1: copies and casts) each unit once
    # when nothing reshards after forward; else the root once and each layer at every micro-batch
    k = c["no_grad_micro_batches"]
    assert k >= 2
    assert c["no_grad_gathers"] == (units if keep else 1 + layers * k)
    assert set(c["gathered_after_forward"]) == {keep}  # the layers' gathered copies stay registered...
    assert set(c["gathered_in_no_sync"]) == {False}  # ...until a micro-batch starts: resharded on entry


def check_offload(got, offload, plain):
    """The offloaded update is the plain one, and the offload really reached FSDP2 / the optimizer."""
    if offload != "none":
        moved = max_diff(plain["params"], got["params"])
        assert moved <= 1e-6, f"offload={offload}: parameters differ from the plain FSDP2 update by {moved:.2e}"
    for role, r in got["offload"].items():
        assert r["fsdp_groups"] == 3  # the two decoder layers and the root
        # every FSDP2 param group holds the CPUOffloadPolicy and offloads each of its parameters, or none does
        assert r["policy"] == [offload == "params"] * 3, (role, offload, r["policy"])
        assert set(r["offload_to_cpu"]) == {offload == "params"}
        assert r["step_hooks"] == ((1, 1) if offload == "optimizer" else (0, 0))
        if offload == "params":  # (on a GPU box the plain run's would say cuda)
            assert r["param_devices"] == ["cpu"]
        if offload != "none":
            assert r["state_devices"] == ["cpu"]


def test_offload_keys_by_strategy(monkeypatch, capsys):
    """fsdp_config's offload keys: a note and nothing with none / ddp / fsdp2 without torchrun; under
    torchrun with fsdp2, param_offload -> the policy (and a note: the optimizer state follows the
    shards), optimizer_offload alone -> the state between steps, both -> the policy alone."""
    from types import SimpleNamespace as NS
    from nanokl.engine import dist, shard
    cpu, cuda, key = torch.device("cpu"), torch.device("cuda"), "actor_rollout_ref.actor"
    both, params = NS(param_offload=True, optimizer_offload=True), NS(param_offload=True, optimizer_offload=False)
    state = NS(param_offload=False, optimizer_offload=True)
    assert shard.offload_setting(key, "fsdp2", cuda, NS(param_offload=False, optimizer_offload=False)) == (False, False)
    for strategy, why in (("none", "strategy=none"), ("ddp", "strategy=ddp"), ("fsdp2", "without torchrun")):
        assert shard.offload_setting(key, strategy, cuda, both) == (False, False)
        err = capsys.readouterr().err
        keys = f"{key}.fsdp_config.param_offload / {key}.fsdp_config.optimizer_offload"
        assert err.count("\n") == 1 and why in err and keys in err
    monkeypatch.setattr(dist, "active", lambda: True)
    monkeypatch.setattr(dist, "rank", lambda: 0)
    assert shard.offload_setting(key, "fsdp2", cuda, params) == (True, False)
    assert "optimizer state lives on CPU too" in capsys.readouterr().err
    assert shard.offload_setting(key, "fsdp2", cuda, state) == (False, True)
    assert shard.offload_setting(key, "fsdp2", cuda, both) == (True, False)
    assert shard.offload_setting(key, "fsdp2", cuda, state, trainable=False) == (False, False)  # a frozen reference
    assert capsys.readouterr().err == ""
    assert shard.offload_setting(key, "fsdp2", cpu, params) == (True, False)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "optimizer state lives on CPU too" in err and "nothing moves" in err
    assert shard.offload_setting(key, "fsdp2", cpu, params, trainable=False) == (True, False)
    assert "optimizer" not in capsys.readouterr().err  # a frozen model has no optimizer state to speak of


def test_optimizer_offload_moves_the_state_around_each_step(monkeypatch):
    """shard.offload_optimizer: the same steps as without it; before each step the state goes to the
    parameters' device, after it to the CPU (recorded: on a CPU-only box both are the CPU), and a
    loaded state is sent back to the CPU. Adam's 0-dim step count is left where torch keeps it."""
    from nanokl.engine import shard
    moves = []
    real = shard._move_state
    monkeypatch.setattr(shard, "_move_state", lambda opt, home: (moves.append(home), real(opt, home))[1])

    def train(offload):
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        if offload:
            shard.offload_optimizer(opt)
        for _ in range(2):
            m(torch.randn(5, 4)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        return m, opt

    (plain, _), (m, opt) = train(False), train(True)
    assert moves == [True, False, True, False]
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), m.parameters()))
    state = opt.state[m.weight]
    assert state["exp_avg"].device.type == "cpu" and state["step"].dim() == 0
    shard.load_optimizer_state(m, opt, shard.optimizer_state(m, opt))
    assert moves[-1] is False


TINY = ["data.num_train=64", "data.num_val=16", "data.train_batch_size=8", "data.max_response_length=32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.logger=[jsonl]", "trainer.test_freq=3",
        "algorithm.adv_estimator=gae"]  # the step with a critic: its weights, optimizer and resume too


# ddp over 2 processes; fsdp2 over 1, as the one-GPU check runs it (a process group, sharded, a rollout copy).
# Both set fsdp_config's offload keys: fsdp2 offloads the actor's and the reference's shards and the
# critic's optimizer state (nanokl/engine/shard.py), ddp says in one line that it has nothing to offload
OFFLOAD = ["actor_rollout_ref.actor.fsdp_config.param_offload=true", "actor_rollout_ref.ref.fsdp_config.param_offload=true",
           "critic.model.fsdp_config.optimizer_offload=true"]


@pytest.mark.parametrize("strategy,nproc", [("ddp", 2), ("fsdp2", 1)])
def test_torchrun_train_ppo_then_resume_with_one_process(sft_dir, tmp_path, capfd, strategy, nproc):
    import train_ppo
    args = ["--config", str(ROOT / "configs" / "arith_tiny.yaml"), *TINY, f"actor_rollout_ref.model.path={sft_dir}",
            f"sft.output_dir={sft_dir}", f"trainer.default_local_dir={tmp_path}",
            f"actor_rollout_ref.actor.strategy={strategy}", *OFFLOAD]
    proc = torchrun(str(ROOT / "train_ppo.py"), *args, "trainer.total_training_steps=3", "trainer.save_freq=3",
                    nproc=nproc)
    notes = [line for line in proc.stderr.splitlines() if re.match(r"note: [\w.]+\.fsdp_config\.\w+_offload[ :]", line)]
    if strategy == "ddp":  # rank 0 alone says it, once per model
        assert len(notes) == 3 and all("nothing to offload with strategy=ddp" in n for n in notes), notes
    else:  # on CPU the policy and the hooks are applied but nothing moves; the actor's state follows its shards
        assert len(notes) == 3 and all("nothing moves" in n for n in notes), notes
        assert sum("optimizer state lives on CPU too" in n for n in notes) == 1
    rows = read_metrics(tmp_path)
    assert [r["training/global_step"] for r in rows] == [0, 1, 2, 3]  # one set: only rank 0 logs
    assert sorted(p.name for p in tmp_path.glob("global_step_*") if p.is_dir()) == ["global_step_3"]
    assert latest_checkpoint(tmp_path).name == "global_step_3"
    # 8 prompts x n responses over the ranks; throughput is per process
    assert rows[1]["perf/total_num_tokens"] > 0 and "actor/pg_loss" in rows[1]
    # rollout sampled from the current weights: with fsdp2 that is the rollout copy refreshed from
    # the shards after every update (so the old log-probs are recomputed: no bypass), and a stale
    # copy would show up here as a large difference. A CPU ddp replica is its own sampler and may
    # skip that forward (bypass): then there is no difference to log
    diffs = [r["rollout/log_prob_max_diff"] for r in rows[1:] if "rollout/log_prob_max_diff" in r]
    if strategy == "fsdp2":
        assert len(diffs) == 3
    assert max(diffs, default=0.0) < 1e-4
    # resume in this process (no process group) from the torchrun checkpoint and run one more step
    train_ppo.main([*args, "trainer.total_training_steps=4", "trainer.save_freq=4"])
    assert f"resumed from {tmp_path / 'global_step_3'} at step 3" in capfd.readouterr().err
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 5  # steps 0-3 from torchrun, step 4 from the resumed process: nothing re-run
    rows = read_metrics(tmp_path)
    assert [r["training/global_step"] for r in rows] == [0, 1, 2, 3, 4]
    assert latest_checkpoint(tmp_path).name == "global_step_4"
    assert all(v == v for v in rows[-1].values())  # finite, no NaN


def test_strategy_none_refuses_two_processes(sft_dir, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train_ppo.py"), *TINY, f"actor_rollout_ref.model.path={sft_dir}",
           f"trainer.default_local_dir={tmp_path}", "actor_rollout_ref.actor.strategy=none"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode != 0
    assert "actor_rollout_ref.actor.strategy=none" in proc.stderr and "ddp or fsdp2" in proc.stderr

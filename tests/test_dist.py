"""Data parallelism on CPU: 2 gloo processes spawned by torchrun from pytest.

- One PPO update (critic, then actor; 2 epochs) on a fixed batch of 8 responses: 2 processes with
  DDP or FSDP2, each on 4 responses, end with the parameters of 1 process on all 8
  (max |delta| <= 1e-5 fp32) and log the same metrics (tests/dist_worker.py does the update).
  The `budget` variant packs micro-batches under a token budget chosen so that the two ranks need
  different micro-batch counts, which exercises the agreed count and the masked filler row.
- `torchrun --nproc_per_node=2 train_ppo.py` on the default config writes one metrics file and
  one checkpoint, and a single process resumes from that checkpoint.
"""

import os
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
    """The 1-process update on the whole batch, for each loss_agg_mode the cases use."""
    out = {}
    for mode in ("token-mean", "seq-mean-token-mean"):
        path = tmp_path_factory.mktemp("ref") / f"{mode}.pt"
        subprocess.run([sys.executable, str(ROOT / "tests" / "dist_worker.py"), "--mode", mode, "--out", str(path)],
                       check=True, cwd=ROOT, timeout=300)
        out[mode] = torch.load(path)
    return out


@pytest.mark.parametrize("strategy,spec,mode", [
    ("ddp", "fixed", "token-mean"),
    ("fsdp2", "fixed", "token-mean"),
    ("ddp", "budget", "seq-mean-token-mean"),
    ("fsdp2", "budget", "seq-mean-token-mean"),
])
def test_two_processes_match_one(reference, tmp_path, strategy, spec, mode):
    out = tmp_path / "w2.pt"
    torchrun(str(ROOT / "tests" / "dist_worker.py"), "--strategy", strategy, "--spec", spec, "--mode", mode,
             "--out", str(out))
    ref, got = reference[mode], torch.load(out)
    assert ref["params"].keys() == got["params"].keys()
    moved = max((ref["params"][k] - got["params"][k]).abs().max().item() for k in ref["params"])
    assert moved <= 1e-5, f"{strategy}/{spec}: parameters differ by {moved:.2e}"
    # the update really moved the weights (lr 3e-3), so matching them is not trivially true
    assert min((ref["params"][k] - ref["init"][k]).abs().max().item() for k in ref["params"]) > 1e-4
    assert ref["metrics"].keys() == got["metrics"].keys()
    for k, v in ref["metrics"].items():
        assert got["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


TINY = ["data.num_train=64", "data.num_val=16", "data.train_batch_size=8", "data.max_response_length=32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.logger=[jsonl]", "trainer.test_freq=3"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_torchrun_train_ppo_then_resume_with_one_process(sft_dir, tmp_path, capfd, strategy):
    import train_ppo
    args = ["--config", str(ROOT / "configs" / "arith_tiny.yaml"), *TINY, f"actor_rollout_ref.model.path={sft_dir}",
            f"sft.output_dir={sft_dir}", f"trainer.default_local_dir={tmp_path}",
            f"actor_rollout_ref.actor.strategy={strategy}"]
    torchrun(str(ROOT / "train_ppo.py"), *args, "trainer.total_training_steps=3", "trainer.save_freq=3")
    rows = read_metrics(tmp_path)
    assert [r["training/global_step"] for r in rows] == [0, 1, 2, 3]  # one set: only rank 0 logs
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()) == ["global_step_3"]
    assert latest_checkpoint(tmp_path).name == "global_step_3"
    # 16 prompt rows over 2 ranks of 4 prompts x n responses; throughput is per process
    assert rows[1]["perf/total_num_tokens"] > 0 and "actor/pg_loss" in rows[1]
    # rollout sampled from the current weights: with fsdp2 that is the rollout copy refreshed from
    # the shards after every update, so a stale copy would show up here as a large difference
    assert max(r["rollout/log_prob_max_diff"] for r in rows[1:]) < 1e-4
    # resume in this process (world size 1) from the 2-process checkpoint and run one more step
    train_ppo.main([*args, "trainer.total_training_steps=4", "trainer.save_freq=4"])
    assert f"resumed from {tmp_path / 'checkpoints' / 'global_step_3'} at step 3" in capfd.readouterr().err
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

"""The tiny train_ppo.py run that CLI tests drive (arith_tiny cut to 8 prompts a step, no validation),
and a launcher for it as a new process, plain or under torchrun: shared by tests/test_cluster.py,
test_lora_train.py and test_model_merger.py."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY_BASE = ["--config", str(ROOT / "configs" / "arith_tiny.yaml"), "data.num_train=64", "data.num_val=16",
             "data.train_batch_size=8", "data.max_response_length=32",
             "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
             "trainer.logger=[jsonl]", "trainer.test_freq=-1", "trainer.val_before_train=false"]


def launch(argv, fault=None, nproc=None, script=None):
    """train_ppo.py (or `script`) with `argv` in a new process, plain or under torchrun with `nproc` processes;
    NANOKL_FAULT=fault (nanokl/harness/faults.py) when given."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("NANOKL_FAULT", None)
    if fault:
        env["NANOKL_FAULT"] = fault
    head = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
                               if nproc else [])
    program = str(script) if script else str(ROOT / "train_ppo.py")
    return subprocess.run([*head, program, *map(str, argv)], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=600)

"""What a shared cluster does to a run, reproduced on the CPU (issue 47): each test drives train_ppo.py as an
operator would (plain python, or torchrun with 2 gloo processes) and checks that no work is lost and no run
trains on settings other than the ones it was given.

- ranks started with different settings (a batch size, a learning rate) stop at start, every rank, one line
  naming each key and each rank's value (exit 2);
- signals come in pairs (scancel signals every process, torchrun's agent forwards its own): a repeat within
  trainer.signal_grace_s does not cut the save; after the window it kills; SIGHUP is a preemption too;
- a rank that hangs ends the job within actor_rollout_ref.nccl_timeout, with one line;
- a folder whose every checkpoint is damaged refuses to start over (exit 2) unless resume_mode=disable;
- resume_from_path under resume_mode=auto: used when the folder has no checkpoint, refused when it is not one;
- a training file changed between a stop and its resume is refused, naming the file.
"""

import hashlib
import json
import signal
import textwrap
from pathlib import Path

import pytest

from nanokl.harness.checkpoint import latest_checkpoint, verify_checkpoint
from nanokl.harness.faults import ECHO_S, kills_now
from nanokl.harness.fingerprint import data_hashes, differences
from tiny_runs import ROOT, TINY_BASE, launch

TINY = [*TINY_BASE, "trainer.total_training_steps=4", "trainer.save_freq=-1"]


def args(sft_dir, run_dir, *extra):
    return [*TINY, f"actor_rollout_ref.model.path={sft_dir}", f"trainer.default_local_dir={run_dir}", *extra]


def steps_logged(run_dir):
    return [json.loads(line)["training/global_step"] for line in open(Path(run_dir) / "metrics.jsonl")]


def errors(stderr):
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# ---------------------------------------------------------------------------------------------
# ranks that disagree
# ---------------------------------------------------------------------------------------------

def test_differences_names_each_key_with_each_ranks_value():
    prints = [{"a": 1, "b": [1, 2], "c": "x"}, {"a": 1, "b": [1, 3], "c": "x"}, {"a": 2, "b": [1, 2]}]
    assert differences(prints) == ["a (ranks 0,1: 1, rank 2: 2)", "b (ranks 0,2: [1,2], rank 1: [1,3])",
                                   "c (ranks 0,1: x, rank 2: <unset>)"]
    assert differences([{"a": 1}, {"a": 1}]) == []


def test_data_hashes_are_each_files_sha256_and_a_directory_follows_its_files(tmp_path):
    train, val = tmp_path / "train.jsonl", tmp_path / "parts"
    train.write_bytes(b'{"q": 1}\n')
    (val / "sub").mkdir(parents=True)
    (val / "a.parquet").write_bytes(b"A")
    (val / "sub" / "b.parquet").write_bytes(b"B")
    got = data_hashes({"data.train_files": str(train), "data.val_files": [str(val), str(tmp_path / "absent")],
                       "data.offline_files": None})
    assert got[str(train)] == hashlib.sha256(b'{"q": 1}\n').hexdigest() and len(got) == 2
    before = got[str(val)]
    (val / "sub" / "b.parquet").write_bytes(b"C")  # one file under the directory changes: its hash does
    assert data_hashes({"data.val_files": str(val)})[str(val)] != before


WITH_RANK_KEYS = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    extra = {extra!r}.get(os.environ.get("RANK", "0"), [])  # this rank's own keys: a launcher's mistake
    sys.argv = ["train_ppo.py", *sys.argv[1:], *extra]
    import train_ppo
    train_ppo.cli(train_ppo.main)
""")


@pytest.mark.parametrize("extra, named", [
    ({"1": ["data.train_batch_size=16"]}, "data.train_batch_size (rank 0: 8, rank 1: 16)"),
    pytest.param({"0": ["actor_rollout_ref.actor.optim.lr=1e-5"]}, "actor_rollout_ref.actor.optim.lr (rank 0: 1e-05, "
                 "rank 1: ", marks=pytest.mark.slow),
])
def test_ranks_started_with_different_settings_stop_at_start_naming_them(sft_dir, tmp_path, extra, named):
    script = tmp_path / "launcher.py"
    script.write_text(WITH_RANK_KEYS.format(root=str(ROOT), extra=extra))
    proc = launch(args(sft_dir, tmp_path / "run"), nproc=2, script=script)
    assert proc.returncode != 0
    lines = errors(proc.stderr)
    assert len(lines) == 2 and lines[0] == lines[1], proc.stderr[-3000:]  # every rank, the same line
    assert "the 2 ranks were started with different settings" in lines[0] and named in lines[0]
    assert "Traceback (most recent call last):\n  File \"/" not in proc.stderr.split("torch.distributed")[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained


# ---------------------------------------------------------------------------------------------
# signals
# ---------------------------------------------------------------------------------------------

def test_which_repeated_signal_kills_at_once():
    INT, TERM = signal.SIGINT, signal.SIGTERM
    # (waited since the first, signal, grace, typed at a terminal) -> kills
    cases = [(0.001, TERM, 30, False, False), (29.0, TERM, 30, True, False), (31.0, TERM, 30, False, True),
             (0.001, INT, 30, True, False),  # a forwarded copy of a typed Ctrl-C comes at once
             (ECHO_S + 0.1, INT, 30, True, True), (ECHO_S + 0.1, INT, 30, False, False), (0.5, INT, 0, False, True)]
    for waited, sig, grace, terminal, kills in cases:
        assert kills_now(100.0, 100.0 + waited, sig, grace, terminal) is kills, (waited, sig, grace, terminal)


def test_a_repeated_sigterm_within_the_grace_window_lets_the_step_finish_and_save(sft_dir, tmp_path):
    proc = launch(args(sft_dir, tmp_path), fault="sigterm@1,sigterm@1")  # scancel's and its echo, together
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = tmp_path / "global_step_2"
    assert f"preempted (SIGTERM): step 2 finished and checkpoint saved to {ckpt}" in proc.stderr
    assert verify_checkpoint(ckpt) is None and steps_logged(tmp_path) == [1, 2]


def test_after_the_grace_window_a_repeat_kills_at_once(sft_dir, tmp_path):
    proc = launch(args(sft_dir, tmp_path, "trainer.signal_grace_s=0"), fault="sigterm@1,sigterm@1")
    assert proc.returncode == -signal.SIGTERM
    assert latest_checkpoint(tmp_path) is None


def test_sighup_is_a_preemption(sft_dir, tmp_path):
    proc = launch(args(sft_dir, tmp_path), fault="sighup@1")  # the terminal closed
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"preempted (SIGHUP): step 2 finished and checkpoint saved to {tmp_path / 'global_step_2'}" in proc.stderr


def test_scancel_under_torchrun_saves_the_step_and_the_same_command_resumes(sft_dir, tmp_path):
    argv = args(sft_dir, tmp_path)
    # each rank signals itself and the agent, which forwards SIGTERM to both: every rank sees it twice or more
    first = launch(argv, fault="scancel@1:0,scancel@1:1", nproc=2)
    ckpt = tmp_path / "global_step_2"
    assert verify_checkpoint(ckpt) is None, first.stderr[-3000:]
    assert steps_logged(tmp_path) == [1, 2]
    again = launch(argv, nproc=2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpt} at step 2" in again.stderr and steps_logged(tmp_path) == [1, 2, 3, 4]


# ---------------------------------------------------------------------------------------------
# a frozen rank
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow  # in `pytest -m slow` (the default suite stays near 8 min on 2 cores)
def test_a_hung_rank_ends_the_job_within_nccl_timeout_in_one_line(sft_dir, tmp_path):
    proc = launch(args(sft_dir, tmp_path, "actor_rollout_ref.nccl_timeout=5"), fault="hang@1:1", nproc=2)
    assert proc.returncode != 0  # ended, well before gloo's 30 minutes (the subprocess timeout is 600 s)
    lines = errors(proc.stderr)
    assert lines and "actor_rollout_ref.nccl_timeout=5" in lines[0], proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# resume
# ---------------------------------------------------------------------------------------------

def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_folder_whose_every_checkpoint_is_damaged_refuses_to_start_over(sft_dir, tmp_path):
    first = launch(args(sft_dir, tmp_path, "trainer.total_training_steps=2", "trainer.save_freq=2"))
    assert first.returncode == 0, first.stderr[-3000:]
    flip_a_byte(tmp_path / "global_step_2" / "actor" / "model.safetensors")
    again = launch(args(sft_dir, tmp_path))
    assert again.returncode == 2, again.stderr[-3000:]
    assert "checkpoint global_step_2 skipped" in again.stderr
    [line] = errors(again.stderr)
    assert "every checkpoint is damaged" in line and "trainer.resume_mode=disable" in line
    assert steps_logged(tmp_path) == [1, 2]  # the folder as it was: nothing set aside, nothing trained
    over = launch(args(sft_dir, tmp_path, "trainer.resume_mode=disable"))  # said on purpose
    assert over.returncode == 0, over.stderr[-3000:]
    assert steps_logged(tmp_path) == [1, 2, 3, 4] and (tmp_path / "checkpoints.1" / "global_step_2").is_dir()


@pytest.mark.slow  # in `pytest -m slow` (the default suite stays under ~8 min on 2 cores)
def test_resume_from_path_under_auto_is_used_or_refused(sft_dir, tmp_path):
    src = tmp_path / "src"
    first = launch(args(sft_dir, src, "trainer.total_training_steps=2", "trainer.save_freq=2"))
    assert first.returncode == 0, first.stderr[-3000:]
    used = launch(args(sft_dir, tmp_path / "run", f"trainer.resume_from_path={src / 'global_step_2'}"))
    assert used.returncode == 0, used.stderr[-3000:]
    assert "trainer.resume_from_path is set under resume_mode=auto" in used.stderr
    assert f"resumed from {src / 'global_step_2'} at step 2" in used.stderr
    assert steps_logged(tmp_path / "run") == [3, 4]
    refused = launch(args(sft_dir, tmp_path / "other", f"trainer.resume_from_path={src}"))  # the run, not a checkpoint
    assert refused.returncode == 2
    [line] = errors(refused.stderr)
    assert f"trainer.resume_from_path={src} does not verify" in line


@pytest.mark.slow  # in `pytest -m slow` (the default suite stays under ~8 min on 2 cores)
def test_a_training_file_changed_before_the_resume_is_refused_naming_it(sft_dir, tmp_path):
    rows = [json.dumps({"data_source": "aime24", "prompt": f"Q: {i}+{i}=?", "reward_model": {"ground_truth": str(2 * i)}})
            for i in range(16)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(r + "\n" for r in rows))
    keys = ["data.task=null", f"data.train_files={data}", f"data.val_files={data}"]
    first = launch(args(sft_dir, tmp_path / "run", *keys, "trainer.total_training_steps=2", "trainer.save_freq=2"))
    assert first.returncode == 0, first.stderr[-3000:]
    data.write_text("".join(r + "\n" for r in rows[:15]))  # a row removed: every later batch differs
    again = launch(args(sft_dir, tmp_path / "run", *keys))
    assert again.returncode == 2, again.stderr[-3000:]
    [line] = errors(again.stderr)
    assert f"data ({data} sha256 " in line and "resume_allow_changes=[data]" in line
    allowed = launch(args(sft_dir, tmp_path / "run", *keys, "trainer.resume_allow_changes=[data]"))
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert steps_logged(tmp_path / "run") == [1, 2, 3, 4]

"""A run's files are ordinary files, and a folder that stops taking them ends the run in one line
(issue 47, item 8).

- the umask: every file of a run (config.yaml, metrics.jsonl, summary.json, each checkpoint's weights,
  tokenizer, optimizer, run.json, manifest) is 0o666 less the umask and every folder 0o777 less it, as
  open() and mkdir() make them: 0o644 / 0o755 under umask 022, 0o600 / 0o700 under 077. safetensors
  >= 0.8 wrote the weights 0o600 whatever the umask (nanokl/harness/hf_format.py file_mode);
- a folder made read-only during the run, after its last step was logged: with trainer.save_freq=-1
  (verl's default; the last write is summary.json) and with a checkpoint at the last step (its commit,
  the rename of global_step_N.tmp, is refused), the run ends with exit 1 and one line naming the folder
  and what it refused, no traceback; the lock is released (emptied, when the read-only folder will not
  let it be deleted), and the same command, once the folder is writable again, runs.

The read-only folder is made twice. For real: train_ppo.py as a user types it, with a reward function
that chmods the folder 555 on its last call; root writes into such a folder anyway, so as root the
command runs under `setpriv` without the capabilities that let it (CAP_DAC_OVERRIDE and
CAP_DAC_READ_SEARCH: root then obeys the permission bits like anyone). And simulated in this process,
for both final writes: each Python call that adds, removes or renames an entry of the run folder
itself (not of its subfolders) raises EACCES (PermissionError), as the kernel does.
"""

import builtins
import errno
import fcntl
import io
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import nanokl.harness.tracking as tracking
from nanokl.harness.checkpoint import latest_checkpoint, verify_checkpoint
from test_bad_input import one_error, train_cli
from test_faults import rows

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
TINY = ["--config", str(ROOT / "configs" / "arith_tiny.yaml"), "data.num_train=64", "data.num_val=16",
        "data.train_batch_size=8", "data.max_response_length=32", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.logger=[jsonl]", "trainer.test_freq=-1",
        "trainer.val_before_train=false", f"trainer.total_training_steps={STEPS}"]


def args(sft_dir, run_dir, *extra):
    return [*TINY, f"actor_rollout_ref.model.path={sft_dir}", f"trainer.default_local_dir={run_dir}", *extra]


@pytest.mark.parametrize("umask,file_mode,dir_mode", [(0o022, 0o644, 0o755), (0o002, 0o664, 0o775),
                                                      (0o077, 0o600, 0o700)], ids=["022", "002", "077"])
def test_every_file_of_a_run_follows_the_umask(sft_dir, tmp_path, capfd, monkeypatch, umask, file_mode, dir_mode):
    run_dir = tmp_path / "run"
    old = os.umask(umask)
    try:
        code, err = train_cli(args(sft_dir, run_dir, "trainer.save_freq=2"), capfd, monkeypatch)
    finally:
        os.umask(old)
    assert code == 0, err[-3000:]
    ckpt = latest_checkpoint(run_dir)
    assert ckpt == run_dir / f"global_step_{STEPS}" and (ckpt / "actor" / "model.safetensors").is_file()
    wrong = []
    for path in [run_dir, *run_dir.rglob("*")]:
        mode, want = stat.S_IMODE(path.stat().st_mode), dir_mode if path.is_dir() else file_mode
        if mode != want:
            wrong.append(f"{path.relative_to(tmp_path)} {mode:#o}")
    assert not wrong, f"not {file_mode:#o} / {dir_mode:#o} under umask {umask:#o}: {wrong}"


def read_only_after_the_last_row(run_dir, monkeypatch):
    """From the moment the last step's row is logged, `run_dir` refuses new entries, deletions and renames
    of its own entries (EACCES), as a chmod 555 folder does; returns the switch that makes it writable again."""
    state = {"read_only": False, "armed": True}
    real_log = tracking.Tracker.log

    def log(self, metrics, step):
        real_log(self, metrics, step)
        state["read_only"] = state["read_only"] or (state["armed"] and step == STEPS)
    monkeypatch.setattr(tracking.Tracker, "log", log)

    def here(path):
        return state["read_only"] and os.path.dirname(os.path.abspath(os.fsdecode(path))) == str(run_dir)

    def refuse(path):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))

    real = {name: getattr(os, name) for name in ("open", "mkdir", "unlink", "remove", "rmdir", "replace", "rename")}
    real_open = builtins.open

    def open_(file, mode="r", *a, **kw):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+") and here(file) \
                and not os.path.exists(file):
            refuse(file)
        return real_open(file, mode, *a, **kw)

    def os_open(path, flags, *a, **kw):
        if flags & os.O_CREAT and here(path) and not os.path.exists(path) and kw.get("dir_fd") is None:
            refuse(path)
        return real["open"](path, flags, *a, **kw)

    def entry(name):
        def call(path, *a, **kw):
            if kw.get("dir_fd") is None and here(path):
                refuse(path)
            return real[name](path, *a, **kw)
        return call

    def move(name):
        def call(src, dst, *a, **kw):
            for p in (src, dst):
                if here(p):
                    refuse(p)
            return real[name](src, dst, *a, **kw)
        return call
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(io, "open", open_)  # pathlib's write_text
    monkeypatch.setattr(os, "open", os_open)
    for name in ("mkdir", "unlink", "remove", "rmdir"):
        monkeypatch.setattr(os, name, entry(name))
    for name in ("replace", "rename"):
        monkeypatch.setattr(os, name, move(name))
    return lambda: state.update(read_only=False, armed=False)


@pytest.mark.parametrize("save_freq,refused", [(-1, "summary.json"), (2, f"global_step_{STEPS}.tmp")])
def test_a_folder_made_read_only_ends_the_run_in_one_line_and_frees_the_lock(
        sft_dir, tmp_path, capfd, monkeypatch, save_freq, refused):
    run_dir = tmp_path / "run"
    argv = args(sft_dir, run_dir, f"trainer.save_freq={save_freq}")
    writable_again = read_only_after_the_last_row(run_dir, monkeypatch)
    code, err = train_cli(argv, capfd, monkeypatch)
    assert code == 1, err[-3000:]
    line = one_error(err)  # one line, no traceback
    assert str(run_dir) in line and refused in line and "Permission denied" in line, line
    assert [r["training/global_step"] for r in rows(run_dir)] == list(range(1, STEPS + 1))  # every step logged
    if save_freq > 0:  # the checkpoint before the refused one is the newest, whole
        assert latest_checkpoint(run_dir) == run_dir / "global_step_2"
        assert verify_checkpoint(run_dir / "global_step_2") is None
    lock = run_dir / ".lock"  # the read-only folder keeps the file: emptied, and nobody holds it
    assert not lock.exists() or lock.read_text() == ""
    if lock.exists():
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError while a run holds it
            fcntl.flock(f, fcntl.LOCK_UN)
    writable_again()
    code, err = train_cli(argv, capfd, monkeypatch)
    assert code == 0 and "in use by another run" not in err and "took over the lock" not in err, err[-3000:]
    assert latest_checkpoint(run_dir) == (run_dir / f"global_step_{STEPS}" if save_freq > 0 else None)


CHMOD_ON_LAST_CALL = f"""
import os
CALLS = [0]
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    CALLS[0] += 1
    if CALLS[0] == 8 * {STEPS} and os.environ.get("READ_ONLY_AT_END"):  # 8 responses a step
        os.chmod(os.environ["READ_ONLY_AT_END"], 0o555)
    return float(solution_str.strip().endswith("#### " + ground_truth))
"""


def obeying_permissions() -> list[str]:
    """The command prefix under which this process's children obey permission bits: none for a user; for
    root, setpriv dropping the two capabilities that let root read and write past them."""
    if os.geteuid() != 0:
        return []
    head = [shutil.which("setpriv") or "setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    try:
        subprocess.run([*head, "true"], check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("running as root without a working setpriv: a chmod 555 folder would not stop root")
    return head


@pytest.mark.slow  # in `pytest -m slow` (the default suite stays under ~8 min on 2 cores)
def test_a_folder_chmod_555_at_the_end_of_a_run_is_one_line_and_a_free_lock(sft_dir, tmp_path):
    run_dir = tmp_path / "run"
    fn = tmp_path / "reward.py"
    fn.write_text(CHMOD_ON_LAST_CALL)
    cmd = [*obeying_permissions(), sys.executable, str(ROOT / "train_ppo.py"),
           *args(sft_dir, run_dir, "trainer.save_freq=-1", f"custom_reward_function.path={fn}")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "READ_ONLY_AT_END": str(run_dir)}
    read_only = False
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    finally:
        if run_dir.is_dir():
            read_only = stat.S_IMODE(run_dir.stat().st_mode) == 0o555
            run_dir.chmod(0o755)  # the user restores the permissions (and pytest can clean up)
    assert read_only, "the reward function did not make the folder read-only"
    assert done.returncode == 1, done.stderr[-3000:]
    line = one_error(done.stderr)
    assert line == f"error: {run_dir}: cannot write summary.json (Permission denied); the run stopped there", line
    assert [r["training/global_step"] for r in rows(run_dir)] == list(range(1, STEPS + 1))
    lock = run_dir / ".lock"  # left behind by a folder that refused its deletion: empty, held by nobody
    assert lock.exists() and lock.read_text() == ""
    env.pop("READ_ONLY_AT_END")
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "in use by another run" not in again.stderr and "took over the lock" not in again.stderr
    assert (run_dir / "summary.json").is_file() and not lock.exists()

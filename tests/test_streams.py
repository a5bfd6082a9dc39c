"""Output that nobody reads never stops training (issue 47, item 3; nanokl/harness/streams.py).

train_ppo.py as a user types it, its stdout or stderr broken after the first line (`| head -1`, a dead
`tee`, a terminal gone) or closed from the start (`>&-`, `2>&-`): the run ends with status 0, every step
in metrics.jsonl, its last checkpoint written and verified, and (where stderr can still be read) not a
word about the dead stream. Under verl's console logger (trainer.logger=['console']: verl's line on
stdout each step) and verl's default save_freq=-1 this used to lose the whole run at step 1 or 2.
Then the guard itself: a Python exit that flushes a broken stdout (status 120 unguarded), and tqdm's
bars through a dead stream.
"""

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tqdm import tqdm

from nanokl.harness.checkpoint import latest_checkpoint, verify_checkpoint
from nanokl.harness.streams import Guarded, guard
from test_faults import rows

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
TINY = ["--config", str(ROOT / "configs" / "arith_tiny.yaml"), "data.num_train=64", "data.num_val=16",
        "data.train_batch_size=8", "data.max_response_length=32", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.test_freq=-1",
        "trainer.val_before_train=false", f"trainer.total_training_steps={STEPS}"]
VERL_CONSOLE = "trainer.logger=['console']"  # verl's line on stdout every step
SHORT_CONSOLE = "trainer.logger=['console','jsonl']"  # nanokl's short line on stderr, beside the bar
SILENT = ("Traceback", "Exception ignored", "BrokenPipe", "Errno")
# as a user's shell has it: stdout block-buffered into a pipe, so that Python's exit flushes what is left
ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, "OMP_NUM_THREADS": "1"}


def command(sft_dir, run_dir, *extra):
    return [sys.executable, str(ROOT / "train_ppo.py"), *TINY, f"actor_rollout_ref.model.path={sft_dir}",
            f"trainer.default_local_dir={run_dir}", *extra]


def broken_after_first_line(argv, which, err_file):
    """Run argv with `which` (stdout or stderr) a pipe whose reader leaves after stdout's first line
    ("config: ...", which comes with step 1's flush) or stderr's first byte (the bar); its status."""
    pipe = {which: subprocess.PIPE}
    if which == "stdout":
        pipe["stderr"] = err_file
    else:
        pipe["stdout"] = subprocess.DEVNULL
    proc = subprocess.Popen(argv, cwd=ROOT, env=ENV, **pipe)
    reader = getattr(proc, which)
    first = reader.readline() if which == "stdout" else reader.read(1)
    reader.close()  # `head -1` exits: every later write gets EPIPE
    assert first and proc.poll() is None, "the run did not outlive its reader: nothing was tested"
    return proc.wait(timeout=600)


def closed_from_the_start(argv, which, err_file):
    """Run argv with `which` closed before Python starts, as `>&-` / `2>&-` in the shell do; its status."""
    redirect = ">&-" if which == "stdout" else "2>&-"
    sh = ["sh", "-c", f'exec "$@" {redirect}', "sh", *argv]
    other = {"stderr": err_file} if which == "stdout" else {"stdout": subprocess.DEVNULL}
    return subprocess.run(sh, cwd=ROOT, env=ENV, timeout=600, **other).returncode


@pytest.mark.parametrize("which,how,logger,save_freq", [
    pytest.param("stdout", broken_after_first_line, VERL_CONSOLE, 2, marks=pytest.mark.slow),
    ("stdout", broken_after_first_line, VERL_CONSOLE, -1),  # verl's defaults: no checkpoint to fall back on
    pytest.param("stdout", closed_from_the_start, VERL_CONSOLE, 2, marks=pytest.mark.slow),
    pytest.param("stderr", broken_after_first_line, SHORT_CONSOLE, 2, marks=pytest.mark.slow),
    ("stderr", closed_from_the_start, SHORT_CONSOLE, 2),
], ids=["stdout_pipe", "stdout_pipe_verl_defaults", "stdout_closed", "stderr_pipe", "stderr_closed"])
def test_a_dead_console_does_not_stop_the_run(sft_dir, tmp_path, which, how, logger, save_freq):
    run_dir = tmp_path / "run"
    err = tmp_path / "stderr.txt"
    with open(err, "wb") as err_file:
        status = how(command(sft_dir, run_dir, logger, f"trainer.save_freq={save_freq}"), which, err_file)
    said = err.read_text(errors="replace")
    assert status == 0, said[-3000:]
    assert [r["training/global_step"] for r in rows(run_dir)] == list(range(1, STEPS + 1)), said[-3000:]
    assert (run_dir / "summary.json").is_file() and not (run_dir / ".lock").exists()
    if save_freq > 0:
        last = latest_checkpoint(run_dir)
        assert last == run_dir / f"global_step_{STEPS}" and verify_checkpoint(last) is None
    else:
        assert latest_checkpoint(run_dir) is None  # save_freq=-1 writes none, as verl
    if which == "stdout":  # stderr still reads: nothing about the dead stdout on it
        assert not any(word in said for word in SILENT), said[-3000:]
        assert "ppo: 100%" in said  # the bar went on to the end


EXIT_FLUSH = """
import sys
from nanokl.harness.streams import guard
if sys.argv[1] == "guarded":
    guard()
print("first", flush=True)
sys.stdin.read()  # until the parent has closed its end of stdout
print("left in the buffer at exit")
"""


@pytest.mark.parametrize("guarded", [False, True])
def test_python_exit_flushing_a_broken_stdout_is_silent_and_status_0(guarded):
    proc = subprocess.Popen([sys.executable, "-c", EXIT_FLUSH, "guarded" if guarded else "bare"], cwd=ROOT, env=ENV,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline() == b"first\n"
    proc.stdout.close()
    _, err = proc.communicate(b"", timeout=60)
    if guarded:
        assert (proc.returncode, err) == (0, b"")
    else:  # Python's own behaviour, which the guard undoes
        assert proc.returncode == 120 and b"BrokenPipeError" in err


def test_tqdm_bars_and_writes_through_a_dead_stream(monkeypatch):
    r, w = os.pipe()
    stream = io.TextIOWrapper(io.FileIO(w, "w"), write_through=True)
    monkeypatch.setattr(sys, "stderr", Guarded(stream))
    os.close(r)  # the reader is gone
    bar = tqdm(range(3), desc="ppo", mininterval=0)  # no file=: tqdm takes sys.stderr now, the guard
    for i in bar:
        tqdm.write(f"step {i}", file=sys.stderr)
    bar.close()
    assert sys.stderr.dead and os.readlink(f"/proc/self/fd/{w}") == os.devnull
    stream.close()
    closed = Guarded(io.StringIO())
    closed.stream.close()
    assert closed.write("x") == 1 and closed.flush() is None and closed.dead  # ValueError: closed file


def test_guard_wraps_once_and_passes_other_errors_on(monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    guard()
    first = sys.stdout
    guard()
    assert isinstance(first, Guarded) and sys.stdout is first and isinstance(sys.stderr, Guarded)
    print("kept", file=sys.stdout)
    assert first.stream.getvalue() == "kept\n"

    class Full(io.StringIO):
        def write(self, s):
            raise OSError(28, "No space left on device")
    with pytest.raises(OSError):  # a full disk under `> log` is not a reader gone: not swallowed
        Guarded(Full()).write("x")

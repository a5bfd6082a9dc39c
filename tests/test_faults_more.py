"""Faults that stop a run cleanly and keep its work (issue 39, item 8), each on a tiny run:

- a custom reward function that raises, or returns nan / inf, in step 4: one line naming the function, the
  row's data_source and index, a checkpoint of the 3 steps done, exit 1; the same command with the function
  fixed resumes at step 3, re-runs the failed step and ends bit-identical to a run that never failed; under
  torchrun a function failing on one rank stops both after a checkpoint, the failing rank saying why;
- a checkpoint write that fails with safetensors' own error (SafetensorError, what a full disk or a quota
  gives its writer) or a quota's OSError: one line, no global_step_N.tmp left, the previous checkpoint intact;
- Ctrl-C (SIGINT) is a preemption: the step finishes, a checkpoint is written, exit 130; the same command
  resumes and ends bit-identical to the uninterrupted run; a second Ctrl-C typed at the terminal kills at once
  (tests/test_cluster.py: repeats that are not typed); Ctrl-C before the
  first step is one line and exit 130, not a traceback;
- generate.py refuses an empty prompt, an empty prompts file and --n 0 in one line (exit 2);
- a read-only (or impossible) output folder is one line at start, for train_ppo.py and generate.py.
"""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import generate
import train_ppo
from nanokl.harness.checkpoint import latest_checkpoint, load_state, verify_checkpoint
from nanokl.harness.config.yaml_io import run_cli
from nanokl.harness.reward_fn import load_custom

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", str(ROOT / "configs" / "arith_tiny.yaml"), "data.num_train=64", "data.num_val=16",
        "data.train_batch_size=8", "data.max_response_length=32", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.logger=[jsonl]", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.total_training_steps=5", "trainer.save_freq=5"]  # the last step only
def args(sft_dir, run_dir, *extra):
    return [*TINY, f"actor_rollout_ref.model.path={sft_dir}", f"trainer.default_local_dir={run_dir}", *extra]


from test_bad_input import one_error, train_cli as cli  # noqa: E402  (train_ppo.py's CLI in this process)
from test_faults import rows, same_run  # noqa: E402


# ---------------------------------------------------------------------------------------------
# a reward function that raises or is not finite
# ---------------------------------------------------------------------------------------------

# the arithmetic rule, by hand; FAULT replaces it on the 3rd response of the 4th step (call 27 of 8 a step)
REWARD = '''
CALLS = [0]
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    CALLS[0] += 1
    if CALLS[0] == 27:
        FAULT
    return float(solution_str.strip().endswith("#### " + ground_truth))
'''


@pytest.fixture(scope="module")
def straight_custom(sft_dir, tmp_path_factory):
    """5 steps scored by the healthy function, never interrupted."""
    tmp = tmp_path_factory.mktemp("straight_custom")
    fn = tmp / "reward.py"
    fn.write_text(REWARD.replace("FAULT", "pass"))
    train_ppo.main(args(sft_dir, tmp / "run", f"custom_reward_function.path={fn}"))
    return tmp / "run"


@pytest.mark.parametrize("fault,said", [("raise ZeroDivisionError('the grader broke')",
                                         "ZeroDivisionError: the grader broke"),
                                        ("return float('nan')", "nan"), ("return -float('inf')", "-inf")])
def test_a_failing_reward_function_saves_the_steps_done_and_exits_1_naming_it(
        sft_dir, straight_custom, tmp_path, capfd, monkeypatch, fault, said):
    fn = tmp_path / "reward.py"
    fn.write_text(REWARD.replace("FAULT", fault))
    argv = args(sft_dir, tmp_path / "run", f"custom_reward_function.path={fn}")
    code, err = cli(argv, capfd, monkeypatch)
    assert code == 1, err[-3000:]
    line = one_error(err)
    assert "compute_score" in line and str(fn) in line and "'arith'" in line and "response 2" in line, line
    assert said in line and "step 4" in line, line
    ckpt = tmp_path / "run" / "global_step_3"  # the 3 steps done; step 4 left no trace
    assert f"checkpoint saved to {ckpt}" in line, line
    assert verify_checkpoint(ckpt) is None and latest_checkpoint(tmp_path / "run") == ckpt
    assert load_state(ckpt)[1]["global_step"] == 3
    assert [r["training/global_step"] for r in rows(tmp_path / "run")] == [1, 2, 3]
    # fixed, the same command resumes at step 3 and re-runs step 4 exactly as a run that never failed
    fn.write_text(REWARD.replace("FAULT", "pass"))
    load_custom.cache_clear()
    code, err = cli(argv, capfd, monkeypatch)
    assert code == 0, err[-3000:]
    assert f"resumed from {ckpt} at step 3" in err
    same_run(straight_custom, tmp_path / "run")


def test_a_failing_rule_in_the_first_step_saves_step_0(sft_dir, tmp_path, capfd, monkeypatch):
    fn = tmp_path / "reward.py"
    fn.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  "    raise KeyError('gold')\n")
    code, err = cli(args(sft_dir, tmp_path / "run", f"custom_reward_function.path={fn}"), capfd, monkeypatch)
    assert code == 1
    line = one_error(err)
    assert "KeyError: 'gold'" in line and "response 0" in line and "step 1" in line, line
    assert load_state(latest_checkpoint(tmp_path / "run"))[1]["global_step"] == 0


def test_under_torchrun_a_reward_failing_on_one_rank_stops_both_with_a_checkpoint(sft_dir, tmp_path):
    fn = tmp_path / "reward.py"  # rank 1 only, on its 4th response of step 3 (4 responses a rank a step)
    fn.write_text(REWARD.replace("CALLS[0] == 27", "CALLS[0] == 12 and __import__('os').environ['RANK'] == '1'")
                  .replace("FAULT", "raise ValueError('rank 1 broke')"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("NANOKL_FAULT", None)
    argv = args(sft_dir, tmp_path / "run", f"custom_reward_function.path={fn}")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(ROOT / "train_ppo.py"), *argv], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=600)
    # torchrun itself prints a traceback for a worker's exit 1 (ChildFailedError); none comes from a worker
    assert proc.returncode != 0 and 'train_ppo.py", line' not in proc.stderr, proc.stderr[-3000:]
    ckpt = tmp_path / "run" / "global_step_2"
    assert "rank 1: custom_reward_function compute_score" in proc.stderr and "ValueError: rank 1 broke" in proc.stderr
    assert (f"error: stopped in step 3: the reward function failed on another rank (its stderr says how); "
            f"checkpoint saved to {ckpt}") in proc.stderr, proc.stderr[-3000:]
    assert verify_checkpoint(ckpt) is None and load_state(ckpt)[1]["global_step"] == 2


# ---------------------------------------------------------------------------------------------
# a checkpoint that cannot be written
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["safetensors", "quota"])
def test_a_checkpoint_write_error_is_one_line_and_leaves_no_tmp(sft_dir, tmp_path, capfd, monkeypatch, how):
    import nanokl.harness.checkpoint as ckpt_mod
    from safetensors import SafetensorError
    real = ckpt_mod.save_pretrained

    def writer(model, path, *a, **kw):
        real(model, path, *a, **kw)
        if "global_step_4" in str(path):
            if how == "safetensors":
                raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                      'message: "No space left on device" })')
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(path / "model.safetensors"))
    monkeypatch.setattr(ckpt_mod, "save_pretrained", writer)
    code, err = cli(args(sft_dir, tmp_path, "trainer.save_freq=2"), capfd, monkeypatch)
    assert code == 1
    line = one_error(err)
    assert f"checkpoint not written to {tmp_path / 'global_step_4.tmp'}" in line, line
    assert ("No space left on device" if how == "safetensors" else "quota") in line, line
    assert "previous checkpoint is untouched" in line
    good = tmp_path / "global_step_2"
    assert verify_checkpoint(good) is None and latest_checkpoint(tmp_path) == good
    assert sorted(p.name for p in tmp_path.glob("global_step_*") if p.is_dir()) == ["global_step_2"]


# ---------------------------------------------------------------------------------------------
# Ctrl-C
# ---------------------------------------------------------------------------------------------

def launch(script_or_argv, *argv):
    """A new python process: train_ppo.py with `argv`, or a script with `argv` as sys.argv[1:]."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("NANOKL_FAULT", None)
    head = [sys.executable, "-c", script_or_argv] if isinstance(script_or_argv, str) else \
        [sys.executable, str(ROOT / "train_ppo.py"), *script_or_argv]
    return subprocess.run([*head, *map(str, argv)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


# train_ppo.py, but Ctrl-C arrives while step 2 scores (the terminal sends SIGINT to the process)
CTRL_C_IN_STEP_2 = textwrap.dedent(f"""
    import os, signal, sys
    sys.path.insert(0, {str(ROOT)!r})
    sys.argv = ["train_ppo.py", *sys.argv[1:]]
    import train_ppo
    real = train_ppo.score_batch
    def scoring(*a, global_step=None, **kw):
        if global_step == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*a, global_step=global_step, **kw)
    train_ppo.score_batch = scoring
    train_ppo.cli(train_ppo.main)
""")


def test_ctrl_c_finishes_the_step_saves_and_exits_130_then_resumes_bit_identical(sft_dir, tmp_path):
    straight = launch(args(sft_dir, tmp_path / "straight"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    argv = args(sft_dir, tmp_path / "run")
    first = launch(CTRL_C_IN_STEP_2, *argv)
    assert first.returncode == 130, first.stderr[-3000:]
    assert "Traceback" not in first.stderr and "KeyboardInterrupt" not in first.stderr
    ckpt = tmp_path / "run" / "global_step_2"
    assert f"preempted (SIGINT): step 2 finished and checkpoint saved to {ckpt}" in first.stderr
    assert verify_checkpoint(ckpt) is None
    assert [r["training/global_step"] for r in rows(tmp_path / "run")] == [1, 2]
    again = launch(argv)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpt} at step 2" in again.stderr
    same_run(tmp_path / "straight", tmp_path / "run")


def test_a_second_ctrl_c_typed_at_the_terminal_kills_at_once():
    """A real terminal (a pseudo-terminal): the first Ctrl-C is a preemption, a second one typed later kills."""
    import pty
    import time
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from nanokl.harness.faults import catch_preemption
        with catch_preemption() as flag:
            print("ready", flush=True)
            while flag.signal is None:
                time.sleep(0.01)
            print("first:", flag.signal, flush=True)
            time.sleep(60)
            print("survived", flush=True)
    """)
    pid, fd = pty.fork()
    if pid == 0:  # the child: stdin is the terminal, and its process group the terminal's foreground one
        os.execvpe(sys.executable, [sys.executable, "-c", script], {**os.environ, "OMP_NUM_THREADS": "1"})
    seen = b""

    def read_until(word):
        nonlocal seen
        while word not in seen:
            seen += os.read(fd, 1024)
    read_until(b"ready")
    os.write(fd, b"\x03")  # Ctrl-C: the terminal sends SIGINT to its foreground process group
    read_until(b"first: SIGINT")
    time.sleep(1.5)  # longer than a forwarded copy takes (faults.ECHO_S): a person typing it again
    os.write(fd, b"\x03")
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGINT, (status, seen)
    assert b"survived" not in seen


def test_ctrl_c_before_the_first_step_is_one_line_and_exit_130(sft_dir, tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        sys.argv = ["train_ppo.py", *sys.argv[1:]]
        import nanokl.supervised.stages as stages
        def interrupted(*a, **kw):
            raise KeyboardInterrupt
        stages.train_missing_stages = interrupted
        import train_ppo
        train_ppo.cli(train_ppo.main)
    """)
    proc = launch(script, *args(sft_dir, tmp_path / "run"))
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stderr.strip().splitlines()[-1].startswith("error: interrupted")


# ---------------------------------------------------------------------------------------------
# generate.py's arguments
# ---------------------------------------------------------------------------------------------

def gen(sft_dir, capfd, *argv):
    capfd.readouterr()
    with pytest.raises(SystemExit) as info:
        run_cli(generate.main, ["--model", str(sft_dir), "--device", "cpu", "--max-new-tokens", "8",
                                *map(str, argv)])
    return info.value.code, capfd.readouterr().err


def test_generate_refuses_empty_prompts_and_n_0_in_one_line(sft_dir, tmp_path, capfd):
    code, err = gen(sft_dir, capfd, "--prompt", "")
    assert code == 2 and "empty" in one_error(err)
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "Q: 1+2=?\nA:"}) + "\n" + json.dumps({"prompt": ""}) + "\n")
    code, err = gen(sft_dir, capfd, "--prompts", jsonl)
    assert code == 2 and f"{jsonl}:2" in one_error(err) and "empty" in one_error(err)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    code, err = gen(sft_dir, capfd, "--prompts", blank)
    assert code == 2 and str(blank) in one_error(err) and "no prompts" in one_error(err)
    for bad in (["--n", "0"], ["--n", "-2"], ["--batch-size", "0"], ["--max-new-tokens", "0"]):
        code, err = gen(sft_dir, capfd, "--prompt", "Q: 1+2=?\nA:", *bad)
        assert code == 2 and bad[0] in one_error(err), (bad, err)


# ---------------------------------------------------------------------------------------------
# an output folder that cannot be written
# ---------------------------------------------------------------------------------------------

def unwritable(tmp_path, monkeypatch, how):
    """A folder that cannot be written: a path through a regular file, or one that refuses like a read-only
    mount (EROFS from mkdir and open; root ignores permission bits, so chmod alone would not do here)."""
    if how == "through_a_file":
        (tmp_path / "a_file").write_text("x")
        return tmp_path / "a_file" / "out"
    ro = tmp_path / "ro"
    ro.mkdir()
    if how == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root writes into a chmod 555 folder")
        ro.chmod(0o555)
        return ro / "out"
    import builtins
    real_mkdir, real_open, real_os_open = os.mkdir, builtins.open, os.open

    def refuse(path):
        if str(path).startswith(str(ro)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    def mkdir(path, *a, **kw):
        refuse(path)
        return real_mkdir(path, *a, **kw)

    def open_(path, mode="r", *a, **kw):
        if any(c in mode for c in "wax+"):
            refuse(path)
        return real_open(path, mode, *a, **kw)

    def os_open(path, flags, *a, **kw):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(path)
        return real_os_open(path, flags, *a, **kw)
    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(builtins, "open", open_)
    monkeypatch.setattr(os, "open", os_open)
    return ro / "out"


@pytest.mark.parametrize("how", ["through_a_file", "read_only_mount", "chmod"])
def test_an_unwritable_output_folder_is_one_line_at_start(sft_dir, tmp_path, capfd, monkeypatch, how):
    out = unwritable(tmp_path, monkeypatch, how)
    code, err = cli(args(sft_dir, out), capfd, monkeypatch)
    assert code == 2
    line = one_error(err)
    assert "trainer.default_local_dir" in line and str(out) in line and "ppo:" not in err, line
    code, err = gen(sft_dir, capfd, "--prompt", "Q: 1+2=?\nA:", "--out", out / "x.jsonl")
    assert code == 2
    line = one_error(err)
    assert "--out" in line and str(out) in line, line

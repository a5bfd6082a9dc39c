"""A reward function that exits, overflows float32 or hangs is a faulty reward (issue 47, item 5).

Each through train_ppo.py's command line on a tiny run (5 steps of 8 responses; the reward breaks on its 27th
call: response 2 of step 4), as tests/test_faults_more.py checks a raising one: exit 1, one `error:` line
naming the function, the cause and the checkpoint of the 3 steps done, and the same command with the
function fixed resumes there. The faults:

- sys.exit(0), sys.exit(3), a bare `raise SystemExit`: once passed through (exit 0 or 3 at step 4 of 5, no
  line, no summary); at import, a one-line UserError; a KeyboardInterrupt still means Ctrl-C (exit 130), not
  a faulty reward;
- 1e39, a float whose float32 (the reward tensor's dtype) is inf, as a number or a dict's "score": once blamed
  three steps later on a "non-finite loss or gradient"; the rule checked against numpy's float32;
- a call that blocks past custom_reward_function.timeout (in a step, in a real process; in validation): once
  hung for ever. The limit itself (harness/call_limit.py): a sleep, a wait, a bare except, a thread pool's
  hung worker; unbounded where the timer is not its to take; the process's SIGALRM and timer as they were
  after each call; its cost per call.
"""

import math
import os
import signal
import subprocess
import sys
import threading
import time
import timeit
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from nanokl.harness import call_limit
from nanokl.harness.checkpoint import latest_checkpoint, load_state, verify_checkpoint
from nanokl.harness.config.load import load_config
from nanokl.harness.config.yaml_io import ConfigError, UserError
from nanokl.harness.reward_fn import RewardError, load_custom, reward_value
from test_bad_input import one_error, train_cli as cli
from test_faults import rows
from test_faults_more import REWARD, args

ROOT = Path(__file__).resolve().parents[1]


def stops_at_step_4(line, fn, tmp_path, said):
    """The one error line of a reward broken on response 2 of step 4, and the checkpoint of the 3 steps done."""
    assert "compute_score" in line and str(fn) in line and "'arith'" in line and "response 2" in line, line
    assert all(s in line for s in said) and "stopped in step 4" in line, line
    ckpt = tmp_path / "run" / "global_step_3"
    assert f"checkpoint saved to {ckpt}" in line, line
    assert verify_checkpoint(ckpt) is None and latest_checkpoint(tmp_path / "run") == ckpt
    assert load_state(ckpt)[1]["global_step"] == 3
    assert [r["training/global_step"] for r in rows(tmp_path / "run")] == [1, 2, 3]
    return ckpt


def fixed_resumes(fn, argv, ckpt, capfd, monkeypatch):
    """The function fixed, the same command resumes from `ckpt` and finishes its 5 steps."""
    fn.write_text(REWARD.replace("FAULT", "pass"))
    load_custom.cache_clear()
    code, err = cli(argv, capfd, monkeypatch)
    assert code == 0, err[-3000:]
    assert f"resumed from {ckpt} at step 3" in err
    assert latest_checkpoint(ckpt.parent).name == "global_step_5"


# ---------------------------------------------------------------------------------------------
# through the command line
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fault,said", [
    ("import sys; sys.exit(0)", ["SystemExit (exit status 0)", "must return its score"]),
    ("import sys; sys.exit(3)", ["SystemExit (exit status 3)", "must return its score"]),
    ("raise SystemExit", ["SystemExit (exit status None)", "must return its score"]),
    ("return 1e39", ["returned 1e+39 (float)", "float32"]),  # finite in Python, inf in float32
    ("return {'score': -1e39, 'acc': 1.0}", ["whose 'score' is -1e+39", "float32"])])
def test_a_reward_that_exits_or_overflows_float32_is_a_faulty_reward(sft_dir, tmp_path, capfd, monkeypatch, fault,
                                                                      said):
    fn = tmp_path / "reward.py"
    fn.write_text(REWARD.replace("FAULT", fault))
    argv = args(sft_dir, tmp_path / "run", f"custom_reward_function.path={fn}")
    code, err = cli(argv, capfd, monkeypatch)
    assert code == 1, err[-3000:]
    ckpt = stops_at_step_4(one_error(err), fn, tmp_path, said)
    assert "non-finite loss" not in err  # named where it was returned, not three steps later
    fixed_resumes(fn, argv, ckpt, capfd, monkeypatch)


def test_a_reward_file_that_exits_when_imported_is_one_line(tmp_path):
    fn = tmp_path / "exits.py"
    fn.write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(UserError, match=r"^custom_reward_function.path: importing .*' failed \(SystemExit: 0\)$"):
        load_custom(str(fn), "compute_score")


def test_a_keyboard_interrupt_raised_in_a_reward_function_is_still_ctrl_c(sft_dir, tmp_path, capfd, monkeypatch):
    fn = tmp_path / "reward.py"
    fn.write_text(REWARD.replace("FAULT", "raise KeyboardInterrupt"))
    code, err = cli(args(sft_dir, tmp_path / "run", f"custom_reward_function.path={fn}"), capfd, monkeypatch)
    assert code == 130, err[-3000:]
    assert "Ctrl-C" in one_error(err) and "reward" not in one_error(err)


@pytest.mark.slow  # in `pytest -m slow` (the default suite stays under ~8 min on 2 cores)
def test_a_reward_function_that_hangs_is_stopped_by_the_timeout_in_a_real_process(sft_dir, tmp_path):
    fn = tmp_path / "reward.py"
    fn.write_text(REWARD.replace("FAULT", "__import__('time').sleep(30)"))
    argv = [sys.executable, str(ROOT / "train_ppo.py"),
            *args(sft_dir, tmp_path / "run", f"custom_reward_function.path={fn}", "custom_reward_function.timeout=1")]
    env = {k: v for k, v in os.environ.items() if k != "NANOKL_FAULT"} | {"OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert time.perf_counter() - t0 < 25, "the 30 s sleep ran to its end"  # the process exits, nothing waits
    ckpt = stops_at_step_4(one_error(proc.stderr), fn, tmp_path,
                           ["did not return within 1 s", "custom_reward_function.timeout=1"])
    fn.write_text(REWARD.replace("FAULT", "pass"))
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0 and f"resumed from {ckpt} at step 3" in proc.stderr, proc.stderr[-3000:]


def test_a_reward_function_that_hangs_in_validation_is_stopped_after_its_step(sft_dir, tmp_path, capfd, monkeypatch):
    fn = tmp_path / "reward.py"  # 16 calls in steps 1 and 2, then the validation's 16: the 4th of those hangs
    fn.write_text(REWARD.replace("CALLS[0] == 27", "CALLS[0] == 20").replace("FAULT", "__import__('time').sleep(30)"))
    argv = args(sft_dir, tmp_path / "run", f"custom_reward_function.path={fn}", "custom_reward_function.timeout=0.5",
                "trainer.test_freq=2")
    t0 = time.perf_counter()
    code, err = cli(argv, capfd, monkeypatch)
    assert code == 1 and time.perf_counter() - t0 < 25, err[-3000:]
    line = one_error(err)
    ckpt = tmp_path / "run" / "global_step_2"
    assert "stopped in the validation after step 2" in line and "did not return within 0.5 s" in line, line
    assert "validation response 3" in line and f"checkpoint saved to {ckpt}" in line, line
    assert load_state(ckpt)[1]["global_step"] == 2
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    fn.write_text(REWARD.replace("FAULT", "pass"))
    load_custom.cache_clear()
    code, err = cli(argv, capfd, monkeypatch)
    assert code == 0 and f"resumed from {ckpt} at step 2" in err, err[-3000:]


# ---------------------------------------------------------------------------------------------
# the float32 rule
# ---------------------------------------------------------------------------------------------

F32_MAX = float(np.finfo(np.float32).max)
EDGE = 2.0 ** 128 - 2.0 ** 103  # float32's max plus half its last step: the first number that rounds to inf


@pytest.mark.parametrize("value", [3.4e38, -3.4e38, F32_MAX, math.nextafter(EDGE, 0), -math.nextafter(EDGE, 0),
                                   EDGE, -EDGE, 1e39, -1e39, 1e308, 0.0, 1.0])
def test_a_reward_is_refused_exactly_when_its_float32_is_not_finite(value):
    with np.errstate(over="ignore"):
        finite = bool(np.isfinite(np.float32(value)))
    for shape in (value, {"score": value}, {"score": 0.0, "other": value}):
        if finite:
            assert float(reward_value(shape)) == (value if not isinstance(shape, dict) else shape["score"])
        else:
            with pytest.raises(RewardError, match="float32"):
                reward_value(shape)
    assert finite == (abs(value) < 3.4028235677973366e38)


def test_float32_refusals_named_and_big_ints_too():
    for big in (10 ** 39, -(10 ** 400)):  # an int past float's range is refused as a value, not "raised OverflowError"
        with pytest.raises(RewardError, match=r"returned .* \(int\).*float32"):
            reward_value(big)
    assert float(reward_value(10 ** 38)) == 1e38 and float(reward_value(np.float64(3.4e38))) == 3.4e38


# ---------------------------------------------------------------------------------------------
# the key, and the limit itself
# ---------------------------------------------------------------------------------------------

def test_the_timeout_key():
    tiny = ROOT / "configs" / "arith_tiny.yaml"
    assert load_config(tiny).custom_reward_function.timeout == 300
    for given, read in (("null", None), ("0", 0.0), ("-1", -1.0), ("2.5", 2.5)):
        assert load_config(tiny, [f"custom_reward_function.timeout={given}"]).custom_reward_function.timeout == read
    for bad in ("1e7", "soon", ".inf"):
        with pytest.raises(ConfigError, match="custom_reward_function.timeout"):
            load_config(tiny, [f"custom_reward_function.timeout={bad}"])


def untouched():
    return signal.getsignal(signal.SIGALRM) is signal.SIG_DFL and signal.getitimer(signal.ITIMER_REAL)[0] == 0


def test_the_limit_stops_a_blocked_call_and_leaves_nothing_behind():
    def swallows():  # even a bare except: the call ran late
        try:
            time.sleep(30)
        except BaseException:
            return 1.0
    release = threading.Event()

    def pools():  # the pool's shutdown joins the hung worker: the signal, sent again, stops that wait too
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(release.wait).result()
    for fn in (lambda: time.sleep(30), lambda: threading.Event().wait(), swallows, pools):
        for scope in (call_limit.handler, None):
            t0 = time.perf_counter()
            with pytest.raises(call_limit.Expired):
                if scope is None:
                    call_limit.within(0.2, fn)
                else:
                    with scope():
                        call_limit.within(0.2, fn)
            assert time.perf_counter() - t0 < 5 and untouched()
    release.set()  # the pools' workers end
    assert call_limit.within(0.2, lambda: 7) == 7 and call_limit.within(None, lambda: 8) == 8 and untouched()


def test_the_limit_is_off_where_the_timer_is_not_its_own():
    out = []
    worker = threading.Thread(target=lambda: out.append(call_limit.within(0.05, lambda: time.sleep(0.3) or 1)))
    worker.start()
    worker.join()
    assert out == [1]  # off the main thread: unbounded
    old = signal.signal(signal.SIGALRM, lambda *a: None)  # a caller's own alarm handler (the fuzz tests')
    try:
        assert call_limit.within(0.05, lambda: time.sleep(0.3) or 2) == 2
    finally:
        signal.signal(signal.SIGALRM, old)
    assert untouched()


def test_the_limit_costs_a_few_microseconds_a_call():
    def score(data_source, solution_str, ground_truth, extra_info):
        return 1.0
    kw = dict(data_source="arith", solution_str="#### 3", ground_truth="3", extra_info={})

    def cost(fn):  # seconds a call, the best of 3 x 10,000
        return min(timeit.repeat(fn, number=10_000, repeat=3)) / 10_000
    bare = cost(lambda: score(**kw))
    with call_limit.handler():  # as the reward loops call it: the handler installed once per batch
        batched = cost(lambda: call_limit.within(300.0, score, **kw)) - bare
    alone = cost(lambda: call_limit.within(300.0, score, **kw)) - bare  # a handler of its own each call
    print(f"call_limit.within: {1e6 * batched:.2f} us a call in a batch, {1e6 * alone:.2f} us alone")
    # ~2 us on a quiet CPU (two setitimer calls), twice that on a loaded one; a handler per call is ~5x
    assert batched < 20e-6 and batched < alone / 2

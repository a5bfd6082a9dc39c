"""Fuzzed input, shared pieces: every reader of what a user gives nanokl ends in success or a one-line UserError.

The tests are tests/test_fuzz_config.py, test_fuzz_data.py and test_fuzz_checkpoint.py; this module
holds what they share (deterministic settings, the hang guard, the property `outcome`, byte damage).

Property-based tests (hypothesis) feed generated near-miss inputs to each reader of user files:

- the config loader (`load_config`): YAML documents built from the real keys with right and wrong
  values, YAML's special values, broken YAML text, `defaults:` chains (missing files, cycles,
  non-strings, the real configs) and `key=value` overrides (no `=`, bad keys, lists, unicode);
- the data readers: prompt rows (verl-style and raw GSM8K, through the gsm8k task), logged
  responses (`read_logged`) and preferences (`read_preferences`), as JSONL, JSON arrays and
  Parquet: valid rows with fields deleted, retyped or nested, raw JSON such as huge ints, `NaN`,
  lone surrogates and deep nesting, files cut short, bit-flipped, with non-UTF-8 bytes, and
  Parquet tables of random schemas;
- checkpoint directories (a tiny but complete one, made once) with random truncations, bit flips
  and deletions, with and without manifest.json, read in the order a resume reads them:
  `latest_checkpoint`, `load_state`, `from_pretrained(actor)`, `load_value_model(critic)`, and the
  tokenizer beside the actor.

The property: each case returns, or raises a `UserError` (any subclass; `run_cli` prints it as
one line and exits with status 2) whose message is one line and names the file (or the argument)
at fault. Any other exception is a reader bug and fails the test; so does a case still running
after CASE_SECONDS (a SIGALRM). With a manifest, a changed file never verifies and the problem
names it; an undamaged checkpoint always loads. Generation is derandomized and has no example
database, so CI runs the same few hundred cases per reader every time, plus, as @example cases,
each bug the fuzzing found (the reader fixes came with them). A last, plain test covers the wrong
types and impossible values in a model's config.json that bit flips rarely produce.
"""


import contextlib
import functools
import signal
from pathlib import Path

import pytest

if not hasattr(signal, "SIGALRM"):  # a test module importing this one is skipped with it
    pytest.skip("the hang guard needs SIGALRM (POSIX)", allow_module_level=True)
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nanokl.harness.config.yaml_io import UserError  # noqa: E402
from nanokl.harness.tokenizer import train_tokenizer  # noqa: E402
from nanokl.tasks.arith import make_arith_task  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]
CASE_SECONDS = 5  # generous: a case takes milliseconds; only a hang reaches it


def fuzz(n):
    """Deterministic settings for CI: the same `n` cases every run (and the @example ones), no deadline per
    case, no database. No shrinking either: a failure is reported as generated, at once, where shrinking
    files of kilobytes can take minutes."""
    return settings(max_examples=n, deadline=None, derandomize=True, database=None, print_blob=False,
                    phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much, HealthCheck.large_base_example])


class Hang(BaseException):
    """Raised by the alarm: a BaseException, so that no reader's `except Exception` can swallow it."""


@contextlib.contextmanager
def time_limit(seconds=CASE_SECONDS):
    def on_alarm(signum, frame):
        raise Hang()
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    except Hang:
        raise AssertionError(f"the case was still running after {seconds} s (a hang)") from None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def record(event):
    """Count outcomes in --hypothesis-show-statistics."""
    if hypothesis.currently_in_test_context():
        hypothesis.event(event)


def outcome(fn, *args, names=(), **kwargs):
    """fn(*args, **kwargs) under the time limit: its result, or the UserError it raised, once checked
    to be one line naming one of `names` (files or arguments). Any other exception propagates."""
    try:
        with time_limit():
            result = fn(*args, **kwargs)
        record(f"{fn.__name__}: success")
        return result
    except UserError as e:
        record(f"{fn.__name__}: {type(e).__name__}")
        message = str(e)
        assert message.strip() and "\n" not in message and "\r" not in message, repr(message)
        assert not names or any(str(n) in message for n in names), f"{message!r} names none of {names}"
        return e


# ---------------------------------------------------------------------------------------------
# Drawing, and byte-level damage shared by every file format
# ---------------------------------------------------------------------------------------------

# The generators below are plain functions of `draw` that pick from fixed lists through these cached
# strategies: a strategy made afresh at every draw costs hypothesis more than the case itself.
ints = functools.lru_cache(maxsize=None)(st.integers)


def pick(draw, options):
    return options[draw(ints(0, len(options) - 1))]


OFFSETS = st.one_of(st.integers(0, 255), st.integers(0, 1 << 30))  # headers live at the start: aim there often


def damaged(draw, data: bytes) -> bytes:
    """`data` as written, or cut short, bit-flipped, or with a non-UTF-8 byte inserted."""
    kind = pick(draw, ["none"] * 7 + ["truncate", "flip", "insert"])
    if kind == "none" or not data:
        return data
    if kind == "truncate":
        return data[:draw(OFFSETS) % len(data)]
    if kind == "flip":
        data = bytearray(data)
        for _ in range(draw(ints(1, 3))):
            data[draw(OFFSETS) % len(data)] ^= 1 << draw(ints(0, 7))
        return bytes(data)
    at = draw(OFFSETS) % (len(data) + 1)
    return data[:at] + pick(draw, [b"\xff", b"\xc3", b"\x80", b"\xed\xa0\x80", b"\x00"]) + data[at:]




@functools.lru_cache(maxsize=1)
def tiny_tokenizer():
    """A small byte-level BPE tokenizer, trained in milliseconds on the arithmetic task's text."""
    train, _ = make_arith_task(200, 0, 0)
    return train_tokenizer([ex["prompt"] + ex["solution"] for ex in train], vocab_size=300)

"""Fuzzed input: every reader of what a user gives nanokl ends in success or a one-line UserError.

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
import dataclasses
import functools
import json
import shutil
import signal
import tempfile
import typing
from pathlib import Path

import pytest

if not hasattr(signal, "SIGALRM"):
    pytest.skip("the hang guard needs SIGALRM (POSIX)", allow_module_level=True)
hypothesis = pytest.importorskip("hypothesis")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import torch  # noqa: E402
from hypothesis import HealthCheck, Phase, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nanokl.harness.checkpoint import (MANIFEST, latest_checkpoint, load_state, rng_state,  # noqa: E402
                                       save_checkpoint, verify_checkpoint)
from nanokl.harness.config import Config, DataConfig, load_config  # noqa: E402
from nanokl.harness.config_io import UserError, all_keys  # noqa: E402
from nanokl.harness.data import read_examples, verl_row_to_example  # noqa: E402
from nanokl.harness.hf_format import from_pretrained, load_value_model  # noqa: E402
from nanokl.harness.logged import read_logged  # noqa: E402
from nanokl.harness.tokenizer import load_tokenizer, train_tokenizer  # noqa: E402
from nanokl.model import CausalLM, ModelConfig, ValueModel, init_weights  # noqa: E402
from nanokl.supervised.preference_data import read_preferences  # noqa: E402
from nanokl.tasks import TASKS  # noqa: E402
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


# ---------------------------------------------------------------------------------------------
# 1. The config loader: YAML files, `defaults:` chains, `key=value` overrides
# ---------------------------------------------------------------------------------------------

def _leaf_types(cls, prefix=""):
    out, hints = {}, typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(_leaf_types(tp, prefix + f.name + "."))
        else:
            out[prefix + f.name] = tp
    return out


def _literals(tp):
    """Every value a Literal anywhere inside annotation `tp` allows."""
    if typing.get_origin(tp) is typing.Literal:
        return list(typing.get_args(tp))
    return [v for arg in typing.get_args(tp) for v in _literals(arg)]


KEYS = all_keys(Config)
LEAVES = _leaf_types(Config)
_DEFAULTS = Config()
# right values, as YAML text: each key's default and the names its Literal allows
RIGHT = {k: [json.dumps(functools.reduce(getattr, k.split("."), _DEFAULTS))]
         + [json.dumps(v) for v in _literals(tp)] for k, tp in LEAVES.items()}
# near misses: values of the wrong type or range, and YAML 1.1's surprises
SCALARS = [
    "0", "-1", "1", "2", "3", "8", "64", "1024", "0.5", "1.5", "-0.1", "0.03", "1e-6", "1.0e-6", "1e999", ".inf",
    "-.inf", ".nan", "NaN", "null", "~", "", "true", "false", "yes", "no", "on", "off", "y", "0x1F", "0o17",
    "017", "1_000", "1:30", "2024-01-01", "2001-12-14t21:59:43.10-05:00", "'quoted'", '"dq"',
    "plain text", "ünïcödé ✓", "gsm8k", "arith", "grpo", "ddp", "fsdp2", "console", "[]", "{}", "[a, b]", "[1, 2]",
    "[0.9, 0.999]", "[0.9]", "[console, wandb]", "[console, nope]", "{a: 1}", "{x: {y: z}}", "[[1, [2, [3]]]]",
    "!!str 1", "!!binary aGVsbG8=", "!!set {a, b}", "!!omap [a: 1]", "&a 1", "12345678901234567890123456789",
]
# broken values: text PyYAML refuses, or mis-reads (a date that is none, tags it cannot construct)
BROKEN = [
    "2024-13-45", "!!binary x", "!!python/object/apply:os.system ['true']", "!!int x",
    "!!float x", "!!bool maybe", "!!null x", "!!timestamp 2024-01-01 25:00", "!!map [1]", "!!seq {a: 1}",
    "*undefined", "&r [*r]", "'unterminated", '"unterminated', "[a, b", "{a: 1", "a: b: c", "- x", "|", ">", "%",
    "@x", "`x`", "? x", "#comment", "\t1", "'\\x00'", '"\\0"', "9" * 5000, "0x" + "f" * 5000,
    "[" * 800 + "]" * 800, "{a: " * 400 + "1" + "}" * 400, "<<: {a: 1}",
]
VALUES = st.one_of(st.sampled_from(SCALARS), st.sampled_from(SCALARS), st.sampled_from(SCALARS),
                   st.sampled_from(BROKEN))
ARITH_TINY = ROOT / "configs" / "arith_tiny.yaml"
REAL_CONFIGS = [p.read_text() for p in sorted((ROOT / "configs").rglob("*.yaml"))]


def near_key(draw):
    """A real dotted key, or one with a typo, in the wrong section, or unknown."""
    key = pick(draw, KEYS)
    kind = pick(draw, ["real", "real", "real", "real", "typo", "moved", "unknown"])
    parts = key.split(".")
    if kind == "typo":
        leaf = parts[-1]
        i = draw(ints(0, len(leaf) - 1))
        leaf = pick(draw, [leaf[:i] + leaf[i + 1:], leaf[:i] + leaf[i] * 2 + leaf[i + 1:],
                           leaf[:i] + leaf[i:].upper(), leaf.replace("_", "-")]) or "x"
        parts[-1] = leaf
    elif kind == "moved":
        parts = pick(draw, KEYS).split(".")[:-1] + parts[-1:]
    elif kind == "unknown":
        parts.append(pick(draw, ["x", "defaults", "_target_", "ünï", "1", "true", "null", "a b"]))
    return ".".join(parts)


def value_for(draw, key):
    """Mostly a right value for a real key, else a near miss."""
    return pick(draw, RIGHT[key]) if key in RIGHT and draw(st.booleans()) else draw(VALUES)


def key_value(draw):
    key = near_key(draw)
    return key, value_for(draw, key)


def yaml_document(draw):
    """The text of one config file: real keys (nested) with right or wrong values, maybe a `defaults:`."""
    tree = {}
    for _ in range(draw(ints(0, 8))):
        key, value = key_value(draw)
        node, parts = tree, key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                break
        else:
            node[parts[-1]] = value

    def render(d, indent):
        for k, v in d.items():
            if isinstance(v, dict):
                yield " " * indent + f"{k}:" + (" {}" if not v else "")
                yield from render(v, indent + 2)
            else:
                yield " " * indent + f"{k}: {v}"
    lines = list(render(tree, 0))
    if draw(st.booleans()):  # a defaults list: files of this chain, missing ones, cycles, non-strings
        chosen = [pick(draw, ENTRIES) for _ in range(draw(ints(0, 3)))]
        shape = pick(draw, ["flow", "flow", "block", "scalar"])
        text = ("[" + ", ".join(chosen) + "]" if shape == "flow" else
                "".join("\n  - " + e for e in chosen) if shape == "block" else (chosen or ["b.yaml"])[0])
        lines.insert(draw(ints(0, len(lines))), "defaults: " + text)
    return "\n".join(lines) + "\n"


def text_damage(draw, text):
    """Broken YAML text: cut short, a character lost or added, indentation off, lines moved, whole
    documents of the wrong shape."""
    kind = pick(draw, ["none"] * 20 + ["truncate", "delete", "insert", "indent", "tab", "swap", "shape"])
    lines = text.splitlines()
    if kind == "truncate" and text:
        return text[:draw(ints(0, len(text)))]
    if kind == "delete" and text:
        i = draw(ints(0, len(text) - 1))
        return text[:i] + text[i + 1:]
    if kind == "insert":
        i = draw(ints(0, len(text)))
        return text[:i] + pick(draw, ":-[]{}'\"#&*!|>\t\n ,?%@`") + text[i:]
    if kind in ("indent", "tab", "swap") and lines:
        i = draw(ints(0, len(lines) - 1))
        if kind == "indent":
            lines[i] = " " + lines[i]
        elif kind == "tab":
            lines[i] = "\t" + lines[i].lstrip(" ")
        else:
            j = draw(ints(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        return "\n".join(lines) + "\n"
    if kind == "shape":
        return pick(draw, ["", "- a\n- b\n", "42\n", "~\n", "---\na: 1\n---\nb: 2\n", "[data]\n",
                           "data\n", "'data'\n", "? [a]\n: 1\n", "1: 2\n", "data: {1: 2}\n",
                           "data: &d {train_files: *d}\n", "data:\n  <<: *nope\n"])
    return text


ENTRIES = [
    "arith_tiny.yaml", "arith_tiny.yaml", "b.yaml", "c.yaml", "main.yaml", "./b.yaml", "sub/d.yaml", "sub/../c.yaml",
    "missing.yaml", "../nope.yaml",
    "sub", ".", "''", "1", "null", "{a: b}", "[b.yaml]", '"b.yaml\\0"', '"\\t"', "~", str(ARITH_TINY),
    str(ARITH_TINY), str(ROOT / "configs" / "presets" / "conservative.yaml"), "ünï.yaml",
]


@st.composite
def config_files(draw):
    """{relative path: file bytes} of one config chain; main.yaml is the one loaded. Beside them, a copy of
    configs/arith_tiny.yaml: the real configs' `defaults: [arith_tiny.yaml]` find it."""
    names = ["main.yaml"] + [n for n in ("b.yaml", "c.yaml", "sub/d.yaml") if draw(st.booleans())]
    files = {"arith_tiny.yaml": ARITH_TINY.read_bytes()}
    for name in names:
        text = pick(draw, REAL_CONFIGS) if draw(ints(0, 4)) == 0 else yaml_document(draw)  # a real one, maybe broken
        data = text_damage(draw, text).encode("utf-8")
        if draw(ints(0, 9)) == 0:
            data = pick(draw, [b"\xef\xbb\xbf", b""]) + damaged(draw, data)
        files[name] = data
    return files


KEY_VALUE = st.composite(lambda draw: "=".join(key_value(draw)))()
OVERRIDES = st.one_of(  # half of them a (near) key with a value made for it
    KEY_VALUE, KEY_VALUE, st.composite(lambda draw: f"{near_key(draw)}={draw(VALUES)}")(),
    st.sampled_from(["=1", "a..b=1", ".data.task=x", "data.=1", " data.task = gsm8k ", "data.task=", "data.task==x",
                     "data.task=a\nb", "ünï.cödé=1", "data.train_files=[a.jsonl, /nonexistent/b.parquet]",
                     "data.train_files=/nonexistent/x.jsonl", "trainer.logger=[console,wandb]",
                     "trainer.logger=console", "+data.num_val=1", "~data.task", "data=1", "data={task: gsm8k}",
                     "data.train_files.x=1", "actor_rollout_ref.model.override_config={a: {b: 1}}",
                     "actor_rollout_ref.model.override_config=&r {a: *r}", "data.num_val=&a [*a]",
                     "--config=x.yaml", "data.task=gsm8k", "algorithm.adv_estimator=grpo",
                     "actor_rollout_ref.actor.loss_mode=dpo", "trainer.resume_mode=resume_path",
                     "data.num_val=" + "9" * 5000, "data.seed=2024-13-45", "data.num_val=!!int x",
                     "data.num_val=" + "[" * 800, "a" * 300 + "=1", "data.task"]),
)


def yaml_case(text: bytes, *overrides):
    return example(files={"main.yaml": text}, overrides=list(overrides), path="main.yaml")


@fuzz(250)
# the bugs fuzzing found, kept as fixed cases: PyYAML's constructors raising ValueError, KeyError (a date that
# is none, `!!bool maybe`, an int too long to convert), a file not UTF-8, a NUL in a defaults entry, a mapping
# inside itself, nesting deeper than Python recursion, the same in overrides
@yaml_case(b"data:\n  seed: 2024-13-45\n")
@yaml_case(b"trainer:\n  seed: !!bool maybe\n")
@yaml_case(b"data:\n  task: \xff\n")
@yaml_case(b'defaults: ["b.yaml\\0"]\n')
@yaml_case(b"data: &d {x: *d}\n")
@yaml_case(b"data: " + b"[" * 800 + b"\n")
@yaml_case(b"", "data.num_val=" + "9" * 5000)
@yaml_case(b"", "data.seed=2024-13-45")
@yaml_case(b"", "actor_rollout_ref.model.override_config=&r {a: *r}")
@yaml_case(b"", "data.num_val=" + "[" * 800)
@given(files=config_files(), overrides=st.lists(OVERRIDES, max_size=4),
       path=st.sampled_from(["main.yaml"] * 8 + ["missing.yaml", "sub", None]))
def test_config_loader(files, overrides, path):
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "sub").mkdir()
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        got = outcome(load_config, None if path is None else tmp / path, overrides,
                      names=[tmp.name, ARITH_TINY.name, "argument", "override"])
    assert isinstance(got, (Config, UserError))


# ---------------------------------------------------------------------------------------------
# 2. Data readers: prompts (verl rows, raw GSM8K), logged responses, preferences
# ---------------------------------------------------------------------------------------------

class Raw(str):
    """JSON text written into the file as is: what json.dumps would never write."""


RAW = [Raw(t) for t in ["NaN", "Infinity", "-Infinity", "1e999", "-0", "9" * 400, "9" * 5000, "-" + "9" * 30,
                        '"\\ud800"', '"a\\udfffb"', '"\\ud83d\\ude00"', '"\\u0000"', "[" * 50000 + "]" * 50000,
                        '{"a": ' * 2000 + "1" + "}" * 2000]]
TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), TEXT,
                              st.floats(allow_nan=False, allow_infinity=False)),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=6)
NEAR = st.sampled_from([None, True, False, 0, 1, -1, 2, 0.5, "", "0", "a", [], {}, [0], [1, 0], ["a"], [[]], {"a": 1}])
RETYPED = st.one_of(NEAR, st.sampled_from(RAW))
ANY = st.one_of(NEAR, JSON, st.sampled_from(RAW))


def mutated(draw, value, depth=0):
    """`value` with one random change somewhere inside: a field deleted, renamed or retyped."""
    inside = [True] * (9 if depth == 0 else 3) + [False]  # the whole row replaced: 1 in 10
    if isinstance(value, dict) and value and depth < 4 and pick(draw, inside):
        value = dict(value)
        k = pick(draw, sorted(value))
        how = pick(draw, ["inside", "inside", "inside", "element", "delete", "rename"])
        if how == "element" and isinstance(value[k], list) and value[k]:  # one element retyped: [2, "0", 1]
            value[k] = list(value[k])
            value[k][draw(ints(0, len(value[k]) - 1))] = draw(RETYPED)
        elif how == "delete":
            del value[k]
        elif how == "rename":
            value[k + pick(draw, ["_", "s", " "])] = value.pop(k)
        else:
            value[k] = mutated(draw, value[k], depth + 1)
        return value
    if isinstance(value, list) and value and depth < 4 and pick(draw, inside):
        value = list(value)
        i = draw(ints(0, len(value) - 1))
        how = pick(draw, ["inside", "inside", "inside", "delete", "repeat"])
        if how == "delete":
            del value[i]
        elif how == "repeat":
            value.append(value[i])
        else:
            value[i] = mutated(draw, value[i], depth + 1)
        return value
    return draw(ANY)


CHAT = st.one_of(TEXT, st.builds(lambda q: [{"role": "user", "content": q}], TEXT),
                 st.builds(lambda s, q: [{"role": "system", "content": s}, {"role": "user", "content": q}], TEXT, TEXT))


@functools.lru_cache(maxsize=None)
def verl_rows(sources, keys=("prompt", "data_source")):
    """verl's preprocessed rows, their prompt and data_source under the names data.prompt_key and
    data.reward_fn_key give them (`sources`: the data_source values, a tuple)."""
    return st.fixed_dictionaries(
        {keys[1]: st.sampled_from(sources), keys[0]: CHAT,
         "reward_model": st.fixed_dictionaries({"ground_truth": st.one_of(TEXT, st.integers(-10 ** 6, 10 ** 6))},
                                               optional={"style": st.just("rule")})},
        optional={"ability": st.just("math"), "extra_info": st.fixed_dictionaries({"index": st.integers(0, 9)})})


GSM8K_RAW = st.fixed_dictionaries({"question": TEXT, "answer": st.builds(lambda a, n: f"{a}\n#### {n:,}", TEXT,
                                                                         st.integers(-10 ** 7, 10 ** 7))})


@functools.lru_cache(maxsize=1)
def tiny_tokenizer():
    """A small byte-level BPE tokenizer, trained in milliseconds on the arithmetic task's text."""
    train, _ = make_arith_task(200, 0, 0)
    return train_tokenizer([ex["prompt"] + ex["solution"] for ex in train], vocab_size=300)


PAIRWISE = st.fixed_dictionaries({"prompt": CHAT, "chosen": TEXT, "rejected": TEXT})


LOGPROB = st.floats(-20, 0)
permutations = functools.lru_cache(maxsize=None)(lambda n: st.permutations(list(range(n))))
TRUTH = st.one_of(TEXT, st.integers())


@st.composite
def listwise(draw, min_size=1, logged=False):
    """A row of ranked responses; `logged`: with the logged-response extras (log-probs of the right
    length for tiny_tokenizer, the task's ground truth)."""
    if draw(ints(0, 3)) == 0:
        return draw(PAIRWISE)
    responses = [draw(TEXT) for _ in range(draw(ints(min_size, 4)))]
    row = {"prompt": draw(CHAT if logged else TEXT), "responses": responses}
    if not logged or draw(ints(0, 3)):
        row["ranking"] = draw(permutations(len(responses)))
    if draw(st.booleans()):
        row["ended"] = [draw(st.booleans()) for _ in responses]
    if logged and draw(st.booleans()):
        ended = row.get("ended", [True] * len(responses))
        row["logprobs"] = [[draw(LOGPROB) for _ in range(n)]
                           for n in (len(tiny_tokenizer().encode_one(r)) + e for r, e in zip(responses, ended))]
    if logged and draw(st.booleans()):
        row["ground_truth"], row["data_source"] = draw(TRUTH), "arith"
    if logged and draw(ints(0, 3)) == 0:
        row["reward_model"] = {"ground_truth": draw(TEXT)}
    return row


LOGGED_ROWS = listwise(logged=True)
PREFERENCE_ROWS = listwise(min_size=2)

FIELDS = ["prompt", "data_source", "reward_model", "question", "answer", "responses", "ranking", "ended",
          "logprobs", "chosen", "rejected", "ground_truth", "extra_info"]
ARROW = [  # (type, values) for Parquet columns of random schemas
    (pa.string(), TEXT), (pa.large_string(), TEXT), (pa.int64(), st.integers(-2 ** 63, 2 ** 63 - 1)),
    (pa.int8(), st.integers(-128, 127)), (pa.uint64(), st.integers(0, 2 ** 64 - 1)), (pa.float64(), st.floats()),
    (pa.float32(), st.floats(width=32)), (pa.bool_(), st.booleans()), (pa.binary(), st.binary(max_size=8)),
    (pa.null(), st.none()), (pa.date32(), st.dates()), (pa.timestamp("ns"), st.integers(-2 ** 63 + 1, 2 ** 63 - 1)),
    (pa.decimal128(12, 3), st.decimals(-10 ** 8, 10 ** 8, places=3, allow_nan=False)),
    (pa.dictionary(pa.int32(), pa.string()), TEXT),
    (pa.list_(pa.string()), st.lists(TEXT, max_size=3)),
    (pa.list_(pa.int64()), st.lists(st.integers(-3, 3), max_size=3)),
    (pa.list_(pa.bool_()), st.lists(st.booleans(), max_size=3)),
    (pa.list_(pa.list_(pa.float64())), st.lists(st.lists(st.floats(), max_size=3), max_size=3)),
    (pa.struct([("ground_truth", pa.string())]), st.fixed_dictionaries({"ground_truth": TEXT})),
    (pa.struct([("ground_truth", pa.int64()), ("style", pa.string())]),
     st.fixed_dictionaries({"ground_truth": st.integers(-2 ** 63, 2 ** 63 - 1), "style": TEXT})),
    (pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])),
     st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT}),
              max_size=3)),
    (pa.map_(pa.string(), pa.string()), st.lists(st.tuples(TEXT, TEXT), max_size=2)),
]


ARROW = [(tp, st.none() | values) for tp, values in ARROW]
COLUMN_NAMES = st.sampled_from(FIELDS) | TEXT


def random_schema_table(draw):
    names = list(dict.fromkeys(draw(COLUMN_NAMES) for _ in range(draw(ints(1, 6)))))
    n = draw(ints(0, 4))
    columns = {}
    for name in names:
        tp, values = pick(draw, ARROW)
        column = [draw(values) for _ in range(n)]
        if tp == pa.timestamp("ns"):
            column = [None if v is None else pa.scalar(v, pa.int64()).cast(tp) for v in column]
        columns[name] = pa.array(column, type=tp)
    return pa.table(columns)


def _jsonable(value):
    """For a Parquet cell: Raw JSON text as the string it is."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return str(value) if isinstance(value, Raw) else value


def parquet_bytes(rows) -> bytes:
    """Rows as a Parquet file; a column whose values have no common type Parquet holds is written as JSON text."""
    rows = [_jsonable(r) if isinstance(r, dict) else {"value": _jsonable(r)} for r in rows]
    columns = {}
    for name in dict.fromkeys(k for r in rows for k in r):
        values = [r.get(name) for r in rows]
        try:
            columns[name] = pa.array(values)
            pq.write_table(pa.table({name: columns[name]}), pa.BufferOutputStream())
        except (pa.ArrowException, OverflowError, ValueError, TypeError):  # mixed types; an empty struct
            columns[name] = pa.array([json.dumps(v) for v in values])
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(columns) if columns else pa.table({"empty": pa.array([], pa.null())}), sink)
    return sink.getvalue().to_pybytes()


def dump_json(value) -> str:
    """json.dumps, with Raw values written as their raw text."""
    raws = []

    def swap(v):
        if isinstance(v, Raw):
            raws.append(v)
            return f"\x00RAW{len(raws) - 1}\x00"
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list):
            return [swap(x) for x in v]
        return v
    text = json.dumps(swap(value))
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00RAW{i}\x00"), raw, 1)
    return text


def data_file(draw, valid):
    """(file name, bytes): rows from `valid`, most often one of them changed somewhere, as JSONL, a JSON
    array, or Parquet (or a Parquet table of a random schema), then maybe damaged."""
    kind = pick(draw, ["jsonl", "jsonl", "jsonl", "json", "json-lines", "parquet", "parquet", "random-parquet"])
    if kind == "random-parquet":
        table = random_schema_table(draw)
    else:
        rows = [draw(valid) for _ in range(draw(ints(1, 4)))]
        if pick(draw, [True, True, True, False]):
            i = draw(ints(0, len(rows) - 1))
            for _ in range(pick(draw, [1, 1, 2])):
                rows[i] = mutated(draw, rows[i])
    if kind == "random-parquet":
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        name, data = "rows.parquet", sink.getvalue().to_pybytes()
    elif kind == "parquet":
        name, data = "rows.parquet", parquet_bytes(rows)
    elif kind == "json":
        name, data = "rows.json", dump_json(rows).encode()
    else:
        lines = [dump_json(r) for r in rows]
        for _ in range(pick(draw, [0, 0, 0, 1, 2])):  # blank lines, and lines cut short as by a crash
            i = draw(ints(0, len(lines)))
            lines.insert(i, pick(draw, ["", "", "", "  ", "\t", "{", '{"prompt": "q"', "[]", "null", "1"]))
        newline = pick(draw, ["\n", "\r\n"])
        text = newline.join(lines) + pick(draw, [newline, ""])
        name, data = ("rows.jsonl" if kind == "jsonl" else "rows.json"), text.encode("utf-8")
    return name, damaged(draw, data)


@functools.lru_cache(maxsize=None)
def data_files(valid):
    return st.composite(data_file)(valid)


@contextlib.contextmanager
def written(*files):
    """Write (name, bytes) files into a fresh directory; yield their paths."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, (name, data) in enumerate(files):
            path = Path(tmp) / f"{i}_{name}"
            path.write_bytes(data)
            paths.append(path)
        yield paths


@st.composite
def prompt_files(draw):
    """(reader, (data.prompt_key, data.reward_fn_key), train file, val file or None): verl rows for the
    generic reader; for the gsm8k task, raw GSM8K rows and verl rows of its data_source."""
    reader = pick(draw, ["verl", "gsm8k"])
    keys = pick(draw, [("prompt", "data_source")] * 3 + [("question", "source"), ("messages", "dataset")])
    rows = verl_rows(("openai/gsm8k", "arith", "x"), keys) if reader == "verl" else gsm8k_rows(keys)
    return reader, keys, data_file(draw, rows), data_file(draw, rows) if draw(ints(0, 3)) == 0 else None


@functools.lru_cache(maxsize=None)
def gsm8k_rows(keys):
    return st.one_of(GSM8K_RAW, verl_rows(("openai/gsm8k",), keys))


VERL_ROW = b'{"prompt": %s, "data_source": "x", "reward_model": {"ground_truth": %s}}\n'


def prompt_case(name, data):
    return example(case=("verl", ("prompt", "data_source"), (name, data), None))


@fuzz(250)
# found by fuzzing: a file not UTF-8, a lone surrogate (the tokenizer's TypeError later), an int json.loads
# refuses with ValueError, nesting deeper than Python recursion
@prompt_case("rows.jsonl", VERL_ROW % (b'"q"', b'"1"') + b'{"prompt": "\xff"}\n')
@prompt_case("rows.jsonl", VERL_ROW % (b'"\\ud800"', b'"1"'))
@prompt_case("rows.jsonl", VERL_ROW % (b'"q"', b"9" * 5000))
@prompt_case("rows.json", b"[" * 50000 + b"]" * 50000)
@given(case=prompt_files())
def test_prompt_and_gsm8k_readers(case):
    reader, keys, train, val = case
    with written(*([train] + ([val] if val else []))) as paths:
        if reader == "verl":
            got = outcome(read_examples, paths, lambda row, where: verl_row_to_example(row, where, *keys), names=paths)
        else:
            d = DataConfig(task="gsm8k", train_files=[str(paths[0])], val_files=[str(p) for p in paths[1:]] or None,
                           prompt_key=keys[0], reward_fn_key=keys[1])
            got = outcome(TASKS["gsm8k"].examples, d, seed=0, names=paths)
    if not isinstance(got, UserError):
        examples = got if reader == "verl" else got[0] + got[1]
        assert examples and all(isinstance(ex["prompt"], str) and isinstance(ex["ground_truth"], str)
                                for ex in examples)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def logged_case(row: bytes):
    return example(file=("rows.jsonl", row), template="plain", max_prompt=None, max_response=None,
                   need_ranking=False, need_truth=False)


@fuzz(250)
# found by reading parse_row, which the fuzzing rarely reaches: a ranking that does not sort (TypeError), a
# log-prob int beyond every float (OverflowError)
@logged_case(b'{"prompt": "q", "responses": ["a", "b"], "ranking": [0, "1"]}\n')
@logged_case(b'{"prompt": "q", "responses": [""], "logprobs": [[' + b"9" * 400 + b']]}\n')
@given(file=data_files(LOGGED_ROWS), template=st.sampled_from(["plain", "chatml"]),
       max_prompt=st.sampled_from([None, None, 8, 512]), max_response=st.sampled_from([None, 1, 8]),
       need_ranking=st.booleans(), need_truth=st.booleans())
def test_logged_reader(tok, file, template, max_prompt, max_response, need_ranking, need_truth):
    with written(file) as (path,):
        got = outcome(read_logged, path, tok, template=template, max_prompt_length=max_prompt,
                      max_response_length=max_response, need_ranking=need_ranking, need_truth=need_truth,
                      names=[path])
    if not isinstance(got, UserError):
        for row in got:
            assert len(row["response_ids"]) == len(row["responses"]) >= 1
            assert all(isinstance(i, int) for ids in row["response_ids"] for i in ids)


@fuzz(200)
@given(file=data_files(PREFERENCE_ROWS))
def test_preference_reader(file):
    with written(file) as (path,):
        got = outcome(read_preferences, path, names=[path])
    if not isinstance(got, UserError):
        assert got and all(sorted(r["ranking"]) == list(range(len(r["responses"]))) for r in got)


# ---------------------------------------------------------------------------------------------
# 3. Checkpoint directories: truncations, bit flips, deletions; with and without a manifest
# ---------------------------------------------------------------------------------------------

STEP = "checkpoints/global_step_2"
TARGETS = ["checkpoints/latest_checkpointed_iteration.txt", f"{STEP}/{MANIFEST}", f"{STEP}/optim.pt",
           f"{STEP}/trainer_state.pt", f"{STEP}/actor/config.json", f"{STEP}/actor/model.safetensors",
           f"{STEP}/actor/tokenizer.json", f"{STEP}/actor/tokenizer_config.json", f"{STEP}/critic/config.json",
           f"{STEP}/critic/model.safetensors"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tok):
    """A run directory with one complete checkpoint of tiny models (actor, critic, tokenizer, states)."""
    run = tmp_path_factory.mktemp("fuzz_run")
    cfg = ModelConfig(model_type="qwen2", vocab_size=tok.vocab_size, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      rope_theta=1e4)
    actor, critic = init_weights(CausalLM(cfg)), init_weights(ValueModel(cfg))
    # an AdamW state dict's shape, built by hand (a real step first imports torch's compiler stack: seconds),
    # for two parameters (each tensor is a record torch.load reads: a full state costs every case milliseconds)
    params = list(actor.parameters())[:2]
    optim = {"state": {i: {"step": torch.tensor(1.0), "exp_avg": torch.randn_like(p),
                           "exp_avg_sq": torch.rand_like(p)} for i, p in enumerate(params)},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.01,
                               "params": list(range(len(params)))}]}
    save_checkpoint(run, 2, {"actor": actor, "critic": critic}, {"actor": optim, "actor_sched": {"last_epoch": 1}},
                    {"kl_ctrl": {"value": 0.1}, "rng": rng_state()}, tokenizer=tok)
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()) == sorted(TARGETS)
    return run, {t: (run / t).read_bytes() for t in TARGETS}


DAMAGE = st.tuples(st.sampled_from(TARGETS), st.sampled_from(["truncate", "flip", "flip", "flip", "delete", "empty"]),
                   OFFSETS, st.integers(0, 7))


def legacy_case(target, how, offset=0, bit=0):
    return example(damage=[(f"{STEP}/{target}", how, offset, bit)], drop_manifest=True)


@fuzz(200)
# found by fuzzing, the loaders' own errors: safetensors' SafetensorError, the tokenizers parser's Exception,
# json's JSONDecodeError and UnicodeDecodeError for the tokenizer's config (a config.json not UTF-8 too)
@legacy_case("actor/model.safetensors", "truncate", 100)
@legacy_case("critic/model.safetensors", "flip", 3, 6)
@legacy_case("actor/tokenizer.json", "truncate", 10)
@legacy_case("actor/tokenizer_config.json", "truncate", 5)
@legacy_case("actor/tokenizer_config.json", "flip", 0, 7)
@legacy_case("critic/config.json", "flip", 0, 7)
@given(damage=st.lists(DAMAGE, max_size=3), drop_manifest=st.booleans())
def test_checkpoint_readers(pristine, damage, drop_manifest):
    pristine, original = pristine
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        shutil.copytree(pristine, run)
        ckpt = run / STEP
        if drop_manifest:
            (ckpt / MANIFEST).unlink()
        for target, how, offset, bit in damage:
            path = run / target
            if not path.is_file():
                continue
            data = bytearray(path.read_bytes())
            if how == "delete":
                path.unlink()
                continue
            if how == "truncate":
                data = data[:offset % (len(data) + 1)]
            elif how == "empty":
                data = b""
            elif data:
                data[offset % len(data)] ^= 1 << bit
            path.write_bytes(bytes(data))
        manifest = ckpt / MANIFEST
        changed = [ckpt / t.removeprefix(STEP + "/") for t in TARGETS if t.startswith(STEP + "/") and
                   (not (run / t).is_file() or (run / t).read_bytes() != original[t])]
        legacy = not manifest.exists()  # dropped, or deleted by the damage: nothing to verify against
        manifest_changed = manifest in changed and not legacy
        changed = [p for p in changed if p != manifest]

        with time_limit():
            problem = verify_checkpoint(ckpt)
        if not legacy:
            if not changed and not manifest_changed:
                assert problem is None
            else:  # a changed file never verifies, and the problem names it (any file, if the manifest changed)
                assert problem is not None and "\n" not in problem
                assert manifest_changed or any(str(p) in problem for p in changed), problem
        found = outcome(latest_checkpoint, run, warn=False)
        if found is None:  # a fresh start: nothing verifies, and no legacy checkpoint has its trainer state
            assert problem is not None and (not legacy or not (ckpt / "trainer_state.pt").is_file())
            return
        assert found == ckpt and (problem is None or legacy)
        names = changed + [p.parent for p in changed]  # a bad config.json is named, or its model directory
        results = [outcome(load_state, ckpt, names=names), outcome(from_pretrained, ckpt / "actor", names=names),
                   outcome(load_value_model, ckpt / "critic", names=names),
                   outcome(load_tokenizer, ckpt / "actor", names=names)]
        if not changed:  # an undamaged checkpoint always loads
            assert not any(isinstance(r, UserError) for r in results), results


@pytest.mark.parametrize("field, value, message", [
    ("num_key_value_heads", 3, "ValueError: num_attention_heads must be a multiple of num_key_value_heads"),
    ("num_key_value_heads", 0, "ZeroDivisionError"),
    ("rope_parameters", {"rope_type": "dgfault"}, "unsupported rope_scaling type 'dgfault'"),
    ("rope_scaling", {"rope_type": "linear"}, "KeyError: 'factor'"),
    ("rope_theta", "big", "ValueError: could not convert string to float"),
    ("architectures", 5, "TypeError"),
    (None, ["not", "an", "object"], "expected a JSON object, got list"),
])
def test_a_bad_model_config_value_is_a_one_line_error(pristine, tmp_path, field, value, message):
    """What single bit flips rarely reach in config.json: wrong types and impossible values, named with the file."""
    actor = tmp_path / "actor"
    shutil.copytree(pristine[0] / STEP / "actor", actor)
    hf = json.loads((actor / "config.json").read_text())
    if field is None:
        hf = value
    else:
        hf[field] = value
    (actor / "config.json").write_text(json.dumps(hf))
    error = outcome(from_pretrained, actor, names=[actor / "config.json"])
    assert isinstance(error, UserError) and message in str(error), error

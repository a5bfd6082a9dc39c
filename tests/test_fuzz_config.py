"""Fuzzed config input (tests/fuzzing.py has the property): YAML documents built from the real keys,
broken YAML text, `defaults:` chains and `key=value` overrides.
"""

import dataclasses
import functools
import json
import tempfile
import typing
from pathlib import Path

# first: importing it skips this module where there is no SIGALRM or no hypothesis
from fuzzing import ROOT, damaged, fuzz, ints, outcome, pick

from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nanokl.harness.config.schema import Config  # noqa: E402
from nanokl.harness.config.build import all_keys  # noqa: E402
from nanokl.harness.config.yaml_io import UserError  # noqa: E402
from nanokl.harness.config.load import load_config  # noqa: E402

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
                     "actor_rollout_ref.actor.objective=dpo", "trainer.resume_mode=resume_path",
                     "data.num_val=" + "9" * 5000, "data.seed=2024-13-45", "data.num_val=!!int x",
                     "++data.num_val=1", "+data.task=arith", "~data.num_val=256", "~data", "~data.nope", "~",
                     "trainer.project_name=${trainer.nope}", "trainer.project_name=${trainer.experiment_name}",
                     "trainer.experiment_name=${trainer.project_name}", "data.num_val=${data.num_train}",
                     "data.task=${oc.env:HOME}", "data.task=${.}", "data.task=${", "data.train_files=[~/a.jsonl]",
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
@yaml_case(b"", "data.train_files=&r [*r, '${trainer.seed}']")  # a list inside itself, through the interpolation
@yaml_case(b"actor_rollout_ref:\n  model:\n    lora_adapter_pat[h: 1\n")  # a "[" in a key: still located
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



"""Fuzzed data files (tests/fuzzing.py has the property): the prompt/GSM8K, logged-response and
preference readers over JSONL, JSON arrays and Parquet, valid rows mutated and files damaged.
"""

import contextlib
import functools
import json
import tempfile
from pathlib import Path

import pytest

# first: importing it skips this module where there is no SIGALRM or no hypothesis
from fuzzing import damaged, fuzz, ints, outcome, pick, tiny_tokenizer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from nanokl.harness.config.schema import DataConfig  # noqa: E402
from nanokl.harness.config.yaml_io import UserError  # noqa: E402
from nanokl.tasks.rows import read_examples, verl_row_to_example  # noqa: E402
from nanokl.harness.logged import read_logged  # noqa: E402
from nanokl.supervised.preference_data import read_preferences  # noqa: E402
from nanokl.tasks import TASKS  # noqa: E402

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



"""Rows: verl's row shape, the files rows come in, and the one-line error a user can fix.

A task (this folder) turns rows into examples; where its rows come from files, they come through
here. A file is JSONL, a JSON array or Parquet (`read_rows`). verl's preprocessing writes one
common row shape,

    {"data_source", "prompt": [{"role": "user", "content"}] or str, "reward_model": {"ground_truth"},
     "extra_info": {...}}

which `verl_row_to_example` reads for any task (data.prompt_key and data.reward_fn_key rename the
two fields; extra_info goes to a custom_reward_function as it is). A chat prompt may start with
one system message (kept as `system_prompt`); anything longer is not a single-turn prompt and is
refused. The chat itself is kept as `messages`.

A bad row is a `DataError` naming `file:line` (Parquet: `file:row i`, 0-based as pyarrow counts),
so the user fixes the data instead of reading a traceback. `DataError` is a `UserError`: every
mistake in what the user gave (config, paths, data) is one, printed as one line `error: ...` with
exit status 2 by the CLI (nanokl/harness/cli.py). It is defined here, in the lowest room that
reads the user's input; the harness and the supervised stages above raise the same class.
Examples read from files are `Located`: they carry their `file:line`, so that a check made after
loading can name it. tests/test_data.py checks every shape and every error.
"""

import json
import re
from pathlib import Path


class UserError(Exception):
    """A mistake in what the user gave us (config, paths, data): reported in one line, no traceback.

    Other modules raise it for user-fixable problems (a missing model directory, a malformed
    data line); the CLI prints it as `error: <message>` and exits with status 2."""


class DataError(UserError):
    """A malformed data file or row; the message starts with `file:line` (or `file:row i`)."""


class Located(dict):
    """An example that remembers the `file:line` it was read from (`where`), so that a check made after
    loading (the prompt's length, the ground truth: `check_loaded`) can name it. Equal to, and shown as,
    the plain dict; a copy made with {**ex} or a comprehension is a plain dict again."""
    __slots__ = ("where",)

    def __init__(self, example, where: str):
        super().__init__(example)
        self.where = where

    def __reduce__(self):  # pickles (and deep-copies) with its place
        return Located, (dict(self), self.where)


def where_of(ex, fallback: str) -> str:
    """The `file:line` an example was read from, or `fallback` (an example a task made itself)."""
    return getattr(ex, "where", None) or fallback


def without(ex: dict, key: str) -> dict:
    """`ex` less one field, keeping where it was read from."""
    rest = {k: v for k, v in ex.items() if k != key}
    return Located(rest, ex.where) if isinstance(ex, Located) else rest


def row_field(row: dict, name: str, types, where: str):
    """row[name], or a DataError naming `where` when it is missing or not of `types`."""
    if name not in row:
        raise DataError(f"{where}: missing field {name!r}")
    value = row[name]
    if not isinstance(value, types) or isinstance(value, bool):
        want = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise DataError(f"{where}: field {name!r} must be {want}, got {type(value).__name__}")
    return value


def _chat_prompt(messages: list, where: str) -> tuple[str, str | None]:
    """[system?, user] chat messages -> (user content, system content or None)."""
    ok = all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
             for m in messages)
    roles = [m["role"] for m in messages] if ok else []
    if roles == ["user"]:
        return messages[0]["content"], None
    if roles == ["system", "user"]:
        return messages[1]["content"], messages[0]["content"]
    raise DataError(f"{where}: a chat prompt must be [{{'role': 'user', 'content': str}}], optionally after "
                    f"one system message; got roles {roles if ok else 'malformed messages'}")


def verl_row_to_example(row, where: str, prompt_key: str = "prompt", reward_fn_key: str = "data_source") -> dict:
    """One verl-style row -> an example dict (or a DataError naming `where`)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    prompt = row_field(row, prompt_key, (str, list), where)
    system = None
    if isinstance(prompt, list):
        prompt, system = _chat_prompt(prompt, where)
    source = row_field(row, reward_fn_key, str, where)
    reward = row_field(row, "reward_model", dict, where)
    truth = row_field(reward, "ground_truth", (str, int), f"{where}: reward_model")
    ex = {"prompt": prompt, "ground_truth": str(truth), "data_source": source}
    if system is not None:
        ex["system_prompt"] = system
    if isinstance(row[prompt_key], list):  # the chat as given: the model's chat template renders it
        ex["messages"] = [dict(m) for m in row[prompt_key]]
    if isinstance(row.get("extra_info"), dict):  # verl's compute_score(..., extra_info) receives it
        ex["extra_info"] = row["extra_info"]
    return ex


def read_rows(path: Path):
    """Yield (where, row) for each row of a .jsonl / .json / .parquet file."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise UserError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow), "
                            "or convert the file to JSONL") from None
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a corrupt file, some with messages of many lines
            why = " ".join(f"{type(e).__name__}: {e}".split())
            raise DataError(f"{path}: not a readable Parquet file ({why})") from None
        # a Parquet table has every column in every row, null where a row has no such field: a null is
        # an absent field (else a file mixing chosen/rejected rows with responses rows reads as both)
        yield from ((f"{path}:row {i}", {k: v for k, v in row.items() if v is not None} if isinstance(row, dict) else row)
                    for i, row in enumerate(rows))
    elif suffix in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as f:
            try:
                text = f.read()
            except UnicodeDecodeError as e:  # e.object is the whole file: read() decodes it in one piece
                line = e.object[:e.start].count(b"\n") + 1
                raise DataError(f"{path}:{line}: not UTF-8 text (byte {e.object[e.start]:#04x})") from None
        if suffix == ".json" and text.lstrip().startswith("["):  # a .json file may hold one array
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{e.lineno}: bad JSON ({e.msg})") from None
            except (ValueError, RecursionError) as e:
                raise DataError(f"{path}: bad JSON ({_json_problem(e)})") from None
            escaped = _SURROGATE_ESCAPE.search(text) is not None
            yield from ((f"{path}:row {i}", _text_only(row, f"{path}:row {i}") if escaped else row)
                        for i, row in enumerate(rows))
            return
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue  # blank lines (a trailing newline, say) are not rows
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: bad JSON ({e.msg} at column {e.colno})") from None
            except (ValueError, RecursionError) as e:
                raise DataError(f"{path}:{lineno}: bad JSON ({_json_problem(e)})") from None
            yield f"{path}:{lineno}", _text_only(row, f"{path}:{lineno}") if _SURROGATE_ESCAPE.search(line) else row
    else:
        raise UserError(f"{path}: unknown data file type {suffix!r} (use .jsonl, .json or .parquet)")


def _json_problem(e: Exception) -> str:
    # json.loads also raises ValueError for an int of more digits than Python converts (4300), and
    # RecursionError for arrays or objects nested thousands deep
    return "nested too deeply" if isinstance(e, RecursionError) else str(e)


# JSON's \ud800..\udfff escapes: a pair is one character, a lone one decodes to a surrogate, which is
# not text (the tokenizer refuses it long after loading). Only rows with such an escape are checked.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _text_only(row, where: str):
    """`row`, or a DataError if a string in it holds a lone UTF-16 surrogate."""
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise DataError(f"{where}: a string holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape), "
                        "which is not text") from None
    return row


def read_examples(path_or_paths, to_example) -> list[dict]:
    """All examples of one file or a list of files, in order: `to_example(row, where)` per row
    (a task's row reader, e.g. verl_row_to_example)."""
    paths = [path_or_paths] if isinstance(path_or_paths, (str, Path)) else list(path_or_paths)
    examples = []
    for p in map(Path, paths):
        if not p.is_file():
            raise UserError(f"data file not found: {p}")
        before = len(examples)
        examples += [Located(to_example(row, where), where) for where, row in read_rows(p)]
        if len(examples) == before:
            raise DataError(f"{p}: no examples in the file")
    return examples

"""Prompt data: rows from JSONL/Parquet files, resumable batches, prompts as token ids.

What PPO needs from data is small: a list of prompts, each with what the task's rule must know
to score a response. Every task (nanokl/tasks/) returns the same plain shape, a list of dicts:

    {"prompt": str, "ground_truth": str, "data_source": str, "solution": str (optional),
     "system_prompt": str (optional), "messages": list (optional), "extra_info": dict (optional)}

This module holds what does not depend on the task:

1. Rows from files (`read_rows`, `read_examples`). A file is JSONL, a JSON array or Parquet; a
   task turns each row into an example. verl's preprocessing writes one common row shape,
   `{"data_source", "prompt": [{"role": "user", "content"}] or str, "reward_model":
   {"ground_truth"}, "extra_info": {...}}`, which `verl_row_to_example` reads for any task
   (data.prompt_key and data.reward_fn_key rename the two fields; extra_info goes to a
   custom_reward_function as it is). A chat prompt may start with one system message (kept as
   `system_prompt`); anything longer is not a single-turn prompt and is refused. The chat itself is
   kept as `messages`. A bad row is a `DataError` naming `file:line` (Parquet: `file:row i`,
   0-based as pyarrow counts), so the user fixes the data instead of reading a traceback.

2. Batches with exact resume (`batch_indices`). The batch of global step `s` is a pure
   function of (s, seed): epoch e = s // steps_per_epoch shuffles with seed + e, and the step
   takes its slice of that permutation. No sampler state to checkpoint: resuming at step k
   needs only k, and two ranks that agree on (k, seed) agree on the batch. (How a batch is
   then cut into micro-batches by token budget, or packed, is nanokl/engine/batching.py.)

3. Prompts -> token ids (`build_prompts`): an example's chat `messages` in the model's own chat
   template (as verl renders every prompt: tokenizer.apply_chat_template; data.return_raw_chat
   keeps them, nanokl/harness/tokenizer.py renders them), any other prompt in data.prompt_template;
   left-padded, so every row's response starts at the same position. `drop_overlong` is
   data.filter_overlong_prompts: the prompts longer than data.max_prompt_length once rendered are
   dropped when the data load, as verl's RLHFDataset drops them, and the count is said once.

4. Checks when the data load (`check_loaded`, called once by setup): the model's
   max_position_embeddings against data.max_prompt_length + the response length; every prompt
   non-empty and, with data.truncation=error, within data.max_prompt_length; every ground truth
   read by its task's rule (reward_fn.check_truths). Each failure is one line naming the file:line
   of the first bad row (examples read from files are `Located`: they carry it), where a step
   would stop steps later, by the row's place in its batch, or not at all.

tests/test_data.py checks: verl rows (JSONL, JSON array, Parquet, renamed keys) parse; bad rows
name file and line; batches cover each index once per epoch and are a pure function of the
step; templated prompts round-trip through the tokenizer; filter_overlong keeps exactly what fits.
"""

import functools
import json
import random
import re
from pathlib import Path

from nanokl.harness.config.yaml_io import UserError
from nanokl.harness.tokenizer import apply_template

# ---------------------------------------------------------------------------------------------
# 1. Rows from files: JSONL, a JSON array or Parquet; verl-style rows
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# 2. Stateless batches: the indices of global step `step`
# ---------------------------------------------------------------------------------------------

def steps_per_epoch(num_examples: int, batch_size: int, drop_last: bool = True) -> int:
    """Batches in one pass over the data; with drop_last the incomplete tail batch is skipped."""
    if batch_size < 1:
        raise UserError(f"batch size must be >= 1, got {batch_size}")
    n = num_examples // batch_size if drop_last else -(-num_examples // batch_size)
    if n == 0:
        raise UserError(f"{num_examples} examples cannot fill one batch of {batch_size} "
                        "(lower the batch size or add data)")
    return n


@functools.lru_cache(maxsize=4)  # consecutive steps share an epoch: shuffle once, not every step
def _permutation(num_examples: int, seed: int, shuffle: bool) -> tuple[int, ...]:
    order = list(range(num_examples))
    if shuffle:
        random.Random(seed).shuffle(order)
    return tuple(order)


def batch_indices(num_examples: int, batch_size: int, step: int, seed: int,
                  shuffle: bool = True, drop_last: bool = True) -> list[int]:
    """Example indices of global step `step` (0-based): a pure function, so resume needs only `step`."""
    spe = steps_per_epoch(num_examples, batch_size, drop_last)
    epoch, k = divmod(step, spe)
    order = _permutation(num_examples, seed + epoch, shuffle)  # a fresh permutation per epoch
    return list(order[k * batch_size:(k + 1) * batch_size])


def rank_rows(num_examples: int, batch_size: int, step: int, seed: int, shuffle: bool, rank: int, world: int):
    """This rank's slice of step `step`'s example indices (rank r takes the r-th of W equal parts)."""
    per_rank = batch_size // world
    return batch_indices(num_examples, batch_size, step, seed, shuffle)[rank * per_rank:(rank + 1) * per_rank]


def step_seed(seed: int, step: int, stream: int) -> int:
    """The seed of one random stream of step `step`: a pure function of (run seed, step, stream), so a
    resumed run draws what an unbroken one would. Streams: the rank (the rollout's sampling), the rank +
    104729 (the KL probe's), the row index (which logged responses an offline step draws)."""
    return seed * 1_000_003 + step * 8191 + stream


# ---------------------------------------------------------------------------------------------
# 3. Prompts -> token ids
# ---------------------------------------------------------------------------------------------

def prompt_text(ex: dict, tokenizer, template: str = "plain", system_prompt=None) -> str:
    """The text the model reads for example `ex`: its chat `messages` in the model's own chat
    template, else its prompt in `template` (a system message that came with the row wins over
    the run-wide `system_prompt`)."""
    if "messages" in ex:
        return tokenizer.apply_chat_template(ex["messages"], add_generation_prompt=True)
    return apply_template(ex["prompt"], template, ex.get("system_prompt", system_prompt))


def build_prompts(examples, tokenizer, template: str = "plain", max_length: int | None = None,
                  truncation: str = "error", system_prompt: str | None = None, device=None):
    """Left-padded (input_ids [B, T], attention_mask [B, T]) of the templated prompts."""
    texts = [prompt_text(ex, tokenizer, template, system_prompt) for ex in examples]
    return tokenizer.encode(texts, max_length=max_length, truncation=truncation, device=device)


def encode_prompts(examples, tokenizer, d, device=None):
    """build_prompts as the config's data section asks (template, max_prompt_length, truncation): how
    every prompt the run samples from is encoded."""
    return build_prompts(examples, tokenizer, d.prompt_template, d.max_prompt_length, d.truncation, device=device)


def filter_overlong(examples, tokenizer, template: str, max_length: int,
                    system_prompt: str | None = None) -> list[dict]:
    """The examples whose templated prompt fits in `max_length` tokens (data.filter_overlong_prompts)."""
    lengths = prompt_lengths(examples, tokenizer, template, system_prompt)
    return [ex for ex, n in zip(examples, lengths) if n <= max_length]


def prompt_lengths(examples, tokenizer, template: str, system_prompt: str | None = None) -> list[int]:
    """Each example's templated prompt, in tokens (as build_prompts encodes it)."""
    texts = [prompt_text(ex, tokenizer, template, system_prompt) for ex in examples]
    return [len(e.ids) for e in tokenizer.tok.encode_batch(texts, add_special_tokens=False)]


def drop_overlong(examples, tokenizer, data, what: str, say=print) -> list[dict]:
    """data.filter_overlong_prompts on one split (`what`: "training" or "validation"): the examples
    that fit data.max_prompt_length, after one line saying how many went."""
    kept = filter_overlong(examples, tokenizer, data.prompt_template, data.max_prompt_length)
    say(f"data.filter_overlong_prompts: dropped {len(examples) - len(kept)} of {len(examples)} {what} prompts "
        f"longer than {data.max_prompt_length} tokens")
    if examples and not kept:
        raise UserError(f"data.filter_overlong_prompts dropped every {what} prompt: none fits in "
                        f"data.max_prompt_length={data.max_prompt_length} tokens")
    return kept


# ---------------------------------------------------------------------------------------------
# 4. Checks when the data load: what would otherwise stop the run steps later
# ---------------------------------------------------------------------------------------------

def check_prompts(examples, tokenizer, data, what: str) -> None:
    """Every prompt of one split (`what`: "training" or "validation") has at least one token once
    templated and, with data.truncation=error, at most data.max_prompt_length: else a DataError naming
    the file:line of the first that does not (a step would refuse it only when its batch came up, by its
    place in the batch). Under filter_overlong_prompts the long ones were dropped already."""
    lengths = prompt_lengths(examples, tokenizer, data.prompt_template)
    limit = data.max_prompt_length if data.truncation == "error" and not data.filter_overlong_prompts else None
    for i, (ex, n) in enumerate(zip(examples, lengths)):
        where = where_of(ex, f"{what} example {i} (data.task={data.task})")
        if n == 0:
            raise DataError(f"{where}: the prompt is empty (0 tokens in data.prompt_template={data.prompt_template})")
        if limit is not None and n > limit:
            raise DataError(f"{where}: the {what} prompt has {n} tokens, over data.max_prompt_length={limit} "
                            "(set data.filter_overlong_prompts=true to drop such prompts, or "
                            "data.truncation=left|right to cut them)")


def check_positions(model_path, prompt_length: int, response_length: int, lengths: str, overrides=None) -> None:
    """prompt + response tokens within the model's max_position_embeddings (its config.json), else a
    UserError naming the file: past it the positions are ones the model never saw (RoPE runs on, silently).
    `lengths` says where the two numbers come from,
    e.g. "data.max_prompt_length (24) + data.max_response_length (32)"; `overrides`: model.override_config."""
    from nanokl.harness.hf_format import read_config  # torch-heavy: only when a run checks
    kw, _ = read_config(model_path, overrides)
    most = kw["max_position_embeddings"]
    if prompt_length + response_length > most:
        raise UserError(f"{Path(model_path) / 'config.json'}: max_position_embeddings={most}, but {lengths} = "
                        f"{prompt_length + response_length} positions: shorten them, or use a model with more "
                        "positions")


def check_loaded(cfg, tokenizer, train, val) -> None:
    """What setup checks once the examples are loaded, before any model is: the model's positions against
    the configured lengths, every prompt's length (check_prompts) and every ground truth read by its task's
    rule (reward_fn.check_truths). Each failure is one line naming the file:line or the key."""
    from nanokl.harness.reward_fn import check_truths  # it imports the tasks, which import this module
    d, ro = cfg.data, cfg.actor_rollout_ref.rollout
    response = f"data.max_response_length ({ro.response_length})" if ro.response_length == d.max_response_length \
        else f"actor_rollout_ref.rollout.response_length ({ro.response_length})"
    check_positions(cfg.actor_rollout_ref.model.path, d.max_prompt_length, ro.response_length,
                    f"data.max_prompt_length ({d.max_prompt_length}) + {response}",
                    cfg.actor_rollout_ref.model.override_config)
    splits = [("validation", val)] if d.offline_files else [("training", train), ("validation", val)]
    for what, examples in splits:  # offline: the logged rows are the training prompts, read (and checked) apart
        check_prompts(examples, tokenizer, d, what)
        check_truths(cfg, examples, what)

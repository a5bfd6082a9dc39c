"""Prompt data: resumable batches, prompts as token ids, the checks when the data load.

What PPO needs from data is small: a list of prompts, each with what the task's rule must know
to score a response. Every task (nanokl/tasks/) returns the same plain shape, a list of dicts:

    {"prompt": str, "ground_truth": str, "data_source": str, "solution": str (optional),
     "system_prompt": str (optional), "messages": list (optional), "extra_info": dict (optional)}

This module holds what does not depend on the task:

1. Rows from files are nanokl/tasks/rows.py's (`read_rows`, `read_examples`, verl's row shape,
   `DataError` naming file:line): a task reads its examples through them.

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
import random
from pathlib import Path

from nanokl.tasks.rows import DataError, UserError, where_of
from nanokl.harness.reward_fn import check_truths
from nanokl.harness.tokenizer import apply_template

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

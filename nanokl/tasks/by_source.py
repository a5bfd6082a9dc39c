"""No data.task: verl's data files as they are, each row scored by the rule its data_source names.

The idea
--------
verl never asks which task a run trains on. Its preprocessing scripts
(examples/data_preprocess/gsm8k.py, math_dataset.py, ...) write a `data_source` into every row,
and its default reward (verl/utils/reward_score/__init__.py: `default_compute_score`) picks the
rule from it: "openai/gsm8k" gets the GSM8K `#### N` match, "lighteval/MATH" a boxed-answer
match, and so on. One file may mix sources, and validation reports each one apart
(`val-core/<data_source>/acc/mean@n`).

This module is that, as a task: what `data.task` unset means when data files are given.

    examples   the rows of data.train_files / data.val_files in verl's shape (read by
               nanokl/tasks/rows.py: `verl_row_to_example`; data.prompt_key and data.reward_fn_key
               rename the two fields), in file order, whatever their data_source; a row of GSM8K's
               own JSONL ({"question", "answer"}) is read as tasks/gsm8k.py reads it
    score      the rule of the task whose SOURCE is the row's data_source (`SOURCE_TASKS`
               below; "openai/gsm8k" -> tasks/gsm8k.py, "arith" -> tasks/arith.py). A data_source
               with no rule is a one-line error, raised when the files load
               (nanokl/harness/reward_fn.py: `check_sources`), unless custom_reward_function names the
               user's own function, which then scores every row
    demonstrations  None: verl's rows carry no reference solution to imitate
    truth_problem   the ground truth as the row's data_source's task reads it (an unreadable one is
               refused when the data load, naming file:line: reward_fn.check_truths)

tests/test_reward_fn.py checks that a mixed file is scored row by row by each source's own rule.
"""

from nanokl.tasks import arith, gsm8k, math, math_dapo
from nanokl.tasks.rows import UserError, read_examples, verl_row_to_example

# SOURCE_TASKS: data_source -> the task whose rule scores it: {"arith": arith, "openai/gsm8k": gsm8k, "lighteval/MATH": math,
# ...}. A task names its source (SOURCE) or several (SOURCES, a tuple); the rule-only tasks math and math_dapo
# (no built-in data, so not in nanokl/tasks' TASKS) score the rows of data files that name their sources, as in
# verl's default_compute_score. PREFIX_TASKS: verl also routes every data_source starting with "aime" to
# math_dapo.
_RULES = (arith, gsm8k, math, math_dapo)
SOURCE_TASKS = {source: task for task in _RULES
           for source in getattr(task, "SOURCES", (task.SOURCE,) if hasattr(task, "SOURCE") else ())}
PREFIX_TASKS = {prefix: task for task in _RULES for prefix in getattr(task, "SOURCE_PREFIXES", ())}


def source_task(data_source: str):
    """The task whose rule scores rows of `data_source`, or a one-line UserError naming the known
    sources and the way to bring one's own rule."""
    if data_source not in SOURCE_TASKS:
        for prefix, task in PREFIX_TASKS.items():
            if data_source.startswith(prefix):
                return task
        known = [*SOURCE_TASKS, *(prefix + "*" for prefix in PREFIX_TASKS)]
        raise UserError(f"no reward rule for data_source {data_source!r} (known: {', '.join(known)}); "
                        "score it with your own function: custom_reward_function.path=<file.py> "
                        "custom_reward_function.name=<function>, or set data.task to score every row with one "
                        "task")
    return SOURCE_TASKS[data_source]


def examples(data, num_train=None, num_val=None, seed=0):
    """(train, val): the verl rows of data.train_files and data.val_files, in file order, the first
    `num_train` / `num_val` of them when given. `seed` is unused (PPO shuffles its batches itself)."""
    if not data.train_files:
        raise UserError("no prompts: set data.train_files (verl-format JSONL or Parquet rows), "
                        "or data.task to a built-in task (arith)")

    def row_to_example(row, where):
        if isinstance(row, dict) and data.prompt_key not in row and "question" in row:  # GSM8K's own JSONL
            return gsm8k.row_to_example(row, where)
        return verl_row_to_example(row, where, data.prompt_key, data.reward_fn_key)

    def read(files):
        return read_examples(files, row_to_example)
    train = read(data.train_files)
    val = read(data.val_files) if data.val_files and num_val != 0 else []
    return train[:num_train], val[:num_val]


def score(text, example, method="strict"):
    """The rule of the row's data_source (verl's default_compute_score)."""
    return source_task(example["data_source"]).score(text, example, method)


def truth_problem(ground_truth, example) -> str | None:
    """The row's data_source's task reads the truth (None: it can), or says what is wrong with it."""
    task = source_task(example["data_source"])
    return task.truth_problem(ground_truth, example) if hasattr(task, "truth_problem") else None


def answer(text, example, method="strict"):
    """The extracted answer by the row's data_source's task (None where that task extracts none)."""
    task = source_task(example["data_source"])
    return task.answer(text, example, method) if hasattr(task, "answer") else None


demonstrations = None

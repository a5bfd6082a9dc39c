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
               nanokl/harness/data.py: `verl_row_to_example`; data.prompt_key and data.reward_fn_key
               rename the two fields), in file order, whatever their data_source; a row of GSM8K's
               own JSONL ({"question", "answer"}) is read as tasks/gsm8k.py reads it
    score      the rule of the task whose SOURCE is the row's data_source (nanokl/tasks/__init__.py:
               SOURCES; "openai/gsm8k" -> tasks/gsm8k.py, "arith" -> tasks/arith.py). A data_source
               with no rule is a one-line error, raised when the files load
               (nanokl/harness/reward_fn.py: `check_sources`), unless custom_reward_function names the
               user's own function, which then scores every row
    demonstrations  None: verl's rows carry no reference solution to imitate
    truth_problem   the ground truth as the row's data_source's task reads it (an unreadable one is
               refused when the data load, naming file:line: reward_fn.check_truths)

tests/test_reward_fn.py checks that a mixed file is scored row by row by each source's own rule.
"""

from nanokl.harness.config.yaml_io import UserError
from nanokl.harness.data import read_examples, verl_row_to_example
from nanokl.tasks import gsm8k


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
    from nanokl.tasks import source_task  # the table imports this module: look it up when called
    return source_task(example["data_source"]).score(text, example, method)


def truth_problem(ground_truth, example) -> str | None:
    """The row's data_source's task reads the truth (None: it can), or says what is wrong with it."""
    from nanokl.tasks import source_task
    task = source_task(example["data_source"])
    return task.truth_problem(ground_truth, example) if hasattr(task, "truth_problem") else None


def answer(text, example, method="strict"):
    """The extracted answer by the row's data_source's task (None where that task extracts none)."""
    from nanokl.tasks import source_task
    task = source_task(example["data_source"])
    return task.answer(text, example, method) if hasattr(task, "answer") else None


demonstrations = None

"""Tasks: what PPO trains on, behind one small interface. `data.task` names one of TASKS.

A task is a plain module with three things (and a few optional ones), and nothing else in
nanokl names a task:

    examples(data, num_train=None, num_val=None, seed=0) -> (train, val)
        Two lists of example dicts,
            {"prompt": str, "ground_truth": str, "data_source": str,
             "solution": str (optional), "system_prompt": str (optional)}
        `data` is the config's `data` section: the task reads its own knobs there (the
        arithmetic task data.arith_*, GSM8K data.train_files ...). A count of None means the
        task's default. The task writes the prompt text; the trainer only wraps it in
        data.prompt_template and tokenizes it. `data_source` names the validation metric,
        val-core/<data_source>/acc/mean@n.

    score(text, example, method="strict") -> float
        The rule's verdict on one decoded response (1.0 right, 0.0 wrong, for both tasks here).
        `method` is reward_model.score_method, for a task that has more than one rule. The
        score is also the ground truth a learned reward model is checked against.

    result(text, example, method="strict") -> dict (optional)
        verl's other return shape, {"score": float, "acc": bool, ...} (tasks/math_dapo.py:
        {"score": +-1.0, "acc": bool, "pred": str}). When a task has it the trainer scores
        with it (harness/reward_fn.py): the reward is "score" (equal to `score`'s), the
        held-out accuracy val-core/<data_source>/acc is "acc", and the other numeric keys
        are logged as verl logs them (val-aux/<data_source>/<key>/mean@n).

    answer(text, example, method="strict") -> hashable or None (optional)
        The response's final answer as the rule reads it, for majority voting over validation
        samples (maj@k, nanokl/harness/val_metrics.py); a task without it gets no maj@k.

    demonstrations(examples, sft_cfg, seed) -> examples with a "solution" to imitate
        What the supervised warm start (nanokl/supervised/sft.py) trains on, or
        `demonstrations = None` for a task without any: its policy must come from elsewhere
        (actor_rollout_ref.model.path).

    truth_problem(ground_truth, example) -> str | None (optional)
        None when the rule can read the ground truth, else what is wrong with it ("is not an
        integer"). Every row's truth is checked when the data load (harness/reward_fn.py:
        `check_truths`), so a bad one is refused naming its file:line instead of failing, or
        silently scoring 0, at the step whose batch holds it. A task without it is not checked.

    SOURCE: str (optional)
        The data_source its examples carry. `SOURCES` maps each to its task, so a row of verl's
        data names its own rule, as verl's default_compute_score does: with data files and no
        data.task, every row is scored by the task of its data_source (nanokl/tasks/by_source.py).

The same seed gives the same examples in the same order, so a run, its resume and its reward
model all see the same prompts. A new task is one file here, one line in TASKS, and its test
(tests/test_tasks.py shows a task defined in the test alone driving train_ppo.py).
"""

from nanokl.harness.config.yaml_io import UserError
from nanokl.tasks import arith, by_source, gsm8k, math, math_dapo

TASKS = {"arith": arith, "gsm8k": gsm8k}

# data_source -> the task whose rule scores it: {"arith": arith, "openai/gsm8k": gsm8k, "lighteval/MATH": math, ...}.
# A task names its source (SOURCE) or several (SOURCES, a tuple); the rule-only tasks math and math_dapo
# (no built-in data, so not in TASKS) score the rows of data files that name their sources, as in verl's
# default_compute_score. SOURCE_PREFIXES: verl also routes every data_source starting with "aime" to math_dapo.
_RULES = (*TASKS.values(), math, math_dapo)
SOURCES = {source: task for task in _RULES
           for source in getattr(task, "SOURCES", (task.SOURCE,) if hasattr(task, "SOURCE") else ())}
SOURCE_PREFIXES = {prefix: task for task in _RULES for prefix in getattr(task, "SOURCE_PREFIXES", ())}


def get_task(name: str | None):
    """The task module called `name` (None: rows from data files, each scored by its data_source),
    or a UserError listing the known ones."""
    if name is None:
        return by_source
    if name not in TASKS:
        raise UserError(f"unknown task {name!r} (data.task; known: {', '.join(TASKS)})")
    return TASKS[name]


def source_task(data_source: str):
    """The task whose rule scores rows of `data_source`, or a one-line UserError naming the known
    sources and the way to bring one's own rule."""
    if data_source not in SOURCES:
        for prefix, task in SOURCE_PREFIXES.items():
            if data_source.startswith(prefix):
                return task
        known = [*SOURCES, *(prefix + "*" for prefix in SOURCE_PREFIXES)]
        raise UserError(f"no reward rule for data_source {data_source!r} (known: {', '.join(known)}); "
                        "score it with your own function: custom_reward_function.path=<file.py> "
                        "custom_reward_function.name=<function>, or set data.task to score every row with one task")
    return SOURCES[data_source]

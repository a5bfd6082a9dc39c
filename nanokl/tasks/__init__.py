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
        The data_source its examples carry (or SOURCES, a tuple of several). `SOURCE_TASKS`
        (nanokl/tasks/by_source.py) maps each to its task, so a row of verl's data names its own
        rule, as verl's default_compute_score does: with data files and no data.task, every row
        is scored by the task of its data_source.

The same seed gives the same examples in the same order, so a run, its resume and its reward
model all see the same prompts. A new task is one file here, one line in TASKS, and its test
(tests/test_tasks.py shows a task defined in the test alone driving train_ppo.py).
"""

from nanokl.tasks import arith, by_source, gsm8k
from nanokl.tasks.by_source import SOURCE_TASKS, source_task  # noqa: F401 (the table is by_source's)
from nanokl.tasks.rows import UserError

TASKS = {"arith": arith, "gsm8k": gsm8k}


def get_task(name: str | None):
    """The task module called `name` (None: rows from data files, each scored by its data_source),
    or a UserError listing the known ones."""
    if name is None:
        return by_source
    if name not in TASKS:
        raise UserError(f"unknown task {name!r} (data.task; known: {', '.join(TASKS)})")
    return TASKS[name]

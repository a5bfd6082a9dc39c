"""Tasks: what PPO trains on, behind one small interface. `data.task` names one of TASKS.

A task is a plain module with three things, and nothing else in nanokl names a task:

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

    demonstrations(examples, sft_cfg, seed) -> examples with a "solution" to imitate
        What the supervised warm start (nanokl/supervised/sft.py) trains on, or
        `demonstrations = None` for a task without any: its policy must come from elsewhere
        (actor_rollout_ref.model.path).

The same seed gives the same examples in the same order, so a run, its resume and its reward
model all see the same prompts. A new task is one file here, one line in TASKS, and its test
(tests/test_tasks.py shows a task defined in the test alone driving train_ppo.py).
"""

from nanokl.harness.config_io import UserError
from nanokl.tasks import arith, gsm8k

TASKS = {"arith": arith, "gsm8k": gsm8k}


def get_task(name: str):
    """The task module called `name`, or a UserError listing the known ones."""
    if name not in TASKS:
        raise UserError(f"unknown task {name!r} (data.task; known: {', '.join(TASKS)})")
    return TASKS[name]

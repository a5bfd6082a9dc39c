"""verl's reward hook: which function scores a response, and the loop that calls it.

The idea
--------
A rule-based reward in verl is one plain function,

    compute_score(data_source, solution_str, ground_truth, extra_info) -> float  (or {"score": float, ...})

and a *reward manager* is the loop around it. verl's `naive` manager
(verl/workers/reward_manager/naive.py) takes the responses one by one: decode the response's
tokens (special tokens skipped), call the function with the row's data_source, its
`reward_model.ground_truth` and its `extra_info`, and put the returned score on the response's
last token; every other token gets 0 (nanokl/rewards.py: `token_level_scores`). nanokl has that
manager only (`reward_model.reward_manager=naive`); verl's batched and prime managers differ in
how they parallelise the calls, not in what a score means.

Which function (`scorer`), in this order:
  1. `custom_reward_function.path` and `.name`: the user's function, imported from that one file
     (importlib, from the path as given: nothing else on sys.path is searched), once per run. It
     scores every row whatever its data_source: how a verl user brings a task nanokl has no rule
     for. A dict it returns gives its "score" (verl's managers do the same).
  2. `data.task`, when set: that task's rule for every row (nanokl's tasks; nanokl/tasks/).
  3. Otherwise each row's data_source picks the rule, as verl's `default_compute_score` does
     (verl/utils/reward_score/__init__.py): nanokl/tasks/ `SOURCES` maps "openai/gsm8k" to GSM8K's
     `#### N` match and "arith" to the arithmetic task's. A data_source with no rule is refused
     when the data load (`check_sources`: one line naming the known ones), not at the first step.

All three become one shape, `score(text, example) -> float`, which the training step and
validation call alike (nanokl/harness/scoring.py). tests/test_reward_fn.py checks a custom function
against a hand-written loop over the same rows, the one-line errors, and the data_source dispatch.
"""

import functools
import hashlib
import importlib.util
import sys
from pathlib import Path

from nanokl.harness.config_io import UserError
from nanokl.tasks import get_task, source_task


@functools.lru_cache(maxsize=4)  # imported once per run, however often the step asks for it
def load_custom(path: str, name: str):
    """Function `name` of the Python file `path` (custom_reward_function), or a one-line UserError."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"custom_reward_function.path: no such file {path!r}")
    # a name of its own per file, registered so that the file's dataclasses and pickling find it
    module_name = "nanokl_custom_reward_" + hashlib.sha256(str(file.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise UserError(f"custom_reward_function.path: {path!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's code: say what broke, on one line
        del sys.modules[module_name]
        raise UserError(f"custom_reward_function.path: importing {path!r} failed "
                        f"({type(e).__name__}: {' '.join(str(e).split())})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                         and getattr(v, "__module__", None) == module_name)
        raise UserError(f"custom_reward_function.name: {path!r} has no function {name!r} "
                        f"(it defines: {', '.join(defined) or 'none'})")
    return fn


def _custom(cfg):
    """(path, name) of custom_reward_function, or None when no path is set."""
    crf = cfg.custom_reward_function
    return (crf.path, crf.name) if crf.path else None


def scorer(cfg):
    """`score(text, example) -> float` for this config (the module docstring's three cases)."""
    method, custom = cfg.reward_model.score_method, _custom(cfg)
    if custom is not None:
        fn = load_custom(*custom)

        def score(text, ex):
            out = fn(data_source=ex["data_source"], solution_str=text, ground_truth=ex["ground_truth"],
                     extra_info=ex.get("extra_info", {}))
            return float(out["score"] if isinstance(out, dict) else out)  # verl: a dict carries "score"
        return score
    task_score = get_task(cfg.data.task).score  # data.task None: the row's data_source picks (tasks/by_source.py)
    return lambda text, ex: task_score(text, ex, method)


def answerer(cfg):
    """`answer(text, example)` for maj@k: the task's answer extraction (nanokl/tasks/, `answer`), or
    None when a custom function scores (its answers are its own) or the task extracts none."""
    task = get_task(cfg.data.task)
    if _custom(cfg) is not None or not hasattr(task, "answer"):
        return None
    method = cfg.reward_model.score_method
    return lambda text, ex: task.answer(text, ex, method)


def check_sources(cfg, examples) -> None:
    """Fail before any model loads: a custom function that does not import, or (case 3) a row
    whose data_source no rule scores."""
    custom = _custom(cfg)
    if custom is not None:
        load_custom(*custom)
    elif cfg.data.task is None:
        for source in sorted({ex["data_source"] for ex in examples}):
            source_task(source)  # the one-line error for an unknown one


def naive(score, texts, examples) -> list[float]:
    """verl's naive reward manager: one call per response, in batch order. A row without a ground
    truth (a logged row scored by a reward model) gets nan: no rule can judge it."""
    return [score(text, ex) if "ground_truth" in ex else float("nan") for text, ex in zip(texts, examples)]


# reward_model.reward_manager -> its loop. verl's `prime` calls the same function on the same
# responses, only in parallel processes: the same scores, so it is the naive loop here
REWARD_MANAGERS = {"naive": naive, "prime": naive}


def manager(cfg):
    """reward_model.reward_manager's loop."""
    name = cfg.reward_model.reward_manager
    if name not in REWARD_MANAGERS:
        raise UserError(f"reward_model.reward_manager={name} is not in nanokl (known: {', '.join(REWARD_MANAGERS)})")
    return REWARD_MANAGERS[name]

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
     for. A dict it returns gives its "score" (verl's managers do the same); anything else that is
     not a number is refused (`reward_value`).
  2. `data.task`, when set: that task's rule for every row (nanokl's tasks; nanokl/tasks/).
  3. Otherwise each row's data_source picks the rule, as verl's `default_compute_score` does
     (verl/utils/reward_score/__init__.py): nanokl/tasks/ `SOURCES` maps "openai/gsm8k" to GSM8K's
     `#### N` match and "arith" to the arithmetic task's. A data_source with no rule is refused
     when the data load (`check_sources`: one line naming the known ones), not at the first step.

All three become one shape, `score(text, example) -> float`, which the training step and
validation call alike (nanokl/harness/scoring.py), each call through `call`: a function that raises,
returns something that is not a number (a str such as "1.0", None, a dict without a numeric "score";
a bool counts, as verl's tensor assignment takes it) or a number that is not finite stops the run as a
`RewardError`, one line naming the function, the response and its row's data_source (and
extra_info index): train_ppo.main saves a checkpoint of the steps done and exits 1, where a traceback
would lose them and a NaN would surface steps later as a "non-finite loss". Under torchrun every rank
stops together (`agree`). A ground truth the task's rule cannot read is refused before that, when the
data load (`check_truths`).

tests/test_reward_fn.py checks a custom function against a hand-written loop over the same rows, the
one-line errors, and the data_source dispatch; tests/test_bad_input.py and test_faults_more.py the
refusals and the stop.
"""

import functools
import hashlib
import importlib.util
import math
import numbers
import sys
from pathlib import Path

import torch

from nanokl import dist
from nanokl.harness.config_io import UserError
from nanokl.harness.data import DataError, where_of
from nanokl.harness.run_state import TrainingStopped
from nanokl.tasks import get_task, source_task


class RewardError(TrainingStopped):
    """The reward function raised, returned what is not a number, or a number that is not finite. A stop
    (exit 1) after a checkpoint of the steps done (train_ppo.main), not a user error found at load."""


class _NotANumber(RewardError):
    """A custom function's return value that is no reward: (what it returned, why that is no reward);
    `call` adds the function and the row."""

    def __str__(self):
        return ": ".join(self.args)


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


def _shown(value) -> str:
    text = repr(value)
    return f"{text if len(text) <= 60 else text[:57] + '...'} ({type(value).__name__})"


def reward_value(out) -> float:
    """A reward function's return value -> float: a number (bool, int, float, a numpy or one-element torch
    scalar) or verl's dict with a numeric "score". Anything else is a _NotANumber saying what it was."""
    value = out
    if isinstance(out, dict):  # verl's managers take a dict's "score" (its other keys are extra metrics)
        if "score" not in out:
            raise _NotANumber(f"returned a dict without a 'score' ({_shown(out)})", _REWARD_IS)
        value = out["score"]
    if isinstance(value, torch.Tensor) and value.numel() == 1 or type(value).__module__ == "numpy" and \
            getattr(value, "size", 0) == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):
        shown = _shown(value) if value is out else f"{_shown(out)}, whose 'score' is {_shown(value)}"
        raise _NotANumber(f"returned {shown}", _REWARD_IS)
    return float(value)


_REWARD_IS = "a reward is a number, or a dict with a numeric 'score' (verl's two shapes)"


def scorer(cfg):
    """`score(text, example) -> float` for this config (the module docstring's three cases); its `what`
    names it in errors."""
    method, custom = cfg.reward_model.score_method, _custom(cfg)
    if custom is not None:
        fn = load_custom(*custom)

        def score(text, ex):
            return reward_value(fn(data_source=ex["data_source"], solution_str=text, ground_truth=ex["ground_truth"],
                                   extra_info=ex.get("extra_info", {})))
        score.what = f"custom_reward_function {custom[1]} ({custom[0]})"
        return score
    task_score = get_task(cfg.data.task).score  # data.task None: the row's data_source picks (tasks/by_source.py)

    def rule(text, ex):
        return task_score(text, ex, method)
    rule.what = f"data.task={cfg.data.task}'s rule" if cfg.data.task else "the rule of the row's data_source"
    return rule


def call(score, text, ex, which: str) -> float:
    """score(text, ex), or a RewardError naming the function, `which` response ("response 3 of the batch")
    and its row's data_source (and extra_info index) when it raises, returns no number or a non-finite one."""
    extra = ex.get("extra_info")
    index = f", extra_info index {extra['index']!r}" if isinstance(extra, dict) and "index" in extra else ""
    row = f"{which} (data_source {ex.get('data_source')!r}{index})"
    what = getattr(score, "what", getattr(score, "__name__", "the reward function"))
    try:
        value = score(text, ex)
    except _NotANumber as e:
        returned, why = e.args
        raise RewardError(f"{what} {returned} for {row}: {why}") from None
    except UserError:  # a rule's own one-line refusal (an unknown score method): the config's to fix, exit 2
        raise
    except Exception as e:  # the user's code: what broke, on one line
        raise RewardError(f"{what} raised {type(e).__name__}: {' '.join(str(e).split())} for {row}") from None
    if not math.isfinite(value):
        raise RewardError(f"{what} returned {value} for {row}: a reward must be finite")
    return value


def agree(failed: RewardError | None) -> None:
    """Raise on every rank when the reward failed on any (a collective under torchrun; the failing rank
    says why on its stderr, rank 0 on the command line), so that all stop together and save together."""
    if dist.world() > 1:
        anyone = dist.all_reduce(torch.tensor(float(failed is not None)), op="max").item() > 0
        if failed is not None and dist.rank() != 0:
            print(f"rank {dist.rank()}: {failed}", file=sys.stderr)
        if anyone and failed is None:
            failed = RewardError("the reward function failed on another rank (its stderr says how)")
    if failed is not None:
        raise failed


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


def check_truths(cfg, examples, what: str = "training") -> None:
    """Every ground truth read by the rule that will score its row (the task's `truth_problem`; with
    data.task unset the row's data_source's task), else a DataError naming its file:line. Skipped when
    a custom_reward_function scores: its truths are its own to read."""
    if _custom(cfg) is not None:
        return
    task = get_task(cfg.data.task)
    problem_of = getattr(task, "truth_problem", None)
    if problem_of is None:
        return
    for i, ex in enumerate(examples):
        if "ground_truth" in ex and (problem := problem_of(ex["ground_truth"], ex)) is not None:
            where = where_of(ex, f"{what} example {i} (data.task={cfg.data.task})")
            raise DataError(f"{where}: ground truth {ex['ground_truth']!r} {problem}")


def naive(score, texts, examples) -> list[float]:
    """verl's naive reward manager: one call per response, in batch order (each through `call`). A row
    without a ground truth (a logged row scored by a reward model) gets nan: no rule can judge it."""
    return [call(score, text, ex, f"response {i} of the batch") if "ground_truth" in ex else float("nan")
            for i, (text, ex) in enumerate(zip(texts, examples))]


# reward_model.reward_manager -> its loop. verl's `prime` calls the same function on the same
# responses, only in parallel processes: the same scores, so it is the naive loop here
REWARD_MANAGERS = {"naive": naive, "prime": naive}


def manager(cfg):
    """reward_model.reward_manager's loop."""
    name = cfg.reward_model.reward_manager
    if name not in REWARD_MANAGERS:
        raise UserError(f"reward_model.reward_manager={name} is not in nanokl (known: {', '.join(REWARD_MANAGERS)})")
    return REWARD_MANAGERS[name]

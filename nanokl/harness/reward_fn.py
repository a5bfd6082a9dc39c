"""verl's reward hook: which function scores a response, and the loop that calls it.

The idea
--------
A rule-based reward in verl is one plain function,

    compute_score(data_source, solution_str, ground_truth, extra_info) -> float  (or {"score": float, ...})

and a *reward manager* is the loop around it. verl's `naive` manager
(verl/workers/reward_manager/naive.py) takes the responses one by one: decode the response's
tokens (special tokens skipped), call the function with the row's data_source, its
`reward_model.ground_truth` and its `extra_info`, and put the returned score on the response's
last token; every other token gets 0 (nanokl/rewards.py: `token_level_scores`). verl's prime and dapo
managers call the function the same way (prime in a process pool: the same scores). verl's `batch`
manager (verl/workers/reward_manager/batch.py) calls a custom function ONCE for the batch, with lists:
`fn(data_sources=[...], solution_strs=[...], ground_truths=[...], extra_infos=[...])`, and reads the list
it returns, a number or verl's dict per response, in order (`batched`; a list of another length is a
fault); nanokl does the same in training and validation (a chunk of val_batch_size prompts a call). Without
a custom function the batch manager scores with the task's rule, one response at a time (the same scores).
`custom_reward_function.reward_kwargs` (a dict) are passed to the custom function as keyword arguments on
every call, as verl's get_custom_reward_fn wraps it.

Which function (`scorer`), in this order:
  1. `custom_reward_function.path` and `.name`: the user's function, imported from that one file
     (importlib, from the path as given: nothing else on sys.path is searched), once per run. It
     scores every row whatever its data_source: how a verl user brings a task nanokl has no rule
     for. A dict it returns gives its "score" and more (below); anything else that is not a number is
     refused (`reward_value`).
  2. `data.task`, when set: that task's rule for every row (nanokl's tasks; nanokl/tasks/).
  3. Otherwise each row's data_source picks the rule, as verl's `default_compute_score` does
     (verl/utils/reward_score/__init__.py): nanokl/tasks/by_source.py's `SOURCE_TASKS` maps "openai/gsm8k" to GSM8K's
     `#### N` match and "arith" to the arithmetic task's. A data_source with no rule is refused
     when the data load (`check_sources`: one line naming the known ones), not at the first step.

All three become one shape, `score(text, example) -> Reward`, which the training step and
validation call alike (nanokl/harness/scoring.py), each call through `call`. A faulty reward stops the
run as a `RewardError`, one line naming the function, the response and its row's data_source (and
extra_info index), and harness/after_step.py saves a checkpoint of the steps done and exits 1, where
the fault itself would lose them:
  - a function that raises (a traceback), or exits: sys.exit() raises SystemExit, which would end the
    run on the spot with the function's status, 0 included (a KeyboardInterrupt passes: Ctrl-C);
  - one that returns something that is not a number (a str such as "1.0", None, a dict without a
    numeric "score"; a bool counts, as verl's tensor assignment takes it), or a number whose float32 is
    not finite (`finite32`: nan, inf, and 1e39, finite as a Python float but inf in the reward tensor),
    which would surface steps later as a "non-finite loss";
  - a custom function's call still running after custom_reward_function.timeout seconds (300 by
    default; null or <= 0: none), which would hang the run for ever: SIGALRM stops it where it is
    (harness/call_limit.py; each batch's calls under one handler, ~2 us a call). Under the batch manager
    the limit bounds its one call for the batch.
Under torchrun every rank stops together (`agree`). A ground truth the task's rule cannot read is
refused before that, when the data load (`check_truths`).

Dict rewards. verl's managers (naive.py, dapo.py in verl/workers/reward_manager/) accept a dict such as
{"score": 1.0, "acc": True, "pred": "42"}: "score" is the reward on the last token, and every key
(score included) goes into `reward_extra_info`. verl's trainer logs none of those keys per training
step (ray_trainer.fit puts them beside the batch, for DAPO's filter_groups.metric and the
rollout_data_dir dump); its validation averages each numeric one per data source
(ray_trainer._validate, metric_utils.process_validation_metrics), with "acc", when present, as the
core variable: val-core/<source>/acc/mean@n, val-aux/<source>/<key>/mean@n for the others and
val-aux/<source>/reward/mean@n for the reward itself. A `Reward` is that float with the dict's keys
beside it (`info`; {} for a number): its `acc` ("acc" when reported, else the reward) is the rule's
accuracy the step returns (critic/rule_score, filter_groups' "acc") and validation's val-core, and
nanokl/harness/scoring.py logs the other numeric keys under verl's validation names. A task's rule
returns verl's dict by having `result` (nanokl/tasks/math_dapo.py: {"score": +-1, "acc": bool, "pred"}),
so its held-out accuracy is 0/1, not the +-1 score. A dict's other values must be numbers or bools
(averaged), strings or None (verl's "pred", not averaged); anything else, a non-finite number, a key
that is not a string or the key "reward" (validation's own name for the score) stops the run as above.

tests/test_reward_fn.py checks a custom function against a hand-written loop over the same rows, the
one-line errors, and the data_source dispatch; tests/test_bad_input.py and test_faults_more.py the
refusals and the stop; tests/test_reward_faults.py an exit, a float32 overflow and a timeout.
"""

import functools
import hashlib
import importlib.util
import numbers
import sys
from pathlib import Path

import torch

from nanokl.engine import dist
from nanokl.harness import call_limit
from nanokl.harness.config.verl_keys import REWARD_MANAGERS
from nanokl.harness.config.yaml_io import UserError
from nanokl.tasks.rows import DataError, where_of
from nanokl.harness.run_state import TrainingStopped
from nanokl.tasks import get_task
from nanokl.tasks.by_source import source_task


class RewardError(TrainingStopped):
    """The reward function raised or exited, ran past custom_reward_function.timeout, returned what is not a
    number, or a number whose float32 is not finite. A stop (exit 1) after a checkpoint of the steps done
    (train_ppo.main), not a user error found at load."""


class Reward(float):
    """One response's reward: the float that goes on its last token, and `info`, the keys of the dict
    the function returned (verl's reward_extra_info of the response: "score", "acc", "pred", ...; {} when
    it returned a number). Arithmetic on it gives plain floats."""

    def __new__(cls, value, info=None):
        self = super().__new__(cls, value)
        self.info = info or {}
        return self

    @property
    def acc(self) -> float:
        """The response's accuracy: the dict's "acc" when it has one (verl's val-core variable), else
        the reward itself (what nanokl has always reported as acc for a number)."""
        return float(self.info["acc"]) if "acc" in self.info else float(self)


def accuracy(reward) -> float:
    """`Reward.acc`, and a plain float (a row without a ground truth: nan) as it is."""
    return reward.acc if isinstance(reward, Reward) else float(reward)


class _Refused(RewardError):
    """A custom function's call that gave no reward: (what it returned or did, why that is no reward);
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
    except (Exception, SystemExit) as e:  # the user's code: say what broke, on one line (an exit too)
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


def _scalar(value):
    """A numpy scalar or one-element tensor as the Python number it holds; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 or type(value).__module__ == "numpy" and \
            getattr(value, "size", 0) == 1:
        return value.item()
    return value


def reward_value(out) -> Reward:
    """A reward function's return value -> Reward: a number (bool, int, float, a numpy or one-element torch
    scalar) or verl's dict with a numeric "score", whose keys become the Reward's `info` (numbers and bools,
    strings and None; numpy and torch scalars as Python ones). Anything else is a _Refused saying what
    it was."""
    if not isinstance(out, dict):
        value = _scalar(out)
        if not isinstance(value, numbers.Real):
            raise _Refused(f"returned {_shown(out)}", _REWARD_IS)
        if not finite32(value):
            raise _Refused(f"returned {_shown(out)}", f"a reward must be {_FINITE32}")
        return Reward(float(value))
    if "score" not in out:  # verl's managers read result["score"]: a KeyError there
        raise _Refused(f"returned a dict without a 'score' ({_shown(out)})", _REWARD_IS)
    info = {}
    for key, raw in out.items():
        value = _scalar(raw)
        if key == "score" and not isinstance(value, numbers.Real):
            raise _Refused(f"returned {_shown(out)}, whose 'score' is {_shown(value)}", _REWARD_IS)
        if key == "acc" and not isinstance(value, numbers.Real):
            raise _Refused(f"returned a dict whose 'acc' is {_shown(value)}", _ACC_IS)
        if not isinstance(key, str) or key == "reward":
            raise _Refused(f"returned a dict with the key {key!r}", _KEYS_ARE)
        if not (value is None or isinstance(value, (numbers.Real, str))):
            raise _Refused(f"returned a dict whose {key!r} is {_shown(value)}", _EXTRA_IS)
        if isinstance(value, numbers.Real) and not finite32(value):
            raise _Refused(f"returned a dict whose {key!r} is {value}", f"a reward's numbers must be {_FINITE32}")
        info[key] = value
    return Reward(float(info["score"]), info)


_REWARD_IS = "a reward is a number, or a dict with a numeric 'score' (verl's two shapes)"
_EXTRA_IS = ("a reward dict's other values are numbers or bools (averaged in validation, as verl's "
             "reward_extra_info) or strings and None (verl's 'pred', not averaged)")
_ACC_IS = "a reward dict's 'acc' is the response's accuracy: a number or a bool (verl's val-core variable)"
_KEYS_ARE = "a reward dict's keys are strings, and 'reward' is taken (validation's name for the score, as verl's)"
_FINITE32 = "finite in float32, the reward tensor's dtype (|x| < 3.4028235e38)"
# the least |x| that float32 rounds to inf: its largest number plus half its last step (round to nearest even)
_FLOAT32_END = 2.0 ** 128 - 2.0 ** 103


def finite32(value) -> bool:
    """`value` (any real: a float, an int of any size, a bool) is a finite float32: not nan, not inf, and not a
    finite Python float such as 1e39 that becomes inf in the reward tensor (torch.tensor of floats is float32)
    and would surface steps later as a "non-finite loss"."""
    return -_FLOAT32_END < value < _FLOAT32_END  # False for nan; exact for ints past float's range


def scorer(cfg):
    """`score(text, example) -> Reward` for this config (the module docstring's three cases); its `what`
    names it in errors. A task's rule that has `result` (verl's dict) is read through it, else its
    `score` (a float) is."""
    method, custom = cfg.reward_model.score_method, _custom(cfg)
    if custom is not None:
        fn, limit = load_custom(*custom), cfg.custom_reward_function.timeout
        kwargs = dict(cfg.custom_reward_function.reward_kwargs or {})  # verl's functools.partial-like wrap

        def limited(**given):
            try:  # a call past the limit is stopped where it is (harness/call_limit.py: SIGALRM)
                return call_limit.within(limit, fn, **given, **kwargs)
            except call_limit.Expired:
                raise _Refused(f"did not return within {limit:g} s", f"custom_reward_function.timeout={limit:g} "
                               "bounds each call (raise it, or null: no limit)") from None

        def score(text, ex):
            return reward_value(limited(data_source=ex["data_source"], solution_str=text,
                                        ground_truth=ex["ground_truth"], extra_info=ex.get("extra_info", {})))
        score.what = f"custom_reward_function {custom[1]} ({custom[0]})"
        if cfg.reward_model.reward_manager == "batch":  # verl's BatchRewardManager: one call, lists (`batched`)
            score.batch = lambda texts, exs: limited(
                data_sources=[ex["data_source"] for ex in exs], solution_strs=list(texts),
                ground_truths=[ex["ground_truth"] for ex in exs], extra_infos=[ex.get("extra_info", {}) for ex in exs])
        return score
    task = get_task(cfg.data.task)  # data.task None: the row's data_source picks (tasks/by_source.py)

    def rule(text, ex):
        row_task = task if cfg.data.task else source_task(ex["data_source"])
        if hasattr(row_task, "result"):  # verl's dict: the score, and "acc", "pred", ... beside it
            return reward_value(row_task.result(text, ex, method))
        return Reward(task.score(text, ex, method))
    rule.what = f"data.task={cfg.data.task}'s rule" if cfg.data.task else "the rule of the row's data_source"
    return rule


def call(score, text, ex, which: str) -> Reward:
    """score(text, ex) as a Reward (a number or verl's dict read by `reward_value`), or a RewardError naming
    the function, `which` response ("response 3 of the batch") and its row's data_source (and extra_info
    index) when it raises or exits, runs past its timeout, or returns no number or one not finite in float32.
    A KeyboardInterrupt passes: Ctrl-C is the user's (harness/faults.py), no fault of the function."""
    extra = ex.get("extra_info")
    index = f", extra_info index {extra['index']!r}" if isinstance(extra, dict) and "index" in extra else ""
    row = f"{which} (data_source {ex.get('data_source')!r}{index})"
    what = named(score)
    try:
        value = score(text, ex)
        if not isinstance(value, Reward):  # a score function of a test's own, or a rule's bare float
            value = reward_value(value)
    except _Refused as e:
        returned, why = e.args
        raise RewardError(f"{what} {returned} for {row}: {why}") from None
    except UserError:  # a rule's own one-line refusal (an unknown score method): the config's to fix, exit 2
        raise
    except Exception as e:  # the user's code: what broke, on one line
        raise RewardError(f"{what} raised {type(e).__name__}: {' '.join(str(e).split())} for {row}") from None
    except SystemExit as e:  # sys.exit() in the function would end the run at once: no checkpoint, no line
        raise RewardError(f"{what} raised SystemExit (exit status {e.code!r}) for {row}: a reward function "
                          "must return its score, not end the process") from None
    if not finite32(value):  # a rule's Reward, which reward_value has not read
        raise RewardError(f"{what} returned {value} for {row}: a reward must be {_FINITE32}")
    return value


def named(score) -> str:
    """How errors name a score function: its `what`, else its __name__."""
    return getattr(score, "what", getattr(score, "__name__", "the reward function"))


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
    """verl's naive reward manager: one call per response, in batch order (each through `call`: a Reward,
    whose `info` holds a dict return's keys). A row without a ground truth (a logged row scored by a reward
    model) gets nan: no rule can judge it."""
    with call_limit.handler():  # SIGALRM's handler once for the batch: each call's limit then costs ~2 us
        return [call(score, text, ex, f"response {i} of the batch") if "ground_truth" in ex else float("nan")
                for i, (text, ex) in enumerate(zip(texts, examples))]


def batched(score, texts, examples, which=None) -> list[float]:
    """verl's batch reward manager: the custom function (score.batch) called once with the lists of the rows
    that have a ground truth; each value it returned read as `call` reads one (a number or verl's dict, finite
    in float32), errors naming the function and the response. A row without a ground truth gets nan, as in
    `naive`; a scorer without `batch` (a task's rule) is the naive loop. `which` names each response."""
    which = which or [f"response {i} of the batch" for i in range(len(texts))]
    fn = getattr(score, "batch", None)
    if fn is None:
        with call_limit.handler():
            return [call(score, t, ex, w) if "ground_truth" in ex else float("nan")
                    for t, ex, w in zip(texts, examples, which)]
    keep = [i for i, ex in enumerate(examples) if "ground_truth" in ex]
    what, rows = named(score), f"the batch of {len(keep)} responses"
    try:
        with call_limit.handler():
            outs = fn([texts[i] for i in keep], [examples[i] for i in keep]) if keep else []
    except _Refused as e:
        returned, why = e.args
        raise RewardError(f"{what} {returned} for {rows}: {why}") from None
    except Exception as e:  # the user's code: what broke, on one line
        raise RewardError(f"{what} raised {type(e).__name__}: {' '.join(str(e).split())} for {rows}") from None
    except SystemExit as e:
        raise RewardError(f"{what} raised SystemExit (exit status {e.code!r}) for {rows}: a reward function "
                          "must return its scores, not end the process") from None
    if isinstance(outs, (str, bytes, dict)) or not hasattr(outs, "__len__") or len(outs) != len(keep):
        raise RewardError(f"{what} returned {_shown(outs)} for {rows}: under reward_model.reward_manager=batch "
                          f"it returns a list of {len(keep)} scores (a number or a dict with 'score' each), in order")
    rewards = [float("nan")] * len(texts)
    for i, out in zip(keep, list(outs)):
        given = lambda _text, _ex, out=out: reward_value(out)  # noqa: E731 (`call` reads it, naming the row)
        given.what = what
        rewards[i] = call(given, texts[i], examples[i], which[i])
    return rewards


# reward_model.reward_manager -> its loop. verl's `prime` calls the same function on the same
# responses, only in parallel processes: the same scores, so it is the naive loop here
# verl's reward_manager names nanokl takes (config/verl_keys.py): each scores one response at a time, but batch
MANAGERS = {**dict.fromkeys(REWARD_MANAGERS, naive), "batch": batched}


def manager(cfg):
    """reward_model.reward_manager's loop."""
    name = cfg.reward_model.reward_manager
    if name not in MANAGERS:
        raise UserError(f"reward_model.reward_manager={name} is not in nanokl (known: {', '.join(MANAGERS)})")
    return MANAGERS[name]

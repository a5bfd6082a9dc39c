"""The built-in arithmetic task: short sums a 2-layer model learns on a CPU in minutes.

The idea
--------
A CPU run needs a task a tiny model can learn quickly and whose answers a rule can check:
short arithmetic with a chain of thought of one step per operation, written one digit per
token (see nanokl/harness/tokenizer.py),

    prompt    "Q: 37+48-12=?\\nA:"
    solution  " 37+48=85\\n85-12=73\\n#### 73"

`solution` is the demonstration the SFT warm start imitates; it ends in GSM8K's `#### N` form
so the same format is graded on both tasks. Steps are one per line and without spaces because
every character costs a token here: the default difficulty (3 operands in 0..99, + and -)
gives prompts of 12-15 tokens and responses of 16-27 (mean 24), before the EOS.
`ArithDifficulty` (the config's `data.arith_*` keys) is the knob for whoever tunes PPO: more
operands, a wider range or `*` (ordinary precedence: products first) make the warm-started
policy less accurate.

Train and validation are disjoint *by construction*: a problem goes to validation iff a hash of
its text says so (1 problem in 8), whatever the seed or the counts, so no training set of any
seed or size (SFT's included) ever contains a validation prompt. Each split is then sampled
without repeats from its side of the hash, from its own seeded stream, so the first 100
training examples are the same whether one asks for 100 or 10000.

The rule (`arith_score`): the last `#### N` in the response's last 300 characters, and N must
be an integer equal to the truth (so "#### 7.5" is not 7, and "Answer: 7" is no answer).

The warm start (`demonstrations`, `mix_answer_formats`): a share `sft.alt_answer_share` of the
demonstrations end with "Answer: N" instead of "#### N", as if two teachers agreed on the
arithmetic but not on the format. The rule reads only "#### N", so a policy that imitates the
majority "Answer:" teacher scores nothing until RL finds out which format is rewarded.

The task interface (nanokl/tasks/__init__.py): `examples`, `score`, `answer`, `demonstrations`,
`truth_problem` (a ground truth that is not an integer is refused when the data load).
tests/test_tasks.py checks: the task is deterministic per seed and its splits are disjoint;
every demonstration's answer equals one recomputed by a hand parser in the test (no eval);
every demonstration scores 1 and corrupted ones 0; the format mix is seeded.
"""

import dataclasses
import hashlib
import random
import re

from nanokl.tasks.rows import UserError

SOURCE = "arith"  # the examples' data_source: validation logs val-core/arith/acc/mean@n


@dataclasses.dataclass(frozen=True)
class ArithDifficulty:
    num_operands: int = 3  # numbers in one problem (one reasoning step per operator)
    max_operand: int = 99  # operands are drawn uniformly from 0..max_operand
    ops: str = "+-"  # operators to draw from, any of "+-*"; "*" binds tighter, as usual


VAL_SHARE = 8  # one problem in VAL_SHARE belongs to the validation side of the hash


def _is_val_problem(expr: str) -> bool:
    # sha256, not hash(): Python salts str hashes per process, and the split must never move
    return hashlib.sha256(expr.encode()).digest()[0] % VAL_SHARE == 0


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _solve(nums: list[int], ops: list[str]) -> tuple[list[str], int]:
    """The demonstration's steps "a op b=c", one per operator: products first, then left to right."""
    nums, ops, steps = list(nums), list(ops), []
    for wanted in ("*", "+-"):  # two passes: precedence without a parser
        i = 0
        while i < len(ops):
            if ops[i] in wanted:
                c = _apply(nums[i], ops[i], nums[i + 1])
                steps.append(f"{nums[i]}{ops[i]}{nums[i + 1]}={c}")
                nums[i:i + 2], ops[i:i + 1] = [c], []
            else:
                i += 1
    return steps, nums[0]


def _arith_example(nums, ops) -> dict:
    expr = str(nums[0]) + "".join(f"{op}{n}" for op, n in zip(ops, nums[1:]))
    steps, answer = _solve(nums, ops)
    return {"prompt": f"Q: {expr}=?\nA:", "ground_truth": str(answer), "data_source": SOURCE,
            "solution": " " + "\n".join(steps) + f"\n#### {answer}"}


def make_arith_task(num_train: int, num_val: int, seed: int,
                    difficulty: ArithDifficulty = ArithDifficulty()) -> tuple[list[dict], list[dict]]:
    """(train, val) example lists of the synthetic task; see the module docstring."""
    d = difficulty
    if d.num_operands < 2 or d.max_operand < 1 or not d.ops or set(d.ops) - set("+-*"):
        raise UserError(f"bad arithmetic difficulty {d}: need num_operands >= 2, max_operand >= 1 "
                        "and ops drawn from '+-*'")
    if num_train < 0 or num_val < 0:
        raise UserError(f"num_train and num_val must be >= 0, got {num_train} and {num_val}")
    ops = sorted(set(d.ops))
    distinct = (d.max_operand + 1) ** d.num_operands * len(ops) ** (d.num_operands - 1)

    def sample(split: str, n: int, want_val: bool) -> list[dict]:
        # a string seed: random.Random hashes it with sha512, stable across runs and machines
        rng, seen, out = random.Random(f"arith/{split}/{seed}"), set(), []
        for _ in range(50 * n + 10_000):  # rejection sampling; the cap turns a too-small space into an error
            if len(out) == n:
                return out
            nums = [rng.randint(0, d.max_operand) for _ in range(d.num_operands)]
            picked = [rng.choice(ops) for _ in range(d.num_operands - 1)]
            ex = _arith_example(nums, picked)
            if ex["prompt"] not in seen and _is_val_problem(ex["prompt"]) == want_val:
                seen.add(ex["prompt"])
                out.append(ex)
        if len(out) == n:
            return out
        raise UserError(f"arithmetic difficulty {d} has about {distinct // VAL_SHARE} distinct validation "
                        f"and {distinct - distinct // VAL_SHARE} training problems; cannot draw {n} "
                        f"{split} problems without repeats (ask for fewer or raise the difficulty)")

    return sample("train", num_train, False), sample("val", num_val, True)


def arith_difficulty(data) -> ArithDifficulty:
    """The difficulty the config's `data.arith_*` keys describe."""
    return ArithDifficulty(data.arith_num_operands, data.arith_max_operand, data.arith_ops)


# The same answer format as GSM8K's strict rule (nanokl/tasks/gsm8k.py), kept here so that each
# task stays one self-contained file; only the tail is read, where the final answer sits.
CLIP_CHARS = 300
_ANSWER = re.compile(r"#### (-?[0-9.,]+)")
_INTEGER = re.compile(r"-?[0-9]+")


def extract_arith_answer(solution_str: str) -> str | None:
    """The N of the last `#### N` in the response's tail, as written ("7", "07", "7.5"), or None."""
    found = _ANSWER.findall(solution_str[-CLIP_CHARS:])
    return found[-1] if found else None


def arith_score(solution_str: str, ground_truth) -> float:
    """1.0 if the last `#### N` is an integer equal to the ground truth, else 0.0."""
    found = extract_arith_answer(solution_str)
    if found is None or not _INTEGER.fullmatch(found):
        return 0.0
    return 1.0 if int(found) == int(ground_truth) else 0.0


def mix_answer_formats(examples, share: float, seed: int) -> list[dict]:
    """Copies of the examples in which a `share` of the demonstrations (chosen with `seed`) end
    with "Answer: N" instead of "#### N": see the module docstring."""
    rng = random.Random(f"formats/{seed}")
    out = []
    for ex in examples:
        if rng.random() < share:
            ex = {**ex, "solution": ex["solution"].replace("\n#### ", "\nAnswer: ")}
        out.append(ex)
    return out


# ---------------------------------------------------------------------------------------------
# The task interface
# ---------------------------------------------------------------------------------------------

def examples(data, num_train=None, num_val=None, seed=0):
    """(train, val): `num_train` / `num_val` problems (None: data.num_train / data.num_val) of the
    difficulty data.arith_* describes."""
    if data.train_files or data.val_files:  # a user who gave files surely did not mean synthetic sums
        raise UserError("data.task=arith makes its own problems and reads no files, but data.train_files or "
                        "data.val_files is set: set data.task to the task those files hold (e.g. gsm8k)")
    return make_arith_task(data.num_train if num_train is None else num_train,
                           data.num_val if num_val is None else num_val, seed, arith_difficulty(data))


def score(text, example, method="strict"):
    """The rule's verdict on one response; there is one rule, so `method` is ignored."""
    return arith_score(text, example["ground_truth"])


def truth_problem(ground_truth, example=None) -> str | None:
    """None when the rule can read `ground_truth` (an integer, as `arith_score` reads it: int(truth)),
    else what is wrong with it. Checked when the data load (reward_fn.check_truths), not at the step
    whose response first writes a `#### N`."""
    try:
        int(ground_truth)
        return None
    except (TypeError, ValueError):
        return "is not an integer, which the arithmetic rule compares the response's '#### N' with"


def answer(text, example, method="strict"):
    """The response's final answer for majority voting (maj@k): an integer as the number it is
    ("07" and "7" vote together), anything else as written, None when there is no `#### N`."""
    found = extract_arith_answer(text)
    return str(int(found)) if found is not None and _INTEGER.fullmatch(found) else found


def demonstrations(examples, sft_cfg, seed):
    """The examples with their solutions in the two teachers' formats (sft.alt_answer_share)."""
    return mix_answer_formats(examples, sft_cfg.alt_answer_share, seed)

"""Prompt datasets: a built-in arithmetic task, GSM8K from JSONL/Parquet, and resumable batches.

What PPO needs from data is small: a list of prompts, each with what the reward function must
know to score a response (`ground_truth`, and `data_source` naming which scorer to use; see
nanokl/reward.py). Every loader here returns the same plain shape, a list of dicts:

    {"prompt": str, "ground_truth": str, "data_source": str, "solution": str (optional),
     "system_prompt": str (optional)}

1. The synthetic task (`make_arith_task`). A CPU run needs a task a 2-layer model can learn in
   minutes, whose answers a rule can check: short arithmetic with a chain of thought of one
   step per operation, written one digit per token (see nanokl/harness/tokenizer.py),

       prompt    "Q: 37+48-12=?\\nA:"
       solution  " 37+48=85\\n85-12=73\\n#### 73"

   `solution` is the demonstration the SFT warm start imitates; it ends in GSM8K's `#### N`
   form so one strict scorer reads both tasks. Steps are one per line and without spaces
   because every character costs a token here: the default difficulty (3 operands in 0..99,
   + and -) gives prompts of 12-15 tokens and responses of 16-27 (mean 24), before the EOS. `ArithDifficulty` is the knob for whoever tunes
   PPO: more operands, a wider range or `*` (ordinary precedence: products first) make the
   warm-started policy less accurate. Train and validation are disjoint *by construction*: a
   problem goes to validation iff a hash of its text says so (1 problem in 8), whatever the
   seed or the counts, so no training set of any seed or size (SFT's included) ever contains
   a validation prompt. Each split is then sampled without repeats from its side of the hash,
   from its own seeded stream, so the first 100 training examples are the same whether one
   asks for 100 or 10000.

2. GSM8K (Cobbe et al. 2021) from files, as verl's `examples/data_preprocess/gsm8k.py`
   prepares it: the prompt is the question followed by
   ` Let's think step by step and output the final answer after "####".`, the ground truth is
   the text after `#### ` in the reference answer with commas removed, and the data_source is
   "openai/gsm8k". `load_examples` reads raw rows `{"question", "answer"}` and also the rows
   that verl's preprocessing writes, `{"data_source", "prompt": [{"role": "user", "content"}]
   or str, "reward_model": {"ground_truth"}}`. A chat prompt may start with one system
   message (kept as `system_prompt`); anything longer is not a single-turn prompt and is
   refused. A bad row is a `UserError` naming `file:line` (Parquet: `file:row i`, 0-based as
   pyarrow counts), so the user fixes the data instead of reading a traceback.

3. Batches with exact resume (`batch_indices`). The batch of global step `s` is a pure
   function of (s, seed): epoch e = s // steps_per_epoch shuffles with seed + e, and the step
   takes its slice of that permutation. No sampler state to checkpoint: resuming at step k
   needs only k, and two ranks that agree on (k, seed) agree on the batch.

Not here yet: token-budget micro-batching and sequence packing (a later issue adds them).

tests/test_data.py checks: the task is deterministic per seed and its splits are disjoint;
every demonstration's answer equals one recomputed by a hand parser in the test (no eval);
GSM8K's test file loads to 1319 prompts with verl's instruction; bad rows name file and line;
batches cover each index once per epoch; templated prompts round-trip through the tokenizer.
"""

import dataclasses
import functools
import hashlib
import json
import random
from pathlib import Path

from nanokl.harness.config_io import UserError
from nanokl.harness.tokenizer import apply_template

GSM8K_SOURCE = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


# ---------------------------------------------------------------------------------------------
# 1. The built-in arithmetic task
# ---------------------------------------------------------------------------------------------

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
    return {"prompt": f"Q: {expr}=?\nA:", "ground_truth": str(answer), "data_source": "arith",
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


def arith_difficulty(data_cfg) -> ArithDifficulty:
    """The difficulty the config's `data.arith_*` keys describe."""
    return ArithDifficulty(data_cfg.arith_num_operands, data_cfg.arith_max_operand, data_cfg.arith_ops)


def mix_answer_formats(examples, share: float, seed: int) -> list[dict]:
    """Copies of the examples in which a `share` of the demonstrations (chosen with `seed`) end
    with "Answer: N" instead of "#### N": two teachers who agree on the arithmetic but not on the
    format. The graders (nanokl/reward.py) read only "#### N", so a policy that imitates the
    majority "Answer:" teacher scores nothing until RL finds out which format is rewarded."""
    rng = random.Random(f"formats/{seed}")
    out = []
    for ex in examples:
        if rng.random() < share:
            ex = {**ex, "solution": ex["solution"].replace("\n#### ", "\nAnswer: ")}
        out.append(ex)
    return out


def task_texts(examples) -> list[str]:
    """prompt + solution of each example: the text the tokenizer and the SFT warm start learn from."""
    return [ex["prompt"] + ex["solution"] for ex in examples]


# ---------------------------------------------------------------------------------------------
# 2. Examples from files: GSM8K raw rows and verl-style rows, JSONL or Parquet
# ---------------------------------------------------------------------------------------------

class DataError(UserError):
    """A malformed data file or row; the message starts with `file:line` (or `file:row i`)."""


def _field(row: dict, name: str, types, where: str):
    if name not in row:
        raise DataError(f"{where}: missing field {name!r}")
    value = row[name]
    if not isinstance(value, types) or isinstance(value, bool):
        want = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise DataError(f"{where}: field {name!r} must be {want}, got {type(value).__name__}")
    return value


def _chat_prompt(messages: list, where: str) -> tuple[str, str | None]:
    """[system?, user] chat messages -> (user content, system content or None)."""
    ok = all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
             for m in messages)
    roles = [m["role"] for m in messages] if ok else []
    if roles == ["user"]:
        return messages[0]["content"], None
    if roles == ["system", "user"]:
        return messages[1]["content"], messages[0]["content"]
    raise DataError(f"{where}: a chat prompt must be [{{'role': 'user', 'content': str}}], optionally after "
                    f"one system message; got roles {roles if ok else 'malformed messages'}")


def row_to_example(row, where: str, prompt_key: str = "prompt", reward_fn_key: str = "data_source") -> dict:
    """One raw GSM8K row or one verl-style row -> an example dict (or a DataError naming `where`)."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    if prompt_key not in row and ("question" in row or "answer" in row):  # raw GSM8K
        question = _field(row, "question", str, where)
        answer = _field(row, "answer", str, where)
        if "#### " not in answer:
            raise DataError(f"{where}: field 'answer' has no '#### <number>' final answer")
        truth = answer.rsplit("#### ", 1)[1].strip().replace(",", "")
        return {"prompt": question + " " + GSM8K_INSTRUCTION, "ground_truth": truth,
                "data_source": GSM8K_SOURCE, "solution": answer}
    prompt = _field(row, prompt_key, (str, list), where)
    system = None
    if isinstance(prompt, list):
        prompt, system = _chat_prompt(prompt, where)
    source = _field(row, reward_fn_key, str, where)
    reward = _field(row, "reward_model", dict, where)
    truth = _field(reward, "ground_truth", (str, int), f"{where}: reward_model")
    ex = {"prompt": prompt, "ground_truth": str(truth), "data_source": source}
    if system is not None:
        ex["system_prompt"] = system
    return ex


def read_rows(path: Path):
    """Yield (where, row) for each row of a .jsonl / .json / .parquet file."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise UserError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow), "
                            "or convert the file to JSONL") from None
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a corrupt file
            raise DataError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
        yield from ((f"{path}:row {i}", row) for i, row in enumerate(rows))
    elif suffix in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if suffix == ".json" and text.lstrip().startswith("["):  # a .json file may hold one array
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{e.lineno}: bad JSON ({e.msg})") from None
            yield from ((f"{path}:row {i}", row) for i, row in enumerate(rows))
            return
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue  # blank lines (a trailing newline, say) are not rows
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: bad JSON ({e.msg} at column {e.colno})") from None
            yield f"{path}:{lineno}", row
    else:
        raise UserError(f"{path}: unknown data file type {suffix!r} (use .jsonl, .json or .parquet)")


def load_examples(path_or_paths, prompt_key: str = "prompt", reward_fn_key: str = "data_source") -> list[dict]:
    """All examples of one file or a list of files, in order (GSM8K raw or verl-style rows)."""
    paths = [path_or_paths] if isinstance(path_or_paths, (str, Path)) else list(path_or_paths)
    examples = []
    for p in map(Path, paths):
        if not p.is_file():
            raise UserError(f"data file not found: {p}")
        before = len(examples)
        examples += [row_to_example(row, where, prompt_key, reward_fn_key) for where, row in read_rows(p)]
        if len(examples) == before:
            raise DataError(f"{p}: no examples in the file")
    return examples


# ---------------------------------------------------------------------------------------------
# 3. Stateless batches: the indices of global step `step`
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


# ---------------------------------------------------------------------------------------------
# 4. Prompts -> token ids
# ---------------------------------------------------------------------------------------------

def _templated(ex: dict, template: str, system_prompt):
    # a system message that came with the row (verl chat prompts) wins over the run-wide one
    return apply_template(ex["prompt"], template, ex.get("system_prompt", system_prompt))


def build_prompts(examples, tokenizer, template: str = "plain", max_length: int | None = None,
                  truncation: str = "error", system_prompt: str | None = None, device=None):
    """Left-padded (input_ids [B, T], attention_mask [B, T]) of the templated prompts."""
    texts = [_templated(ex, template, system_prompt) for ex in examples]
    return tokenizer.encode(texts, max_length=max_length, truncation=truncation, device=device)


def filter_overlong(examples, tokenizer, template: str, max_length: int,
                    system_prompt: str | None = None) -> list[dict]:
    """The examples whose templated prompt fits in `max_length` tokens (data.filter_overlong_prompts)."""
    texts = [_templated(ex, template, system_prompt) for ex in examples]
    lengths = [len(e.ids) for e in tokenizer.tok.encode_batch(texts, add_special_tokens=False)]
    return [ex for ex, n in zip(examples, lengths) if n <= max_length]

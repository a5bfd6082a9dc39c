"""GSM8K: grade-school math word problems (Cobbe et al. 2021), read from files, scored by a rule.

The data
--------
Prompts come from `data.train_files` / `data.val_files` (JSONL, JSON or Parquet; nothing is
downloaded), prepared as verl's `examples/data_preprocess/gsm8k.py` prepares them: the prompt
is the question followed by

    ` Let's think step by step and output the final answer after "####".`

the ground truth is the text after `#### ` in the reference answer with commas removed, and the
data_source is "openai/gsm8k" (so validation logs `val-core/openai/gsm8k/acc/mean@n`). A file
may hold raw rows `{"question", "answer"}` or the rows verl's preprocessing writes (parsed by
nanokl/tasks/rows.py: `verl_row_to_example`); those must say data_source "openai/gsm8k",
since this task scores every row with GSM8K's rule. A bad row is a `UserError` naming
`file:line` (Parquet: `file:row i`), so the user fixes the data instead of reading a traceback.

The rule
--------
The reward needs no learned model: a rule reads the answer from the generated text and
compares it with the ground truth (ReFT, Trung et al. 2024; verl's
`verl/utils/reward_score/gsm8k.py`). The rule never evaluates the text, only matches it.

`gsm8k_score(solution, truth, method)`:
  - "strict" takes the last `#### N`, N matching `-?[0-9.,]+`. It rewards the format the
    prompt asked for, so a right number said any other way scores 0.
  - "flexible" takes the last number anywhere (same pattern), skipping a match that is only
    punctuation ("." or ",", e.g. the "." ending a sentence with no number before it).
  - In both, commas and `$` are stripped and the result compared with the ground truth as a
    *string*: `score` if equal, `format_score` if an answer was found but differs, 0 if none.
    String equality is deliberately no looser than verl: "18.0", "18.00" and "018" do not
    equal "18", and a sentence-final period sticks to the number ("is 18." reads "18.", which
    is wrong), exactly as in verl. Users comparing scores with verl's get the same numbers.
  - Only the last 300 characters are searched, as verl does: the final answer sits at the end,
    and a regex over a long degenerate response (thousands of digits) is slow enough to stall
    the reward step. The price: a response whose final answer is followed by more than 300
    characters of text is read from its tail only.
`reward_model.score_method` picks strict or flexible.

Demonstrations: a raw row's reference answer is a worked solution ending in `#### N`, so the
rows that have one can warm-start a policy by SFT; verl-style rows carry none.

The task interface (nanokl/tasks/__init__.py): `examples`, `score`, `demonstrations`, `truth_problem`
(a ground truth no answer can equal, "" or "n/a", is refused when the data load, naming file:line).
tests/test_tasks.py checks: the test file loads to 1319 prompts with verl's instruction; every
reference answer scores 1 against its own ground truth (strict); the flexible rule agrees with
the `is_correct` labels of OpenAI's released model solutions; hand cases for commas, `$`,
negatives, decimals and clipping.
"""

import re

from nanokl.tasks.rows import UserError
from nanokl.tasks.rows import DataError, read_examples, row_field, verl_row_to_example

SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

CLIP_CHARS = 300  # verl's _SOLUTION_CLIP_CHARS: search only the tail, where the answer is
_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9.,]+")


def _clean(s) -> str:
    return str(s).replace(",", "").replace("$", "").strip()


def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The final answer as a string with commas and `$` stripped, or None if there is none."""
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return _clean(found[-1]) if found else None
    if method == "flexible":
        for raw in reversed(_NUMBER.findall(tail)):
            if any(c.isdigit() for c in raw):  # "." or "," alone (the pattern allows them) is punctuation
                return _clean(raw)
        return None
    raise UserError(f"unknown GSM8K score method {method!r} (valid: strict, flexible)")


def gsm8k_score(solution_str: str, ground_truth, method: str = "strict",
                format_score: float = 0.0, score: float = 1.0) -> float:
    """`score` if the extracted answer equals the ground truth, `format_score` if not, 0 if none."""
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == _clean(ground_truth) else format_score


def row_to_example(row, where: str, prompt_key: str = "prompt", reward_fn_key: str = "data_source") -> dict:
    """One raw GSM8K row or one verl-style GSM8K row -> an example dict (or a DataError naming `where`)."""
    if isinstance(row, dict) and prompt_key not in row and ("question" in row or "answer" in row):  # raw GSM8K
        question = row_field(row, "question", str, where)
        answer = row_field(row, "answer", str, where)
        if "#### " not in answer:
            raise DataError(f"{where}: field 'answer' has no '#### <number>' final answer")
        truth = answer.rsplit("#### ", 1)[1].strip().replace(",", "")
        return {"prompt": question + " " + INSTRUCTION, "ground_truth": truth, "data_source": SOURCE,
                "solution": answer}
    ex = verl_row_to_example(row, where, prompt_key, reward_fn_key)
    if ex["data_source"] != SOURCE:  # refused here, at load time, rather than mis-scored later
        raise DataError(f"{where}: {reward_fn_key} {ex['data_source']!r} is not {SOURCE!r}: data.task=gsm8k "
                        "scores every row with GSM8K's rule")
    return ex


def load_examples(path_or_paths, prompt_key: str = "prompt", reward_fn_key: str = "data_source") -> list[dict]:
    """All examples of one file or a list of files, in order."""
    return read_examples(path_or_paths, lambda row, where: row_to_example(row, where, prompt_key, reward_fn_key))


# ---------------------------------------------------------------------------------------------
# The task interface
# ---------------------------------------------------------------------------------------------

def examples(data, num_train=None, num_val=None, seed=0):
    """(train, val): the rows of data.train_files and data.val_files, in file order (PPO shuffles
    its batches itself), the first `num_train` / `num_val` of them when given. `seed` is unused."""
    if not data.train_files:
        raise UserError("data.task=gsm8k reads its prompts from files: set data.train_files (and "
                        "data.val_files) to GSM8K's train.jsonl / test.jsonl or verl's parquet")
    train = load_examples(data.train_files, data.prompt_key, data.reward_fn_key)
    val = []
    if data.val_files and num_val != 0:
        val = load_examples(data.val_files, data.prompt_key, data.reward_fn_key)
    return train[:num_train], val[:num_val]


def score(text, example, method="strict"):
    """1.0 if the response's answer (strict `#### N`, or flexible: the last number) equals the truth."""
    return gsm8k_score(text, example["ground_truth"], method)


def truth_problem(ground_truth, example=None) -> str | None:
    """None when the rule can match `ground_truth`: once commas and `$` are stripped, a number as the rule
    extracts one (`-?[0-9.,]+` with a digit). Else what is wrong: no response could ever equal it, so the
    row would score 0 whatever the policy wrote. Checked when the data load (reward_fn.check_truths)."""
    truth = _clean(ground_truth)
    if _NUMBER.fullmatch(truth) and any(c.isdigit() for c in truth):
        return None
    return ("is not a number, so no answer can equal it (GSM8K's rule compares the response's final "
            "number with it, commas and $ stripped)")


def answer(text, example, method="strict"):
    """The extracted final answer (strict or flexible, as the score reads it) for maj@k; None if none."""
    return extract_gsm8k_answer(text, method)


def demonstrations(examples, sft_cfg, seed):
    """The examples that carry a reference solution (raw rows), as they are."""
    demos = [ex for ex in examples if "solution" in ex]
    if not demos:
        raise UserError("no GSM8K row here has a reference solution to imitate (verl-style rows carry none): "
                        "use raw {question, answer} rows, or start from a model that needs no warm start")
    return demos


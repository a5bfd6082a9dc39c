"""DAPO's math rule: the last "Answer: ..." line, normalised Minerva-style, +1 right / -1 wrong.

The data
--------
No built-in dataset: rows come from `data.train_files` (data.task unset, each row scored by its
data_source, nanokl/tasks/by_source.py), e.g. DAPO-Math-17k and the AIME sets of verl's DAPO
recipe, whose prompts ask for the final answer on its own line after "Answer:". Ground truths
are short strings (AIME: an integer such as "204"). verl's default_compute_score
(verl/utils/reward_score/__init__.py) sends data_source "math_dapo", "math",
"math_dapo_reasoning" and every name starting with "aime" ("aime24", "aime_2025", ...) to
`verl/utils/reward_score/math_dapo.py: compute_score`, which this module mirrors: `SOURCES`
and `SOURCE_PREFIXES`.

The rule (`dapo_result`)
------------------------
Only the response's last 300 characters are read (verl: the longest MATH-500 answer is 159
characters). Two ways to read them:

Minerva (verl's default; nanokl's score_method "strict", and "flexible" too: DAPO has no
flexible rule): the answer is the text after the last "Answer:" (any case, spaces around the
colon allowed) up to the end of its line; no such line reads as "[INVALID]". The answer and the
ground truth are each put through `normalize_final_answer` and compared as strings:
  1. keep what follows the last "=";
  2. SUBSTITUTIONS, in order, each a plain replace: "an " and "a " vanish (inside a word too:
     "Cuba 5" -> "Cub5"), ".$" -> "$", "\\$" and "\\ " and every space vanish,
     "mbox" -> "text", ",\\text{and}" and "\\text{and}" -> ",", "\\text{m}" -> "\\text{}";
  3. REMOVED_EXPRESSIONS, in order, each deleted wherever it occurs: unit words ("cm", "feet",
     "degrees", "dollars", ...; inside other words too: "acme" loses its "cm"), "\\ldots",
     "\\dots", "\\text{}" forms, "^\\circ", "\\;", ",\\!", "{,}", '"';
  4. LaTeX: keep only what sits between the first two "$" (of each line), unwrap "\\text{x}",
     "\\textbf{x}", "\\overline{x}" (each up to the first "}") and "\\boxed{x}" (up to the last
     "}"); brace shorthand: "\\frac12" -> "\\frac{1}{2}", "\\sqrt2" -> "\\sqrt{2}"; drop "$";
  5. if only digits and commas remain, drop the commas ("1,000" -> "1000"); strip the ends.
Strict box (verl's strict_box_verify=True; score_method "strict_box", which nanokl's config does
not offer, so only a caller passing it gets it): the content of the last "\\boxed{...}" in the
last 100 of those 300 characters must equal the ground truth exactly, with no normalisation.

Score: 1.0 when right, -1.0 when wrong or missing (not 0: a wrong answer is penalised). verl
returns {"score": +-1.0, "acc": bool, "pred": the normalised answer}, and so does this task's
`result`, which the trainer scores with (nanokl/harness/reward_fn.py: the reward is "score", the
held-out accuracy `val-core/<source>/acc/mean@n` is "acc", 0/1 as verl reports it, not the +-1
score, whose mean would be 2*acc - 1; the score is val-aux/<source>/score and /reward). `score`
returns the float score (the supervised tools' verdict), and `answer` returns "pred" (what verl's
maj@k votes on: its calc_maj_val reads the "pred" a rule reports).
verl's pause_tokens_index (reading the box after a pause token) is not reachable from
default_compute_score and is not offered.

tests/test_math_dapo.py checks the examples of verl's comments and hand cases of every
substitution and removal.
"""

import re

from nanokl.tasks.rows import UserError
from nanokl.tasks.math import closing_brace

SOURCES = ("math_dapo", "math", "math_dapo_reasoning")
SOURCE_PREFIXES = ("aime",)  # verl: data_source.startswith("aime")

CLIP_CHARS = 300  # verl: solution_str[-300:]
BOX_CLIP_CHARS = 100  # strict box: the last 100 of those
INVALID = "[INVALID]"  # what a response without an "Answer:" line reads as
METHODS = {"strict": False, "flexible": False, "strict_box": True}  # method -> verl's strict_box_verify

SUBSTITUTIONS = [
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
]
REMOVED_EXPRESSIONS = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
    ",\\!", "{,}", '"', "\\dots",
]

_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_BETWEEN_DOLLARS = re.compile(r".*?\$(.*?)\$.*")  # per line: "... $x$ ..." -> "$x$"
_UNWRAP_FIRST = [re.compile(r"\\text\{(.*?)\}"), re.compile(r"\\textbf\{(.*?)\}"),
                 re.compile(r"\\overline\{(.*?)\}")]
_UNWRAP_BOXED = re.compile(r"\\boxed\{(.*)\}")
_FRAC_SHORT = re.compile(r"frac([^{])(.)")
_SQRT_SHORT = re.compile(r"sqrt([^{])")


def normalize_final_answer(final_answer: str) -> str:
    """The steps 1-5 of the module docstring (verl's normalize_final_answer)."""
    s = final_answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        s = s.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        s = s.replace(expr, "")
    s = _BETWEEN_DOLLARS.sub(lambda m: "$" + m.group(1) + "$", s)
    for pattern in _UNWRAP_FIRST:
        s = pattern.sub(lambda m: m.group(1), s)
    s = _UNWRAP_BOXED.sub(lambda m: m.group(1), s)
    s = _FRAC_SHORT.sub(lambda m: "frac{" + m.group(1) + "}{" + m.group(2) + "}", s)
    s = _SQRT_SHORT.sub(lambda m: "sqrt{" + m.group(1) + "}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def last_boxed_content(text: str) -> str | None:
    """The content of the last "\\boxed{" up to the "}" closing it; None if there is no box or that last
    one never closes (an earlier, closed box is not read). The strict box reading."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    end = closing_brace(text, start)
    return None if end is None else text[start + len("\\boxed{"):end]


def dapo_result(text: str, ground_truth: str, strict_box: bool = False) -> dict:
    """verl's math_dapo.compute_score: {"score": 1.0 or -1.0, "acc": bool, "pred": the answer read}."""
    text = text[-CLIP_CHARS:]
    if strict_box:
        pred = last_boxed_content(text[-BOX_CLIP_CHARS:])
        acc = pred == ground_truth
    else:
        lines = _ANSWER_LINE.findall(text)
        pred = normalize_final_answer(lines[-1] if lines else INVALID)
        acc = pred == normalize_final_answer(ground_truth)
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


def _strict_box(method: str) -> bool:
    if method not in METHODS:
        raise UserError(f"unknown DAPO score method {method!r} (valid: {', '.join(METHODS)}; strict and "
                        "flexible read the last 'Answer:' line, strict_box the last \\boxed{} unnormalised)")
    return METHODS[method]


# ---------------------------------------------------------------------------------------------
# The task interface
# ---------------------------------------------------------------------------------------------

def examples(data, num_train=None, num_val=None, seed=0):
    """No built-in data: DAPO / AIME rows are read from files and scored by their data_source."""
    raise UserError("the DAPO math rule has no built-in dataset: leave data.task unset and set data.train_files "
                    "(and data.val_files) to verl-format rows with data_source "
                    f"{', '.join(SOURCES)} or aime*; each row is scored by this rule")


def result(text, example, method="strict") -> dict:
    """verl's return, {"score": 1.0 or -1.0, "acc": bool, "pred": the answer read}: what the trainer scores
    with (the reward from "score", the accuracy from "acc")."""
    return dapo_result(text, example["ground_truth"], _strict_box(method))


def score(text, example, method="strict"):
    """1.0 if the answer read (last "Answer:" line, or strict_box: last box) is right, else -1.0."""
    return dapo_result(text, example["ground_truth"], _strict_box(method))["score"]


def answer(text, example, method="strict"):
    """verl's "pred": the normalised "Answer:" text ("[INVALID]" if none), or the box content (None
    if none) in strict_box mode; what maj@k votes on."""
    return dapo_result(text, example["ground_truth"], _strict_box(method))["pred"]


def truth_problem(ground_truth, example=None) -> str | None:
    """None when the ground truth normalises to a non-empty string; else no answer line could match it."""
    if isinstance(ground_truth, str) and normalize_final_answer(ground_truth):
        return None
    return ("normalizes to nothing (the DAPO rule deletes spaces and unit words such as 'units', 'cm'), "
            "so no 'Answer:' line can be told right from an empty one")


demonstrations = None

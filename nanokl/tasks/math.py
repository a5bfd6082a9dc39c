"""MATH (Hendrycks et al. 2021): competition problems whose answer is the last `\\boxed{...}`.

The data
--------
No built-in dataset: the rows come from `data.train_files` as verl's
`examples/data_preprocess/math_dataset.py` writes them (data.task unset, each row scored by its
data_source, nanokl/tasks/by_source.py). That script appends

    ` Let's think step by step and output the final answer within \\boxed{}.`

to the problem, and takes as ground truth the content of the last `\\boxed{}` of the reference
solution: a LaTeX string ("\\frac{1}{2}", "(3,-1)", "10\\sqrt{2}", "\\text{(C)}"), not a number.
Its data_source is "DigitalLearningGmbH/MATH-lighteval"; verl's default_compute_score
(verl/utils/reward_score/__init__.py) sends that name, "lighteval/MATH" and
"HuggingFaceH4/MATH-500" to this rule: `SOURCES`.

The rule
--------
verl's `verl/utils/reward_score/math_reward.py: compute_score`, the string normalisation of
lm-evaluation-harness's hendrycks_math, itself from the MATH repository's
`modeling/math_equivalence.py`. It does no algebra: two answers are equal when they are equal
*strings* after a fixed list of rewrites. (verl also ships a math_verify rule, a symbolic
checker needing the `math-verify` package; its default_compute_score leaves it commented out
and scores these sources with math_reward, as this module does.)

1. Find the answer (`last_boxed`): if the text contains "\\boxed " (with a space), the answer is
   what follows the last "\\boxed " up to the next "$" (`\\boxed 5$` -> "5"); this case wins
   even over a later `\\boxed{...}`. Otherwise from the last "\\boxed" (failing that, the last
   "\\fbox"), scan to the "}" that closes the braces opened after it: `\\boxed{\\frac{1}{2}}`.
   No box, or braces never closed: no answer, score 0.
2. Unwrap it (`unbox`): strip "\\boxed " or "\\boxed{" ... "}". Anything else is no answer, so an
   `\\fbox{...}` is found by step 1 and then refused here: verl's remove_boxed asserts a
   `\\boxed{` prefix and its compute_score catches the failure and scores 0. Kept, for parity.
3. Compare (`is_equiv`): `normalize` both the answer and the ground truth, then compare the
   strings. If normalising either one fails (verl's code raises on e.g. two "\\text{ " units, or
   a trailing "\\sqrt" or "\\frac" with nothing after it), the raw strings are compared instead.

`normalize`, in this order (every step is a plain substring rewrite unless said otherwise):
  - drop newlines and "\\!"; turn "\\\\" into "\\"; "tfrac" and "dfrac" into "frac";
  - drop "\\left" and "\\right"; drop degrees "^{\\circ}" and "^\\circ"; drop "\\$";
  - units: if "\\text{ " (with a space) occurs, keep only what precedes it ("10\\text{ cm}" -> "10");
    occurring twice is a failure (see 3.);
  - drop "\\%" (a bare "%" stays: "50%" is not "50");
  - leading zeros for decimals: " ." -> " 0.", "{." -> "{0.", and a leading "." gets a "0";
  - "k = 5": one "=" with at most two characters before it keeps only the right side;
  - `\\sqrt3` -> `\\sqrt{3}` (one character is braced);
  - drop all spaces;
  - `\\frac12` -> `\\frac{1}{2}`, `\\frac1{72}` -> `\\frac{1}{72}`, `\\frac34i` -> `\\frac{3}{4}i`
    (the two characters after an unbraced \\frac become its two arguments);
  - exactly "0.5" becomes "\\frac{1}{2}" (no other decimal is converted: "0.25" is not
    "\\frac{1}{4}");
  - "a/b" with integers a and b written canonically becomes "\\frac{a}{b}" ("1/2", "-3/4"; not
    "1/2/3", "x/2" or "01/2").
What it does not do: reorder ("4, 10" is not "10, 4"), evaluate ("2+2" is not "4", "0.50" is not
"\\frac{1}{2}"), strip leading zeros ("033" is not "33"), or drop `\\text{cm}` without the space.

Score: 1.0 when equal, else 0.0 (no format score). `answer` gives the normalised boxed answer for
majority voting (verl votes only on a rule's "pred", which this rule does not return).
`score_method` does not apply (one rule); "strict" and "flexible" both mean it.

tests/test_math.py checks the rule on verl's and the MATH repository's test strings and on
hundreds of generated rows against a separate evaluator of simple numeric LaTeX.
"""

from nanokl.tasks.rows import UserError

SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

METHODS = ("strict", "flexible")  # reward_model.score_method's names: both mean the one rule


class NotNormal(Exception):
    """Where verl's strip_string raises: is_equiv then compares the raw strings."""


# ---------------------------------------------------------------------------------------------
# Finding the answer
# ---------------------------------------------------------------------------------------------

def last_boxed(text: str) -> str | None:
    """The last box with its command ("\\boxed{...}", "\\boxed x", "\\fbox{...}"), or None (verl's
    last_boxed_only_string)."""
    if "\\boxed " in text:  # the space form wins, whatever comes after it
        return "\\boxed " + text.rsplit("\\boxed ", 1)[1].split("$", 1)[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    end = closing_brace(text, start)
    return None if end is None else text[start:end + 1]


def closing_brace(text: str, start: int) -> int | None:
    """The index of the "}" that closes the first "{" at or after `start`; None if it never closes."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def unbox(boxed: str) -> str | None:
    """The content of "\\boxed x" or "\\boxed{x}"; None for anything else (an "\\fbox{x}" included:
    verl's remove_boxed fails on it and its compute_score scores 0)."""
    if "\\boxed " in boxed:
        return boxed[len("\\boxed "):] if boxed.startswith("\\boxed ") else None
    if boxed.startswith("\\boxed{") and boxed.endswith("}"):
        return boxed[len("\\boxed{"):-1]
    return None


def extract_math_answer(text: str) -> str | None:
    """The raw content of the response's last box, or None when there is none the rule accepts."""
    boxed = last_boxed(text)
    return None if boxed is None else unbox(boxed)


# ---------------------------------------------------------------------------------------------
# Normalising
# ---------------------------------------------------------------------------------------------

def _brace_sqrt(s: str) -> str:
    """\\sqrt3 -> \\sqrt{3}: the one character after an unbraced \\sqrt becomes its argument."""
    head, *rest = s.split("\\sqrt")
    out = [head]
    for part in rest:
        if not part:
            raise NotNormal("\\sqrt with nothing after it")
        out.append("\\sqrt" + (part if part[0] == "{" else "{" + part[0] + "}" + part[1:]))
    return "".join(out)


def _brace_frac(s: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{72} -> \\frac{1}{72}; a \\frac with under two characters
    after it (and no brace) leaves the whole string as it was."""
    head, *rest = s.split("\\frac")
    out = [head]
    for part in rest:
        if not part:
            raise NotNormal("\\frac with nothing after it")
        if part[0] == "{":
            out.append("\\frac" + part)
        elif len(part) < 2:
            return s
        elif part[1] == "{":
            out.append("\\frac{" + part[0] + "}" + part[1:])
        else:
            out.append("\\frac{" + part[0] + "}{" + part[1] + "}" + part[2:])
    return "".join(out)


def _slash_to_frac(s: str) -> str:
    """"a/b" of two canonically written integers -> "\\frac{a}{b}"; anything else unchanged."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def normalize(s: str) -> str:
    """The rewrites listed in the module docstring, in order (verl's strip_string); NotNormal where
    verl's raises."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    if "\\text{ " in s:  # units on the right
        kept, *units = s.split("\\text{ ")
        if len(units) != 1:
            raise NotNormal("more than one '\\text{ '")
        s = kept
    s = s.replace("\\\\%", "").replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _brace_sqrt(s)
    s = s.replace(" ", "")
    s = _brace_frac(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_to_frac(s)


def is_equiv(a: str | None, b: str | None) -> bool:
    """Equal after `normalize` (the raw strings compared where normalising fails); None equals only
    None (verl's is_equiv)."""
    if a is None or b is None:
        return a is None and b is None
    try:
        return normalize(a) == normalize(b)
    except NotNormal:
        return a == b


def math_score(text: str, ground_truth: str) -> float:
    """1.0 if the response's last box is equivalent to the ground truth, else 0.0 (verl's
    math_reward.compute_score)."""
    found = extract_math_answer(text)
    return 1.0 if found is not None and is_equiv(found, ground_truth) else 0.0


def _check(method: str) -> None:
    if method not in METHODS:
        raise UserError(f"unknown MATH score method {method!r} (valid: {', '.join(METHODS)}; both mean "
                        "verl's one boxed-answer rule)")


# ---------------------------------------------------------------------------------------------
# The task interface
# ---------------------------------------------------------------------------------------------

def examples(data, num_train=None, num_val=None, seed=0):
    """No built-in data: MATH rows are read from files and scored by their data_source."""
    raise UserError("MATH has no built-in dataset: leave data.task unset and set data.train_files (and "
                    "data.val_files) to the parquet verl's examples/data_preprocess/math_dataset.py writes; "
                    f"rows with data_source {' / '.join(SOURCES)} are scored by this rule")


def score(text, example, method="strict"):
    """1.0 if the last boxed answer equals the ground truth after normalisation, else 0.0."""
    _check(method)
    return math_score(text, example["ground_truth"])


def answer(text, example, method="strict"):
    """The normalised last boxed answer (the raw one where normalising fails), for maj@k; None if none."""
    _check(method)
    found = extract_math_answer(text)
    if found is None:
        return None
    try:
        return normalize(found)
    except NotNormal:
        return found


def truth_problem(ground_truth, example=None) -> str | None:
    """None for any non-empty LaTeX string (the rule compares strings, so any can be matched)."""
    if isinstance(ground_truth, str) and ground_truth.strip():
        return None
    return "is empty, so no boxed answer can equal it (MATH's rule compares the last \\boxed{} with it)"


demonstrations = None

"""nanokl/tasks/math.py, verl's rule-based MATH scorer (math_reward): (1) the test strings of verl and of
the MATH repository its rule descends from, with their expected verdicts; (2) generated MATH-style rows
against a separate evaluator of simple numeric LaTeX (fractions.Fraction, no sympy, no code of the rule);
(3) the data_source routing of verl's default_compute_score for the MATH sources, end to end from a
verl-format file. The DAPO rule (nanokl/tasks/math_dapo.py) is tests/test_math_dapo.py."""

import json
import random
import re
from fractions import Fraction
from pathlib import Path

import pytest

from nanokl.harness.config.load import load_config
from nanokl.harness.config.yaml_io import UserError
from nanokl.harness.reward_fn import check_sources, check_truths, scorer
from nanokl.tasks import by_source, get_task, gsm8k, math_dapo, source_task
from nanokl.tasks import math as math_task
from nanokl.tasks.math import is_equiv, math_score, normalize

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "arith_tiny.yaml"

# ---------------------------------------------------------------------------------------------
# (1) The strings verl's sources and tests give, with verl's verdicts
# ---------------------------------------------------------------------------------------------
# Read at volcengine/verl b178a3cd56f58b2d502255daba591e92833930a7 (2026-01-29): verl/utils/reward_score/
# __init__.py, math_reward.py, math_dapo.py. verl's main branch has no unit test of math_reward or math_dapo
# (tests/ mentions neither), so the strings are: the examples in the two files' comments and docstrings
# (15 for strip_string / remove_boxed here; the 6 for normalize_final_answer / remove_boxed are in
# tests/test_math_dapo.py, remove_boxed's one example checked here in both rules); the 4 boxed cases of
# tests/utils/reward_score/test_numeric_canonicalization_on_cpu.py, a test of a PR (commit 87d81599) that was
# never merged, so verl's main answers False where that test wanted True (its "033" == "33" needs a
# canonicalisation verl does not have); and the 16 cases of the MATH repository's
# modeling/math_equivalence_test.py (hendrycks/math 5f3bf91d), the tests of the is_equiv that lm-eval-harness
# and verl copied (every one gives the same verdict under verl's version). 41 strings or pairs in all, with
# test_math_dapo.py's; the verdicts were also checked by running verl's own files on them.

STRIP_EXAMPLES = [  # math_reward.strip_string's comments: input -> normalised
    ("\\frac1b", "\\frac{1}{b}"), ("\\frac12", "\\frac{1}{2}"), ("\\frac1{72}", "\\frac{1}{72}"),
    ("\\frac{72}1", "\\frac{72}1"),  # "but not \frac{72}1"
    ("0.5", "\\frac{1}{2}"), ("\\sqrt3", "\\sqrt{3}"), (" .5", "\\frac{1}{2}"), ("{.5}", "{0.5}"),
    (".5", "\\frac{1}{2}"), ("k = 5", "5"), ("q = 5", "5"), ("1/2", "\\frac{1}{2}"), ("10\\text{ units}", "10"),
    ("\\tfrac12", "\\frac{1}{2}"),
]
UNMERGED_PR_CASES = [("\\boxed{033}", "33"), ("\\boxed{+033}", "33"), ("\\boxed{-0}", "0"), ("\\boxed{000}", "0")]
MATH_REPO_CASES = [  # (a, b, is_equiv) from hendrycks/math modeling/math_equivalence_test.py
    ("\\tfrac{1}{2} + \\frac1{72}", "\\\\frac{1}{2} + 2/3", False), ("10, 4, -2", "4, 10, -2", False),
    ("10, 4, 2", "4, 12, 2", False), ("\\tfrac{1}{2} +\\! \\frac1{72}", "\\\\dfrac{1}{2} +\\frac{1}{72}", True),
    ("10\\text{ units}", "10 ", True), ("10\\text{ units}", "100 ", False), ("10", "\\$10", True),
    ("\\left(x-2\\right)\\left(x+2\\right)", "(x-2)(x+2)", True), ("0.1, 4, 2", "4, .1, 2", False),
    ("0.1", ".1", True), ("10\\%", "10", True), ("10\\sqrt{3} + \\sqrt4", "10\\sqrt3 + \\sqrt{4}", True),
    ("\\frac34i", "\\frac{3}{4}i", True), ("\\tfrac83", "\\frac{8}{3}", True),
    ("5x - 7y + 11z + 4 = 0", "x + y - z + 2 = 0", False), ("1/2", "\\frac{1}{2}", True),
]


@pytest.mark.parametrize("raw, normal", STRIP_EXAMPLES)
def test_math_normalize_matches_verls_comments(raw, normal):
    assert normalize(raw) == normal


def test_remove_boxed_docstring_example_in_both_rules():
    assert math_task.extract_math_answer("\\boxed{content}") == "content"
    assert math_dapo.last_boxed_content("\\boxed{content}") == "content"


@pytest.mark.parametrize("boxed, truth", UNMERGED_PR_CASES)
def test_the_unmerged_canonicalisation_cases_are_false_as_in_verl_main(boxed, truth):
    assert math_task.extract_math_answer(boxed) == boxed[7:-1]
    assert is_equiv(boxed[7:-1], truth) is False and math_score(boxed, truth) == 0.0


@pytest.mark.parametrize("a, b, same", MATH_REPO_CASES)
def test_the_math_repositorys_equivalence_tests(a, b, same):
    assert is_equiv(a, b) is same and is_equiv(b, a) is same
    assert math_score(f"so $\\boxed{{{a}}}$.", b) == float(same)


def test_math_rule_quirks_kept_for_parity_with_verl():
    # the "\boxed " (space) form wins over a later \boxed{}, and reads up to the next "$"
    assert math_score("$\\boxed 5$ no, $\\boxed{6}$", "5") == 1.0
    assert math_score("$\\boxed 5$ no, $\\boxed{6}$", "6") == 0.0
    # \fbox is found, then refused (verl's remove_boxed asserts "\boxed{"; its compute_score returns 0)
    assert math_score("\\fbox{5}", "5") == 0.0 and math_task.answer("\\fbox{5}", {}) is None
    assert math_score("\\boxed{5", "5") == 0.0  # never closed
    # where verl's strip_string raises, the raw strings are compared
    assert is_equiv("1\\text{ m}2\\text{ m}", "1\\text{ m}2\\text{ m}") and not is_equiv("1\\text{ m}2\\text{ m}", "12")
    assert is_equiv("\\sqrt", "\\sqrt") and is_equiv("2\\frac", "2\\frac") and not is_equiv("2\\frac", "2")
    assert normalize("\\frac1\\frac") == "\\frac1\\frac"  # a one-character \frac leaves the whole string
    assert normalize("2 .5") == "20.5" and normalize("\\sqrt 3") == "\\sqrt{}3"  # " ." and "\sqrt " rewrites
    assert normalize("50%") == "50%" and normalize("50\\%") == "50"  # only "\%" is dropped
    assert normalize("-1/2") == "\\frac{-1}{2}" and normalize("01/2") == "01/2"
    assert is_equiv(None, None) and not is_equiv("1", None)
    with pytest.raises(UserError, match="unknown MATH score method 'nope'"):
        math_task.score("\\boxed{1}", {"ground_truth": "1"}, "nope")
    assert math_task.score("\\boxed{1}", {"ground_truth": "1"}, "flexible") == 1.0  # a GSM8K knob: one rule here


# ---------------------------------------------------------------------------------------------
# (2) Generated MATH rows against a separate evaluator
# ---------------------------------------------------------------------------------------------
# The evaluator reads the simple numeric LaTeX the rows use into a value: a number as a Fraction, c*sqrt(r)
# as (c, squarefree r), an interval as (bracket, values..., bracket). Units (\text{..}, \mbox{..}), degrees,
# percent signs, dollars, \!, \left / \right, spaces and a leading "x =" are read as annotation. Each row
# also says whether its surface form is one verl's *string* rule equates (the table FORMS): the rule is right
# exactly when the evaluator finds equal values and the form is one it equates.

def _group(s, i):
    """The argument starting at s[i]: a braced group (nested braces allowed) or one character."""
    if s[i] != "{":
        return s[i], i + 1
    depth, j = 0, i
    while True:
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1:j], j + 1
        j += 1


def _squarefree(c, r):
    k = 2
    while k * k <= r:
        while r % (k * k) == 0:
            r //= k * k
            c *= k
        k += 1
    return (c, r) if r != 1 else (c, 1)


def _scalar(s):
    if s.startswith("-"):
        c, r = _scalar(s[1:])
        return -c, r
    if re.fullmatch(r"\d{1,3}(,\d{3})+", s):
        return Fraction(int(s.replace(",", ""))), 1
    m = re.match(r"\\[dt]?frac", s)
    if m:
        num, i = _group(s, m.end())
        den, i = _group(s, i)
        assert i == len(s), s
        (cn, rn), (cd, rd) = _scalar(num), _scalar(den)
        assert rd == 1, s
        return _squarefree(cn / cd, rn) if rn != 1 else (cn / cd, 1)
    if "\\sqrt" in s:
        coef, rest = s.split("\\sqrt", 1)
        rad, i = _group(rest, 0)
        assert i == len(rest), s
        return _squarefree(Fraction(coef or 1), int(rad))
    if "/" in s:
        a, b = s.split("/")
        return Fraction(int(a), int(b)), 1
    return Fraction(s), 1


def ref_value(s):
    for pattern in [r"\\text\{[^}]*\}", r"\\mbox\{[^}]*\}", r"\^\{?\\circ\}?", r"\\?%", r"\\\$", r"\\!",
                    r"\\left", r"\\right", r"\s+"]:
        s = re.sub(pattern, "", s)
    s = re.sub(r"^[a-z]=", "", s.replace("{,}", ","))
    if s[0] in "([" and s[-1] in ")]":
        return (s[0], *(_scalar(x) for x in s[1:-1].split(",")), s[-1])
    return _scalar(s)


def test_the_reference_evaluator_reads_what_it_should():
    assert ref_value("\\dfrac{6}{4}") == ref_value("1.5") == ref_value("3/2") == (Fraction(3, 2), 1)
    assert ref_value("2\\sqrt{3}") == ref_value("\\sqrt{12}") == ref_value("2\\sqrt3")
    assert ref_value("\\frac{\\sqrt{8}}{4}") == (Fraction(1, 2), 2) and ref_value("\\frac12") == ref_value(".5")
    assert ref_value("\\left( -1, \\frac{1}{2} \\right]") == ("(", (-1, 1), (Fraction(1, 2), 1), "]")
    assert ref_value("12,\\!345") == ref_value("12{,}345") == ref_value("12345") != ref_value("12346")
    assert ref_value("x = 30^\\circ") == ref_value("30\\%") == ref_value("30\\text{ cm}") == (30, 1)


# form -> does verl's string rule equate it with the plain form it rewrites (values being equal)?
FORMS = {
    "same": True, "spaces": True, "dfrac": True, "tfrac": True, "frac_short": True, "slash": True,
    "leading_dot": True, "half_decimal": True, "units": True, "degrees": True, "degrees_braced": True,
    "percent": True, "dollar": True, "var_prefix": True, "thin_space_thousands": True, "sqrt_short": True,
    "left_right": True, "newline": True,
    # equal values the rule does not equate (it compares strings, it does not evaluate)
    "decimal_for_fraction": False, "fraction_for_decimal": False, "trailing_zero": False, "unreduced": False,
    "plain_thousands": False, "brace_comma_thousands": False, "units_no_space": False, "mbox_units": False,
    "bare_percent": False, "negative_slash": False, "sqrt_unsimplified": False, "sqrt_space": False,
}


def _frac(p, q):
    return ("-" if p < 0 else "") + f"\\frac{{{abs(p)}}}{{{q}}}"


def _num(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else _frac(x.numerator, x.denominator)


def _decimal(x: Fraction) -> str:
    whole, rest = divmod(abs(x.numerator), x.denominator)
    digits = ""
    while rest:
        rest *= 10
        digits += str(rest // x.denominator)
        rest %= x.denominator
    return ("-" if x < 0 else "") + str(whole) + ("." + digits if digits else "")


def truths_and_forms(rng):
    """(truth, [(form, written), ...], [wrong answers close to the truth]) for one drawn truth."""
    kind = rng.choice(["int", "frac", "decimal", "sqrt", "interval", "thousands", "unit", "half"])
    if kind == "int":
        n = rng.randint(-99, 999)
        forms = [("same", str(n)), ("dollar", f"\\${n}"), ("var_prefix", f"x = {n}"),
                 ("units", f"{n}\\text{{ cm}}"), ("units_no_space", f"{n}\\text{{cm}}"),
                 ("mbox_units", f"{n}\\mbox{{ cm}}"), ("degrees", f"{n}^\\circ"), ("degrees_braced", f"{n}^{{\\circ}}"),
                 ("percent", f"{n}\\%"), ("bare_percent", f"{n}%"), ("trailing_zero", f"{n}.0"), ("newline", f"{n}\n")]
        return str(n), forms, [str(n + 1), str(n - 1), str(-n) if n else "1", str(n * 10)]
    if kind == "frac":
        q = rng.randint(2, 9)
        p = rng.choice([k for k in range(1, 3 * q) if Fraction(k, q).denominator == q])
        p = -p if rng.random() < 0.3 else p
        t = _frac(p, q)
        forms = [("same", t), ("dfrac", t.replace("\\frac", "\\dfrac")), ("tfrac", t.replace("\\frac", "\\tfrac")),
                 ("spaces", t.replace("}{", "} {").replace("-", "- ")), ("unreduced", _frac(2 * p, 2 * q))]
        forms.append(("slash", f"{p}/{q}") if p > 0 else ("negative_slash", f"{p}/{q}"))
        if abs(p) < 10:
            forms.append(("frac_short", ("-" if p < 0 else "") + f"\\frac{abs(p)}{q}"))
        if q in (2, 4, 5, 8):  # a terminating decimal
            forms.append(("decimal_for_fraction", _decimal(Fraction(p, q))))
        swapped = _frac(q, abs(p)) if abs(p) != 1 else _frac(p, q + 1)
        return t, forms, [_frac(p + 1, q), swapped, _frac(-p, q), _frac(p, q + 1)]
    if kind == "decimal":
        x = Fraction(rng.randint(1, 999), rng.choice([10, 100, 4, 8]))
        while x.denominator == 1 or x == Fraction(1, 2):
            x += Fraction(1, 10)
        d = _decimal(x)
        forms = [("same", d), ("trailing_zero", d + "0"), ("fraction_for_decimal", _num(x))]
        if d.startswith("0."):
            forms.append(("leading_dot", d[1:]))
        return d, forms, [_decimal(x + Fraction(1, 10)), _decimal(x * 10), _decimal(x + Fraction(1, 100)), "-" + d]
    if kind == "sqrt":
        r = rng.choice([2, 3, 5, 6, 7])
        c = rng.randint(2, 9)
        t = f"{c}\\sqrt{{{r}}}"
        forms = [("same", t), ("sqrt_short", f"{c}\\sqrt{r}"), ("sqrt_unsimplified", f"\\sqrt{{{c * c * r}}}"),
                 ("sqrt_space", f"{c}\\sqrt {r}"), ("spaces", f"{c} \\sqrt{{{r}}}")]
        return t, forms, [f"{c}\\sqrt{{{r + 1}}}", f"{c + 1}\\sqrt{{{r}}}", f"\\sqrt{{{c * r}}}"]
    if kind == "interval":
        a = rng.randint(-9, 5)
        b = a + rng.randint(1, 9)
        lo, hi = rng.choice("(["), rng.choice(")]")
        t = f"{lo}{a},{b}{hi}"
        forms = [("same", t), ("left_right", f"\\left{lo}{a},{b}\\right{hi}"), ("spaces", f"{lo}{a}, {b}{hi}"),
                 ("left_right", f"\\left{lo} {a}, {b} \\right{hi}")]
        other = "[" if lo == "(" else "("
        return t, forms, [f"{lo}{a},{b + 1}{hi}", f"{other}{a},{b}{hi}", f"{lo}{b},{a}{hi}", f"{lo}{a - 1},{b}{hi}"]
    if kind == "thousands":
        n = rng.randint(1000, 999999)
        head, tail = divmod(n, 1000)
        t = f"{head},\\!{tail:03d}"
        forms = [("same", t), ("thin_space_thousands", f"{head},{tail:03d}"), ("plain_thousands", str(n)),
                 ("brace_comma_thousands", f"{head}{{,}}{tail:03d}")]
        return t, forms, [f"{head},\\!{(tail + 1) % 1000:03d}", f"{head + 1},\\!{tail:03d}", str(n + 1)]
    if kind == "unit":
        n = rng.randint(1, 500)
        t = f"{n}\\text{{ cm}}"
        forms = [("same", t), ("units", str(n)), ("units", f"{n}\\text{{ inches}}"),
                 ("units_no_space", f"{n}\\text{{cm}}")]
        return t, forms, [str(n + 1), f"{n + 1}\\text{{ cm}}"]
    t = "\\frac{1}{2}"  # the one decimal the rule converts
    forms = [("same", t), ("half_decimal", "0.5"), ("half_decimal", ".5"), ("frac_short", "\\frac12"), ("slash", "1/2"),
             ("dfrac", "\\dfrac{1}{2}"), ("trailing_zero", "0.50"), ("fraction_for_decimal", "\\frac{2}{4}")]
    return t, forms, ["\\frac{1}{3}", "0.4", "2"]


LAYOUTS = ["plain", "last_of_two", "first_of_two", "missing", "fbox", "space_box"]


def generated_rows(n_truths=120, seed=0):
    """(response, truth, expected score, what) rows: every form and close wrong answer of each drawn truth,
    each in a drawn layout. `expected` comes from the evaluator and FORMS only."""
    rng, rows = random.Random(seed), []
    for _ in range(n_truths):
        truth, forms, wrongs = truths_and_forms(rng)
        written = [(form, w, FORMS[form]) for form, w in forms] + [("wrong", w, True) for w in wrongs]
        for form, w, equated in written:
            layout = rng.choice(LAYOUTS)
            if layout == "space_box" and (" " in w or "$" in w or "\n" in w):
                layout = "plain"
            decoy = rng.choice(wrongs)
            lead = "We simplify step by step, so the final answer is "
            text, final = {
                "plain": (f"{lead}$\\boxed{{{w}}}$.", w),
                "last_of_two": (f"First I got $\\boxed{{{decoy}}}$, but correcting a sign: $\\boxed{{{w}}}$.", w),
                "first_of_two": (f"First I got $\\boxed{{{w}}}$, but correcting a sign: $\\boxed{{{decoy}}}$.", decoy),
                "missing": (f"{lead}{w}.", None),
                "fbox": (f"{lead}$\\fbox{{{w}}}$.", None),  # verl refuses an \fbox (see the module docstring)
                "space_box": (f"{lead}$\\boxed {w}$.", w),
            }[layout]
            if final is None:
                expected = 0.0
            elif final == w:
                expected = float(ref_value(w) == ref_value(truth) and equated)
            else:  # the decoy, written in the truth's plain form: right only if its value is
                expected = float(ref_value(final) == ref_value(truth))
            rows.append((text, truth, expected, f"{form}/{layout}"))
    return rows


ROWS = generated_rows()


def test_generated_rows_cover_what_they_should():
    whats = {what.split("/")[0] for *_, what in ROWS} | {what.split("/")[1] for *_, what in ROWS}
    assert len(ROWS) >= 200 and set(FORMS) <= whats and set(LAYOUTS) <= whats
    assert 0.2 < sum(e for _, _, e, _ in ROWS) / len(ROWS) < 0.8  # right and wrong rows both plentiful


def test_generated_rows_score_as_the_reference_says():
    wrong = [(what, text, truth, e) for text, truth, e, what in ROWS if math_score(text, truth) != e]
    assert not wrong, f"{len(wrong)} of {len(ROWS)} rows disagree, e.g. {wrong[:3]}"


def test_equated_forms_vote_together():
    """`answer` (maj@k) gives one key to the forms the rule equates, and the score follows the key."""
    for text, truth, e, what in ROWS:
        if what.endswith("/plain") and e == 1.0:
            key = math_task.answer(text, {"ground_truth": truth})
            assert key == math_task.answer(f"$\\boxed{{{truth}}}$", {"ground_truth": truth}), what



# ---------------------------------------------------------------------------------------------
# (3) Routing by data_source, as verl's default_compute_score
# ---------------------------------------------------------------------------------------------
# math_dapo and aime* (and the sources verl routes elsewhere or nowhere): tests/test_math_dapo.py.

@pytest.mark.parametrize("source, task", [
    ("lighteval/MATH", math_task), ("DigitalLearningGmbH/MATH-lighteval", math_task),
    ("HuggingFaceH4/MATH-500", math_task),
    ("openai/gsm8k", gsm8k),
])
def test_source_task_routes_as_verl(source, task):
    assert source_task(source) is task


def test_a_verl_row_scores_through_by_source(tmp_path):
    row = {"data_source": "DigitalLearningGmbH/MATH-lighteval", "reward_model": {"ground_truth": "\\frac{1}{2}"}}
    ex = {"ground_truth": row["reward_model"]["ground_truth"], "data_source": row["data_source"]}
    assert by_source.score("so $\\boxed{\\dfrac12}$", ex) == 1.0 and by_source.score("$\\boxed{0.6}$", ex) == 0.0
    assert by_source.answer("so $\\boxed{\\dfrac12}$", ex) == "\\frac{1}{2}"
    assert by_source.truth_problem("\\frac{1}{2}", ex) is None
    # end to end: a verl-format file mixing sources, read with data.task unset, each row scored by its own rule
    rows = [{**row, "prompt": [{"role": "user", "content": "Half of 1? " + math_task.INSTRUCTION}]},
            {"data_source": "aime24", "prompt": "AIME ...", "reward_model": {"ground_truth": 204}},
            {"data_source": "openai/gsm8k", "prompt": "Q", "reward_model": {"ground_truth": "7"}}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(TINY, ["data.task=null", f"data.train_files={path}"])
    train, _ = get_task(None).examples(cfg.data)
    check_sources(cfg, train)
    check_truths(cfg, train)
    score = scorer(cfg)
    assert [score("$\\boxed{1/2}$", ex) for ex in train] == [1.0, -1.0, 0.0]
    assert [score("Answer: 204\n#### 7", ex) for ex in train] == [0.0, 1.0, 1.0]
    # the DAPO row is read through verl's dict (math_dapo.result): its accuracy is 0/1 beside the +-1 score
    got = [score("$\\boxed{1/2}$", ex) for ex in train]
    assert [r.acc for r in got] == [1.0, 0.0, 0.0] and got[1].info == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert [r.info for r in (got[0], got[2])] == [{}, {}]  # MATH and GSM8K rules return numbers, as verl's

"""nanokl/tasks/math_dapo.py, verl's DAPO math scorer (math_dapo), read at volcengine/verl
b178a3cd56f58b2d502255daba591e92833930a7: the examples in the comments of verl's normalize_final_answer
(verl has no unit test of math_dapo), hand cases of the "Answer:" line rule and of every substitution and
removal, the strict box, the result dict (score/acc/pred), and the data_source routing of verl's
default_compute_score for math_dapo and aime*. The MATH rule (nanokl/tasks/math.py), its strings,
generated rows and the end-to-end routing of a mixed verl-format file are tests/test_math.py."""

import pytest

from nanokl.harness.config.yaml_io import UserError
from nanokl.tasks import SOURCE_TASKS, math_dapo, source_task
from nanokl.tasks import math as math_task
from nanokl.tasks.math_dapo import dapo_result, normalize_final_answer

# The 5 examples of math_dapo.normalize_final_answer's comments (its remove_boxed docstring example, the
# sixth, is checked in tests/test_math.py beside math_reward's).
DAPO_NORMALIZE_EXAMPLES = [  # math_dapo.normalize_final_answer's comments
    ("\\fracab", "\\frac{a}{b}"), ("\\frac{abc}{bef}", "\\frac{abc}{bef}"), ("\\fracabc", "\\frac{a}{b}c"),
    ("\\sqrta", "\\sqrt{a}"), ("\\sqrtab", "\\sqrt{a}b"),
]


@pytest.mark.parametrize("raw, normal", DAPO_NORMALIZE_EXAMPLES)
def test_dapo_normalize_matches_verls_comments(raw, normal):
    assert normalize_final_answer(raw) == normal


@pytest.mark.parametrize("text, truth, right, pred", [
    ("The sum is 204.\nAnswer: 204", "204", True, "204"),
    ("answer : 204", "204", True, "204"),  # any case, spaces around the colon
    ("Answer: 12\nwait, redo.\nAnswer: 13", "13", True, "13"),  # the last line wins
    ("Answer: 12\nwait, redo.\nAnswer: 13", "12", False, "13"),
    ("Answer: $204$", "204", True, "204"),
    ("Answer: \\boxed{204}", "204", True, "204"),
    ("Answer: 1,000", "1000", True, "1000"),
    ("Answer: 1,000", "1,000", True, "1000"),
    ("Answer: 204.", "204", False, "204."),  # ".$" is rewritten, a bare final "." is not
    ("Answer: $204.$", "204", True, "204"),
    ("Answer: x = 5", "5", True, "5"),
    ("Answer: 30 degrees", "30", True, "30"),
    ("Answer: 30^\\circ", "30", True, "30"),
    ("Answer: \\$5", "5", True, "5"),
    ("Answer: \\frac12", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", False, "\\dfrac{1}{2}"),  # no dfrac rewrite in this rule
    ("Answer: 5 \\text{ cm}", "5", True, "5"),
    ("Answer: \\text{(A)}", "(A)", True, "(A)"),
    ("Answer: 3 and 4", "3,4", False, "3and4"),  # only "\\text{and}" means ","
    ("Answer: 3 \\text{and} 4", "3,4", True, "34"),  # then digits and commas lose the commas
    ("Answer: 0.5", "\\frac{1}{2}", False, "0.5"),
    ("The answer is 204.", "204", False, "[INVALID]"),  # no "Answer:" line
    ("Answer: 204" + " padding" * 40, "204", False, "[INVALID]"),  # outside the last 300 characters
    ("Answer: 204" + "\n" + "x" * 280, "204", True, "204"),  # inside them
])
def test_dapo_reads_the_last_answer_line(text, truth, right, pred):
    result = dapo_result(text, truth)
    assert result == {"score": 1.0 if right else -1.0, "acc": right, "pred": pred}
    ex = {"ground_truth": truth}
    assert math_dapo.score(text, ex) == result["score"] == math_dapo.score(text, ex, "flexible")
    assert math_dapo.result(text, ex) == result == math_dapo.result(text, ex, "flexible")
    assert math_dapo.answer(text, ex) == pred


def test_dapo_substitutions_and_removals_one_by_one():
    for before, after in math_dapo.SUBSTITUTIONS:
        if before not in (".$", "\\$"):  # these two need a "$" around them: the hand cases above
            assert normalize_final_answer(f"7{before}8") == normalize_final_answer(f"7{after}8"), before
    for expr in math_dapo.REMOVED_EXPRESSIONS:
        assert normalize_final_answer(f"7{expr}") == "7", expr
    assert normalize_final_answer("Cuba 5") == "Cub5" and normalize_final_answer("\\overline{12}") == "12"
    assert normalize_final_answer("$x$ and $y$") == "x"  # only the first $...$ of the line
    assert normalize_final_answer("\\textbf{7}") == "7" and normalize_final_answer("3\\mbox{ m}") == "3"


def test_dapo_strict_box_is_exact_and_reads_the_last_100_characters():
    ex = {"ground_truth": "204"}
    assert dapo_result("so \\boxed{204}", "204", strict_box=True) == {"score": 1.0, "acc": True, "pred": "204"}
    assert math_dapo.score("so \\boxed{204}", ex, "strict_box") == 1.0
    assert math_dapo.score("so \\boxed{ 204}", ex, "strict_box") == -1.0  # no normalisation at all
    assert math_dapo.score("Answer: 204", ex, "strict_box") == -1.0
    assert math_dapo.answer("Answer: 204", ex, "strict_box") is None
    assert math_dapo.score("\\boxed{204}" + "x" * 95, ex, "strict_box") == -1.0  # the box starts before the last 100
    assert math_dapo.score("\\boxed{204}" + "x" * 85, ex, "strict_box") == 1.0
    assert math_dapo.answer("\\boxed{\\frac{1}{2}} \\boxed{7", ex, "strict_box") is None  # the last box never closes
    with pytest.raises(UserError, match="unknown DAPO score method 'box'"):
        math_dapo.score("x", ex, "box")


def test_truth_problems():
    assert math_task.truth_problem("\\text{(C)}") is None and math_task.truth_problem(" ") is not None
    assert math_dapo.truth_problem("204") is None and "normalizes to nothing" in math_dapo.truth_problem("units")
    for task in (math_task, math_dapo):
        assert task.demonstrations is None
        with pytest.raises(UserError, match="data.train_files"):
            task.examples(None)


# ---------------------------------------------------------------------------------------------
# Routing by data_source, as verl's default_compute_score (the MATH sources: tests/test_math.py)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("source, task", [
    ("math_dapo", math_dapo), ("math", math_dapo), ("math_dapo_reasoning", math_dapo),
    ("aime24", math_dapo), ("aime_2025", math_dapo), ("aime", math_dapo),
])
def test_source_task_routes_as_verl(source, task):
    assert source_task(source) is task


def test_unrouted_sources_stay_refused():
    for source in ["AIME24", "numina_olympiads", "MATH", "hiyouga/geometry3k"]:  # verl: other rules, or none
        with pytest.raises(UserError, match=f"no reward rule for data_source '{source}'.*aime\\*"):
            source_task(source)
    assert SOURCE_TASKS["lighteval/MATH"] is math_task and "aime" not in SOURCE_TASKS


"""nanokl.reward: GSM8K scoring against hand cases and OpenAI's labelled model solutions, the
arithmetic scorer on every demonstration, dispatch, and score placement against a naive loop."""

import json

import pytest
import torch

from nanokl.harness.config_io import UserError
from nanokl.harness.data import ArithDifficulty, load_examples, make_arith_task
from nanokl.reward import arith_score, extract_gsm8k_answer, gsm8k_score, score_response, token_level_scores

# ---------------------------------------------------------------------------------------------
# GSM8K: hand cases. format_score=0.5 tells "found but wrong" (0.5) from "no answer" (0).
# ---------------------------------------------------------------------------------------------

CASES = [
    # (text, ground truth, method, expected score)
    ("She makes 9 * 2 = $18 every day.\n#### 18", "18", "strict", 1.0),
    ("#### 1,234", "1234", "strict", 1.0),  # commas stripped from the answer ...
    ("#### 1234", "1,234", "strict", 1.0),  # ... and from the ground truth
    ("#### -5", "-5", "strict", 1.0),
    ("#### 5", "-5", "strict", 0.5),
    ("#### 7 first, then corrected: #### 18", "18", "strict", 1.0),  # the last #### wins
    ("#### 18 then a later #### 7", "18", "strict", 0.5),
    ("The answer is 18", "18", "strict", 0.0),  # strict wants the format
    ("####18", "18", "strict", 0.0),  # ... exactly: "#### " with the space
    ("#### $18", "18", "strict", 0.0),  # verl's pattern cannot start with $: no answer
    ("#### 18.0", "18", "strict", 0.5),  # verl: string equality, "18.0" is not "18"
    ("#### 3+4", "7", "strict", 0.5),  # never evaluated: it reads "3"
    ("The answer is 18", "18", "flexible", 1.0),
    ("She pays $1,000 in total", "1000", "flexible", 1.0),
    ("18 apples, so 20 in all", "20", "flexible", 1.0),  # the last number
    ("It is 18 . ", "18", "flexible", 1.0),  # a lone "." is punctuation, skipped
    ("It is 18 , . ,", "18", "flexible", 1.0),
    ("The answer is 18.", "18", "flexible", 0.5),  # verl parity: the period sticks: "18."
    ("x = 18.0", "18", "flexible", 0.5),
    ("temperature -3", "-3", "flexible", 1.0),
    ("no number at all.", "18", "flexible", 0.0),
    ("", "18", "strict", 0.0),
]


@pytest.mark.parametrize("text, truth, method, expected", CASES)
def test_gsm8k_hand_cases(text, truth, method, expected):
    assert gsm8k_score(text, truth, method, format_score=0.5) == expected


def test_gsm8k_defaults_score_and_clipping():
    assert gsm8k_score("#### 3", "4") == 0.0 and gsm8k_score("#### 4", "4", score=2.0) == 2.0
    assert gsm8k_score("#### 4", 4) == 1.0  # an int ground truth compares as its text
    # only the last 300 characters are read: 1000 digits before the answer do not matter ...
    assert gsm8k_score("9" * 1000 + " #### 18", "18") == 1.0
    assert gsm8k_score("9" * 1000 + " so 18", "18", "flexible") == 1.0
    # ... and an answer followed by more than 300 characters is out of sight
    assert gsm8k_score("#### 18" + " and so on" * 30, "18") == 0.0
    assert gsm8k_score("#### 18" + " and so on" * 29, "18") == 1.0  # 290 characters after: seen
    assert extract_gsm8k_answer("a lot\n#### 1,234,567") == "1234567"
    with pytest.raises(UserError, match="unknown GSM8K score method 'loose'"):
        gsm8k_score("#### 1", "1", "loose")


# ---------------------------------------------------------------------------------------------
# GSM8K: the real data
# ---------------------------------------------------------------------------------------------


def test_every_reference_answer_scores_one(gsm8k_dir):
    examples = load_examples([gsm8k_dir / "test.jsonl", gsm8k_dir / "train.jsonl"])
    assert len(examples) == 1319 + 7473
    assert all(gsm8k_score(ex["solution"], ex["ground_truth"]) == 1.0 for ex in examples)
    # and a wrong ground truth makes each of them wrong: the check is not vacuous
    assert all(gsm8k_score(ex["solution"], str(int(ex["ground_truth"]) + 1)) == 0.0 for ex in examples[:200])


MODELS = ["6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification"]


def test_flexible_agrees_with_labelled_model_solutions(gsm8k_dir):
    """OpenAI's released GSM8K samples carry `is_correct` labels; the flexible rule must agree.

    The reference solutions end in "A: 18"; that number (commas removed) is the ground truth,
    and it equals the `#### N` of the same question in test.jsonl."""
    rows = [json.loads(line) for line in open(gsm8k_dir / "example_model_solutions.jsonl", encoding="utf-8")]
    test = load_examples(gsm8k_dir / "test.jsonl")
    assert len(rows) == len(test) == 1319
    agree, labels_true = {}, 0
    for row, ex in zip(rows, test):
        truth = row["ground_truth"].rsplit("A:", 1)[1].strip().replace(",", "")
        assert truth == ex["ground_truth"] and ex["prompt"].startswith(row["question"])
        for m in MODELS:
            correct = gsm8k_score(row[m]["solution"], truth, "flexible") == 1.0
            agree[m] = agree.get(m, 0) + (correct == row[m]["is_correct"])
            labels_true += row[m]["is_correct"]
    rates = {m: agree[m] / len(rows) for m in MODELS}
    overall = sum(agree.values()) / (len(rows) * len(MODELS))
    print("flexible vs is_correct:", rates, "overall", overall)
    assert 0.2 < labels_true / (len(rows) * len(MODELS)) < 0.8  # both labels are common: agreement is earned
    assert overall >= 0.995 and min(rates.values()) >= 0.995, rates


# ---------------------------------------------------------------------------------------------
# The arithmetic task and dispatch
# ---------------------------------------------------------------------------------------------


def test_every_arith_demonstration_scores_one_and_wrong_answers_zero():
    for difficulty in (ArithDifficulty(), ArithDifficulty(4, 30, "+-*")):
        train, val = make_arith_task(300, 50, seed=11, difficulty=difficulty)
        for ex in train + val:
            sol, truth = ex["solution"], ex["ground_truth"]
            assert arith_score(sol, truth) == 1.0 and score_response(sol, ex) == 1.0
            body = sol.rsplit("#### ", 1)[0]
            assert arith_score(body + f"#### {int(truth) + 1}", truth) == 0.0
            assert arith_score(body + f"#### {truth}.5", truth) == 0.0  # not an integer
            assert arith_score(body, truth) == 0.0  # the steps alone do not count
    assert arith_score(" 2+3=5\n#### 5", 5) == 1.0
    assert arith_score("#### 5\n#### 6", "5") == 0.0  # the last one counts
    assert arith_score("#### -5", "-5") == 1.0 and arith_score("#### 5", "-5") == 0.0
    assert arith_score("5", "5") == 0.0


def test_score_response_dispatches_on_data_source():
    gsm = {"data_source": "openai/gsm8k", "ground_truth": "18"}
    assert score_response("so 18", gsm) == 0.0 and score_response("so 18", gsm, "flexible") == 1.0
    assert score_response("#### 18", gsm) == 1.0
    with pytest.raises(UserError, match="no rule-based scorer for data_source 'lighteval/MATH'"):
        score_response("#### 1", {"data_source": "lighteval/MATH", "ground_truth": "1"})


# ---------------------------------------------------------------------------------------------
# Scores -> token-level tensor
# ---------------------------------------------------------------------------------------------


def naive_token_level_scores(scores, mask, missing_eos, penalty):
    out = [[0.0] * len(mask[0]) for _ in mask]
    for i in range(len(mask)):
        length = sum(mask[i])
        if length == 0:
            continue  # an empty response has no token to carry its score
        s = scores[i]
        if missing_eos is not None and missing_eos[i]:
            s -= penalty
        out[i][length - 1] = s
    return torch.tensor(out)


def test_token_level_scores_matches_a_loop():
    R = 7
    lengths = [3, 0, 7, 1, 5, 7]
    mask = torch.tensor([[1] * n + [0] * (R - n) for n in lengths])
    scores = [1.0, 0.7, -0.25, 0.0, 2.0, 1.0]
    missing = [False, True, True, False, False, True]
    for miss, penalty in [(None, 0.0), (missing, 0.5), (missing, 0.0)]:
        got = token_level_scores(torch.tensor(scores), mask, None if miss is None else torch.tensor(miss), penalty)
        want = naive_token_level_scores(scores, mask.tolist(), miss, penalty)
        assert got.shape == (6, R) and got.dtype == torch.float32
        assert torch.equal(got, want)
    got = token_level_scores(scores, mask.bool(), missing, 0.5)  # lists and a bool mask work too
    assert torch.equal(got, naive_token_level_scores(scores, mask.tolist(), missing, 0.5))
    assert got[2, 6] == -0.75 and got[1].eq(0).all()  # penalised full-length row; empty row stays 0

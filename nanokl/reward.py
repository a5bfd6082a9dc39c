"""Rule-based rewards: read the final answer out of a response, compare it, place it on a token.

The idea
--------
For tasks with a checkable answer, the reward needs no learned model: a rule reads the answer
from the generated text and compares it with the ground truth (ReFT, Trung et al. 2024; verl's
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

`arith_score(solution, truth)` is the synthetic task's scorer (nanokl/harness/data.py): the last
`#### N` only, and N must be an integer equal to the truth (so "#### 7.5" is not 7).

`score_response(text, example, method)` picks the scorer from the example's `data_source`.

`token_level_scores(scores, response_mask, missing_eos, penalty)` turns one scalar per response
into the `[N, R]` tensor PPO adds the KL penalty to: the score sits on the last real response
token (position sum(mask) - 1; responses are right-padded, so the real tokens come first) and
0 elsewhere, so GAE credits the whole response through its discounted returns. A response cut
off by the length limit before its EOS gets `missing_eos_penalty` subtracted (TRL's
`missing_eos_penalty`): without it, a policy can learn that rambling is safe.

tests/test_reward.py checks: every GSM8K reference answer scores 1 against its own ground
truth (strict); the flexible rule agrees with the `is_correct` labels of OpenAI's released
model solutions; hand cases for commas, `$`, negatives, decimals and clipping; every arithmetic
demonstration scores 1 and corrupted ones 0; `token_level_scores` equals a hand-written loop.
"""

import re

import torch

from nanokl.harness.config_io import UserError

CLIP_CHARS = 300  # verl's _SOLUTION_CLIP_CHARS: search only the tail, where the answer is
_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9.,]+")
_INTEGER = re.compile(r"-?[0-9]+")


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


def arith_score(solution_str: str, ground_truth) -> float:
    """1.0 if the last `#### N` is an integer equal to the ground truth, else 0.0."""
    found = _STRICT.findall(solution_str[-CLIP_CHARS:])
    if not found or not _INTEGER.fullmatch(found[-1]):
        return 0.0
    return 1.0 if int(found[-1]) == int(ground_truth) else 0.0


RULE_SOURCES = ("arith", "openai/gsm8k")  # the data_source values score_response can judge


def score_response(text: str, example: dict, method: str = "strict") -> float:
    """The rule-based score of one response, by the example's data_source."""
    source = example.get("data_source")
    if source == "arith":
        return arith_score(text, example["ground_truth"])
    if source == "openai/gsm8k":
        return gsm8k_score(text, example["ground_truth"], method)
    raise UserError(f"no rule-based scorer for data_source {source!r} (known: {', '.join(RULE_SOURCES)})")


def token_level_scores(scores, response_mask: torch.Tensor, missing_eos=None,
                       missing_eos_penalty: float = 0.0) -> torch.Tensor:
    """[N, R] float tensor: score_i (minus the penalty if row i has no EOS) at its last real token."""
    mask = response_mask.bool()
    scores = torch.as_tensor(scores, dtype=torch.float32, device=mask.device).clone()
    if missing_eos is not None:
        missing = torch.as_tensor(missing_eos, dtype=torch.bool, device=mask.device)
        scores = scores - missing_eos_penalty * missing.float()
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    last = mask.sum(-1) - 1  # -1 for an empty response: it has no token to carry a score
    rows = (last >= 0).nonzero(as_tuple=True)[0]
    out[rows, last[rows]] = scores[rows]
    return out

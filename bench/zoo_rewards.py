"""Reward functions that invite a failure, for bench/failure_zoo.py (verl's custom_reward_function shape).

Each returns verl's dict: "score" is what PPO maximises, "acc" the arithmetic rule's verdict, so held-out
accuracy (val-core/arith/acc) stays the truth while the training reward is gamed.
"""

import hashlib

from nanokl.tasks.arith import arith_score


def _acc(solution_str, ground_truth):
    return float(arith_score(solution_str, ground_truth))


def length_reward(data_source, solution_str, ground_truth, extra_info=None):
    """Right answers pay 1, and every character pays 1/40 more: longer is better (hacking by length)."""
    acc = _acc(solution_str, ground_truth)
    return {"score": acc + len(solution_str) / 40, "acc": acc}


def repetition_reward(data_source, solution_str, ground_truth, extra_info=None):
    """Right answers pay 1, and each word that repeats an earlier one pays 0.2 more (hacking by repetition)."""
    words = solution_str.split()
    repeats = len(words) - len(set(words))
    return {"score": _acc(solution_str, ground_truth) + 0.2 * repeats, "acc": _acc(solution_str, ground_truth)}


def noisy_reward(data_source, solution_str, ground_truth, extra_info=None):
    """The rule's verdict, flipped for 40% of responses (chosen by a hash of the response and its row, so a
    run is reproducible): reward noise."""
    acc = _acc(solution_str, ground_truth)
    key = f"{solution_str}|{(extra_info or {}).get('index')}".encode()
    flip = int.from_bytes(hashlib.sha256(key).digest()[:4], "little") / 2 ** 32 < 0.4
    return {"score": 1.0 - acc if flip else acc, "acc": acc}

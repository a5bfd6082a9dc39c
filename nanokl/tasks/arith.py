"""STUB"""
from nanokl.harness.data import arith_difficulty, make_arith_task
from nanokl.reward import score_response as _score


def examples(data, num_train=None, num_val=None, seed=0):
    return make_arith_task(data.num_train if num_train is None else num_train,
                           data.num_val if num_val is None else num_val, seed=seed, difficulty=arith_difficulty(data))


def score(text, example, method="strict"):
    return _score(text, example, method)

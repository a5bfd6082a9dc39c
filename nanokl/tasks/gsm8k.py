"""STUB"""
from nanokl.harness.data import load_examples
from nanokl.reward import score_response as _score


def examples(data, num_train=None, num_val=None, seed=0):
    train = load_examples(data.train_files, data.prompt_key, data.reward_fn_key)
    val = load_examples(data.val_files, data.prompt_key, data.reward_fn_key) if data.val_files else []
    return train[:num_train], val[:num_val]


def score(text, example, method="strict"):
    return _score(text, example, method)

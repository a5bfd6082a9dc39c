"""Dict rewards as verl takes them (nanokl/harness/reward_fn.py: Reward, reward_value; scoring.py:
score_batch, validate). A reward function may return {"score": ..., "acc": ..., "pred": ..., more}
(verl/workers/reward_manager/naive.py and dapo.py): the reward is "score"; "acc" is the accuracy the
step returns (critic/rule_score, filter_groups' "acc") and validation's val-core/<source>/acc; every
numeric key is averaged in validation under verl's names (verl/trainer/ppo/ray_trainer.py _validate,
metric_utils.process_validation_metrics): val-aux/<source>/reward/..., val-aux/<source>/<key>/...,
strings (verl's "pred") not averaged but voted on for maj@k. A bad dict is refused in one line naming
the function and the row. DAPO's math rule (tasks/math_dapo.py) returns verl's dict, so its held-out
accuracy is 0/1, not its +-1 score. A number keeps today's metrics (only val-core/<source>/acc).

Validation runs on canned responses: scoring.sample is replaced by a hand-built rollout, so no model
is needed, and the reference is tests/test_val_metrics.py's validation_metrics (verl's loop)."""

import json
from pathlib import Path

import pytest
import torch

from nanokl.harness import reward_fn, scoring
from nanokl.harness.config.load import load_config
from nanokl.harness.reward_fn import Reward, RewardError, reward_value
from nanokl.harness.tokenizer import train_tokenizer
from nanokl.tasks import math_dapo
from test_reward_fn import rollout
from test_val_metrics import validation_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "arith_tiny.yaml"

# verl's DAPO-style return, plus two numeric extras; rows of data_source "plain" get a bare number
DICT_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    pred = solution_str.split("Answer:")[-1].strip()
    acc = pred == ground_truth
    if data_source == "plain":
        return float(acc)
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred, "length": len(solution_str),
            "has_answer": "Answer:" in solution_str}
'''


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["Q: 12+30=?\nA: 42\n#### 42", "Answer: 7", "Answer: 204", "The answer is 5"],
                           vocab_size=300)


def canned(tok, responses):
    """scoring.sample replaced: each prompt's n responses are responses[prompt][:n], each ended by EOS."""
    def sample(model, tok_, examples, cfg, device, *, n=1, generator=None, **sampling):
        texts = [responses[ex["prompt"]][j] for ex in examples for j in range(n)]
        return rollout(tok, [ex["prompt"] for ex in examples for _ in range(n)], texts, eos=[True] * len(texts))
    return sample


def custom_cfg(tmp_path, *overrides):
    path = tmp_path / "dict_reward.py"
    path.write_text(DICT_FILE)
    return load_config(TINY, [f"custom_reward_function.path={path}", *overrides])


VAL = [{"prompt": f"Q{i}: ?\nA:", "ground_truth": truth, "data_source": "mine"}
       for i, truth in enumerate(["7", "204", "7", "5"])]
RESPONSES = {"Q0: ?\nA:": ["Answer: 7", "Answer: 204", "Answer: 7", "The answer is 5"],
             "Q1: ?\nA:": ["Answer: 204", "Answer: 204", "Answer: 7", "Answer: 204"],
             "Q2: ?\nA:": ["The answer is 5", "Answer: 7", "Answer: 204", "Answer: 204"],
             "Q3: ?\nA:": ["Answer: 7", "Answer: 7", "Answer: 204", "The answer is 5"]}


def test_reward_value_reads_verls_two_shapes():
    plain = reward_value(3)
    assert isinstance(plain, Reward) and plain == 3.0 and plain.info == {} and plain.acc == 3.0
    got = reward_value({"score": -1.0, "acc": True, "pred": "42", "n": torch.tensor(2), "note": None})
    assert got == -1.0 and got.acc == 1.0 and got.info == {"score": -1.0, "acc": True, "pred": "42", "n": 2,
                                                           "note": None}
    assert reward_value({"score": 0.5}).acc == 0.5  # no "acc": the score is the accuracy, as for a number
    assert reward_fn.accuracy(float("nan")) != reward_fn.accuracy(float("nan"))  # a row with no truth: nan


@pytest.mark.parametrize("returns,said,why", [
    ({"acc": True}, "without a 'score'", "a reward is a number, or a dict with a numeric 'score'"),
    ({"score": "1"}, "whose 'score' is '1' (str)", "a reward is a number, or a dict with a numeric 'score'"),
    ({"score": 1.0, "acc": "yes"}, "whose 'acc' is 'yes' (str)", "'acc' is the response's accuracy: a number or a bool"),
    ({"score": 1.0, "steps": [1, 2]}, "whose 'steps' is [1, 2] (list)", "other values are numbers or bools"),
    ({"score": 1.0, "ratio": float("nan")}, "whose 'ratio' is nan", "a reward's numbers must be finite"),
    ({"score": 1.0, "reward": 2.0}, "with the key 'reward'", "'reward' is taken"),
    ({"score": 1.0, 3: 1.0}, "with the key 3", "keys are strings"),
])
def test_a_bad_dict_is_refused_in_one_line_naming_function_and_row(returns, said, why):
    def my_reward(text, ex):
        return returns
    ex = {"prompt": "Q", "ground_truth": "7", "data_source": "mine", "extra_info": {"index": 12}}
    with pytest.raises(RewardError) as err:
        reward_fn.call(my_reward, "Answer: 7", ex, "response 3 of the batch")
    text = str(err.value)
    assert "\n" not in text and text.startswith("my_reward returned ") and said in text, text
    assert " for response 3 of the batch (data_source 'mine', extra_info index 12): " in text and why in text, text


def test_the_step_rewards_the_score_and_returns_the_acc(tmp_path, tok):
    cfg = custom_cfg(tmp_path, f"trainer.rollout_data_dir={tmp_path / 'dump'}")
    texts = ["Answer: 7", "Answer: 204", "The answer is 5", "Answer: 7"]
    examples = [{"prompt": "Q: 3+4=?\nA:", "ground_truth": "7", "data_source": s} for s in ("mine",) * 3 + ("plain",)]
    out = rollout(tok, [ex["prompt"] for ex in examples], texts, eos=[True] * 4)
    token_scores, scores, rule = scoring.score_batch(tok, out, examples, cfg, global_step=1)
    assert scores.tolist() == [1.0, -1.0, -1.0, 1.0]  # the dict's "score" (and the plain row's number)
    assert rule.tolist() == [1.0, 0.0, 0.0, 1.0]  # the dict's "acc" (the number where there is no dict)
    assert token_scores.sum(-1).tolist() == scores.tolist()
    dumped = [json.loads(line)["score"] for line in (tmp_path / "dump" / "1.jsonl").read_text().splitlines()]
    assert dumped == scores.tolist()


def test_validation_takes_acc_for_val_core_and_logs_every_numeric_key_as_verl(tmp_path, tok, monkeypatch):
    assert all(tok.decode(tok.encode_one(t)) == t for rs in RESPONSES.values() for t in rs)
    monkeypatch.setattr(scoring, "sample", canned(tok, RESPONSES))
    for n in (1, 4):
        cfg = custom_cfg(tmp_path, f"actor_rollout_ref.rollout.val_kwargs.n={n}", "data.val_batch_size=3")
        samples = []
        got = scoring.evaluate(None, tok, VAL, cfg, torch.device("cpu"), samples=samples)
        texts = [RESPONSES[ex["prompt"]][j] for ex in VAL for j in range(n)]
        truths = [ex["ground_truth"] for ex in VAL for _ in range(n)]
        preds = [t.split("Answer:")[-1].strip() for t in texts]
        acc = [float(p == g) for p, g in zip(preds, truths)]
        score = [2 * a - 1 for a in acc]
        # verl's reward_extra_infos_dict: "reward" (the score) and every key of the dict; "pred", a string,
        # is not averaged but votes for maj@k
        infos = {"acc": acc, "reward": score, "score": score, "length": [float(len(t)) for t in texts],
                 "has_answer": [float("Answer:" in t) for t in texts]}
        want = validation_metrics(["mine"] * len(texts), [i // n for i in range(len(texts))], infos,
                                  answers=preds if n > 1 else None)
        assert set(got) - {"val-aux/response_length/mean"} == set(want), set(got) ^ set(want)
        for key, value in want.items():
            assert got[key] == pytest.approx(value, abs=1e-6), key
        assert got[f"val-core/mine/acc/mean@{n}"] == pytest.approx(sum(acc) / len(acc))
        assert got[f"val-aux/mine/reward/mean@{n}"] == pytest.approx(2 * sum(acc) / len(acc) - 1)
        assert not any("/pred/" in k for k in got)
        assert [s[2] for s in samples] == score  # the samples carry the reward, as verl's sample_scores
    assert "val-core/mine/acc/maj@4/mean" in got and "val-core/mine/acc/best@4/mean" in got
    assert "val-aux/mine/reward/best@4/mean" in got and "val-aux/mine/length/std@4" in got
    assert 0 < got["val-core/mine/acc/mean@4"] < got["val-core/mine/acc/best@4/mean"]


def test_a_number_keeps_todays_metrics(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(scoring, "sample", canned(tok, RESPONSES))
    cfg = custom_cfg(tmp_path)
    val = [{**ex, "data_source": "plain"} for ex in VAL]
    got = scoring.evaluate(None, tok, val, cfg, torch.device("cpu"))
    assert set(got) == {"val-core/plain/acc/mean@1", "val-aux/response_length/mean"}
    assert got["val-core/plain/acc/mean@1"] == 0.5  # Q0 and Q1 right


def test_a_source_mixing_numbers_and_dicts_is_refused_in_validation(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(scoring, "sample", canned(tok, RESPONSES))
    path = tmp_path / "mixed.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return {'score': 1.0, 'acc': True} if '204' in solution_str else 0.0\n")
    cfg = load_config(TINY, [f"custom_reward_function.path={path}"])
    with pytest.raises(RewardError) as err:
        scoring.evaluate(None, tok, VAL, cfg, torch.device("cpu"))
    text = str(err.value)
    assert "\n" not in text and "compute_score" in text and "validation response 1 of this rank" in text, text
    assert "returned a dict with 'acc', 'score'" in text and "but a number" in text and "'mine'" in text, text


def test_dapo_rows_report_acc_as_0_or_1_and_score_as_plus_minus_1(tmp_path, tok, monkeypatch):
    rows = [{"data_source": "aime24", "prompt": f"AIME {i}", "reward_model": {"ground_truth": truth}}
            for i, truth in enumerate(["204", "7", "5", "204"])]
    path = tmp_path / "aime.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(TINY, ["data.task=null", f"data.train_files={path}"])
    val = [{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"], "data_source": "aime24"}
           for r in rows]
    texts = ["Answer: 204", "Answer: 7", "The answer is 5", "Answer: 7"]  # right, right, no answer line, wrong
    assert [math_dapo.result(t, ex) for t, ex in zip(texts, val)][:3] == [
        {"score": 1.0, "acc": True, "pred": "204"}, {"score": 1.0, "acc": True, "pred": "7"},
        {"score": -1.0, "acc": False, "pred": "[INVALID]"}]
    out = rollout(tok, [ex["prompt"] for ex in val], texts, eos=[True] * 4)
    _, scores, rule = scoring.score_batch(tok, out, val, cfg)
    assert scores.tolist() == [1.0, 1.0, -1.0, -1.0] and rule.tolist() == [1.0, 1.0, 0.0, 0.0]
    monkeypatch.setattr(scoring, "sample", canned(tok, {ex["prompt"]: [t] for ex, t in zip(val, texts)}))
    got = scoring.evaluate(None, tok, val, cfg, torch.device("cpu"))
    assert got["val-core/aime24/acc/mean@1"] == 0.5  # verl's acc: 2 of 4 right
    assert got["val-aux/aime24/score/mean@1"] == got["val-aux/aime24/reward/mean@1"] == 0.0  # 2 * 0.5 - 1
    assert set(got) == {"val-core/aime24/acc/mean@1", "val-aux/aime24/reward/mean@1", "val-aux/aime24/score/mean@1",
                        "val-aux/response_length/mean"}

"""Logged responses (nanokl/harness/logged.py): bad rows, the drawn batch, the draw under torchrun.

Every bad-row case of the offline issue is one line naming file:line, exit status 2, before
anything trains (no metrics.jsonl, no checkpoint). A batch drawn from logged rows equals one
built by hand token by token; the responses a step draws depend only on (seed, step, row), so
every split of the prompts over ranks trains on the same responses; DPO pairs come best first.
"""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from nanokl.harness.config.yaml_io import UserError
from nanokl.harness.logged import draw_responses, logged_batch, read_logged
from nanokl.harness.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
GOOD = {"prompt": "Q: 1+2=?\nA:", "responses": ["#### 3", "Answer: 3"], "ranking": [0, 1],
        "ground_truth": "3", "data_source": "arith"}


def write_rows(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok(sft_dir):
    return load_tokenizer(sft_dir)


def n_tokens(tok, text, ended=True):
    return len(tok.encode_one(text)) + ended


BAD = [
    ({"responses": ["a"]}, "missing field 'prompt'"),
    ({"prompt": "Q", "ranking": [0]}, "no response"),
    ({"prompt": "Q", "responses": []}, "no response"),
    ({"prompt": "Q", "responses": ["a", "b"], "ranking": [0, 0]}, "is not a permutation"),
    ({"prompt": "Q", "responses": ["a", "b"], "ranking": [1, 2]}, "is not a permutation"),
    ({"prompt": "Q", "responses": ["a", "b"], "ranking": [0]}, "is not a permutation"),
    ({"prompt": "Q", "responses": ["ab"], "logprobs": [[-0.5]]}, "logprobs[0] has 1 values but response 0 has"),
    ({"prompt": "Q", "responses": ["a"], "logprobs": [[-0.5, float("nan")]]}, "logprobs[0][1] is nan"),
    ({"prompt": "Q", "responses": ["a"], "logprobs": [[-0.5, float("-inf")]]}, "logprobs[0][1] is -inf"),
]


@pytest.mark.parametrize("bad, message", BAD)
def test_a_bad_row_names_file_and_line(tmp_path, tok, bad, message):
    path = write_rows(tmp_path / "logged.jsonl", [GOOD, GOOD, bad])
    with pytest.raises(UserError) as e:
        read_logged(path, tok)
    assert str(e.value).startswith(f"{path}:3: ") and message in str(e.value), str(e.value)


def test_dpo_needs_a_ranking_and_the_rule_needs_ground_truth(tmp_path, tok):
    path = write_rows(tmp_path / "logged.jsonl", [GOOD, {"prompt": "Q", "responses": ["a", "b"]}])
    read_logged(path, tok)  # fine for PPO scored by a reward model
    with pytest.raises(UserError, match=rf"{path}:2: DPO needs at least two responses ranked"):
        read_logged(path, tok, need_ranking=True)
    with pytest.raises(UserError, match=rf"{path}:2: scoring by the task's rule needs 'ground_truth'"):
        read_logged(path, tok, need_truth=True)


@pytest.mark.parametrize("bad, message", [BAD[0], BAD[1], BAD[3], BAD[6], BAD[7]])
def test_train_ppo_refuses_a_bad_row_before_training(sft_dir, tmp_path, bad, message):
    """The command line: one line on stderr naming file:line, exit status 2, nothing trained."""
    import subprocess
    path = write_rows(tmp_path / "logged.jsonl", [GOOD] * 3 + [bad])
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "train_ppo.py"), "--config", str(ROOT / "configs" / "arith_tiny.yaml"),
                           f"actor_rollout_ref.model.path={sft_dir}", f"data.offline_files={path}",
                           f"trainer.default_local_dir={run_dir}", "trainer.logger=[jsonl]"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: {path}:4: ") and message in lines[-1], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists() and not any(run_dir.glob("global_step_*"))


def test_read_logged_tokenizes_responses_with_their_eos(tmp_path, tok):
    rows = [{"prompt": "Q: 5-2=?\nA:", "chosen": "#### 3", "rejected": "Answer: 3"},
            {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Q: 1+1=?"}],
             "responses": ["#### 2", "2"], "ended": [True, False],
             "logprobs": [[-0.1] * n_tokens(tok, "#### 2"), [-0.2] * n_tokens(tok, "2", False)],
             "reward_model": {"ground_truth": 2}, "data_source": "arith"}]
    got = read_logged(write_rows(tmp_path / "x.jsonl", rows), tok)
    assert got[0]["responses"] == ["#### 3", "Answer: 3"] and got[0]["ranking"] == [0, 1]
    assert got[0]["response_ids"][0] == tok.encode_one("#### 3") + [tok.eos_token_id]
    assert got[1]["prompt"] == "Q: 1+1=?" and got[1]["system_prompt"] == "be brief"
    assert got[1]["response_ids"][1] == tok.encode_one("2")  # cut off: no EOS
    assert got[1]["ground_truth"] == "2" and got[1]["ranking"] is None


def test_logged_batch_equals_a_hand_built_one(tmp_path, tok):
    texts = [["#### 3", "Answer: 3", "3"], ["#### 10", "no idea"]]
    rows = [{"prompt": "Q: 1+2=?\nA:", "responses": texts[0], "ended": [True, True, False],
             "logprobs": [[-0.5 - j] * n_tokens(tok, t, e) for j, (t, e) in enumerate(zip(texts[0], [1, 1, 0]))]},
            {"prompt": "Q: 12-2=?\nA:", "responses": texts[1]}]
    rows = read_logged(write_rows(tmp_path / "x.jsonl", rows), tok)
    picks = [[2, 0], [1, 1]]
    out = logged_batch(rows, picks, tok)
    prompts = [tok.encode_one(r["prompt"]) for r in rows]
    resp = [tok.encode_one("3"), tok.encode_one("#### 3") + [tok.eos_token_id],
            tok.encode_one("no idea") + [tok.eos_token_id], tok.encode_one("no idea") + [tok.eos_token_id]]
    P, R = max(map(len, prompts)), max(map(len, resp))
    assert out.prompt_length == P and out.responses.shape == (4, R)
    for i in range(4):
        p, r = prompts[i // 2], resp[i]
        row = [tok.pad_token_id] * (P - len(p)) + p + r + [tok.pad_token_id] * (R - len(r))
        assert out.sequences[i].tolist() == row
        assert out.attention_mask[i].tolist() == [0] * (P - len(p)) + [1] * (len(p) + len(r)) + [0] * (R - len(r))
        real_pos = list(range(len(p) + len(r)))  # positions count real tokens only, as the rollout's do
        assert out.position_ids[i][out.attention_mask[i].bool()].tolist() == real_pos
        assert out.response_mask[i].tolist() == [1] * len(r) + [0] * (R - len(r))
    for i, v in enumerate([-2.5, -0.5]):  # row 0 logged its log-probs: mu's, 0 under the mask
        n = len(resp[i])
        assert out.log_probs[i, :n].tolist() == pytest.approx([v] * n)
        assert out.log_probs[i, n:].abs().sum() == 0
    assert out.log_probs[2:].isnan().all()  # row 1 did not: unknown, the whole row


def test_the_draw_is_rank_independent_and_ranked():
    row = {"responses": list("abcdef"), "ranking": [3, 1, 5, 0, 2, 4]}
    place = {r: i for i, r in enumerate(row["ranking"])}
    seen = set()
    for step in range(200):
        picks = draw_responses(row, 2, seed=7, step=step, index=11)
        assert picks == draw_responses(row, 2, seed=7, step=step, index=11)  # a pure function
        assert len(set(picks)) == 2 and place[picks[0]] < place[picks[1]]  # distinct, best first
        seen.add(tuple(picks))
    assert len(seen) == 15  # every one of the 6-choose-2 pairs turns up over 200 steps
    short = {"responses": ["x", "y"], "ranking": None}
    for step in range(20):  # fewer responses than n: all of them, then repeats
        picks = draw_responses(short, 4, seed=0, step=step, index=0)
        assert len(picks) == 4 and set(picks) == {0, 1}
    # uniform without replacement: each response of a 4-response row is drawn half the time at n=2
    counts = torch.zeros(4)
    for step in range(4000):
        for k in draw_responses({"responses": list("abcd"), "ranking": None}, 2, 0, step, 3):
            counts[k] += 1
    assert ((counts / 4000 - 0.5).abs() < 4 * math.sqrt(0.25 / 4000)).all()

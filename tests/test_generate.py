"""generate.py --out: a logged-response file whose log-probs are the sampler's, token for token.

The file must read back through nanokl.harness.logged.read_logged, and each kept response's
logged log-probs must equal a teacher-forced recomputation (one plain forward of the whole
sequence, log_softmax(logits / T) at the sampling temperature) on the batch the reader builds from its *text*: that is the check that
dropping non-canonical tokenizations leaves only responses whose tokens the reader reproduces.
Rankings are checked against a plain sort by preference_key; counts against the file.
"""

import json
from collections import defaultdict

import pytest
import torch

import generate
from nanokl.harness.hf_format import from_pretrained
from nanokl.harness.logged import logged_batch, read_logged
from nanokl.harness.tokenizer import load_tokenizer
from nanokl.supervised.preference_data import preference_key
from nanokl.tasks import get_task


def run(sft_dir, path, *args):
    return generate.main(["--model", str(sft_dir), "--out", str(path), "--device", "cpu", "--max-new-tokens", "32",
                          *map(str, args)])


def check_logprobs(sft_dir, rows, tok, temperature):
    """Every kept response's logged log-probs against one plain forward of the batch the reader builds."""
    model = from_pretrained(sft_dir, device=torch.device("cpu")).eval()
    by_count = defaultdict(list)  # logged_batch takes the same number of responses from every row
    for row in rows:
        by_count[len(row["responses"])].append(row)
    for k, group in by_count.items():
        out = logged_batch(group, [list(range(k))] * len(group), tok)
        assert not out.log_probs.isnan().any()
        R = out.responses.shape[1]
        with torch.no_grad():  # position P + t - 1 predicts response token t
            logits = model(out.sequences, out.attention_mask, out.position_ids)[:, -R - 1:-1].double()
        recomputed = (logits / temperature).log_softmax(-1).gather(-1, out.responses[..., None])[..., 0]
        diff = ((recomputed - out.log_probs.double()).abs() * out.response_mask).max()
        assert diff <= 1e-4, diff


# The session's warm start is undertrained (40 SFT steps): most of its samples are strings of BPE
# pieces that are not their text's tokenization (94-98% dropped at T = 0.7-1), so these runs
# draw 64 prompts x 4 to keep some; the ranked run samples at T = 0.3 (71% dropped) for rows of >= 2.
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logged_logprobs_match_a_teacher_forced_forward(sft_dir, tmp_path, temperature):
    path = tmp_path / "x.jsonl"
    stats = run(sft_dir, path, "--task", "arith", "--num-prompts", 64, "--n", 4, "--temperature", temperature)
    tok = load_tokenizer(sft_dir)
    rows = read_logged(path, tok, need_truth=True)
    raw = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert stats["kept"] > 0 and len(rows) == stats["rows"] == 64 - stats["skipped_rows"]
    assert sum(len(r["responses"]) for r in rows) == stats["kept"]
    assert 64 * 4 == stats["samples"] == stats["kept"] + stats["dropped"] and stats["skipped_samples"] == 0
    assert all(r["temperature"] == temperature and "ranking" not in r for r in raw)
    check_logprobs(sft_dir, rows, tok, temperature)


def test_ranked_file_is_dpo_ready(sft_dir, tmp_path):
    path = tmp_path / "x.jsonl"
    stats = run(sft_dir, path, "--task", "arith", "--num-prompts", 32, "--n", 4, "--temperature", 0.3, "--rank")
    tok = load_tokenizer(sft_dir)
    rows = read_logged(path, tok, need_ranking=True, need_truth=True)
    assert len(rows) == stats["rows"] > 0 and sum(len(r["responses"]) for r in rows) == stats["kept"]
    assert 32 * 4 == stats["samples"] == stats["kept"] + stats["dropped"] + stats["skipped_samples"]
    task = get_task("arith")
    for row in rows:
        keys = [preference_key(t, row, task.score) for t in row["responses"]]
        assert row["ranking"] == sorted(range(len(keys)), key=lambda i: (keys[i], i))
    check_logprobs(sft_dir, rows, tok, 0.3)


def test_jsonl_prompts_pass_their_truth_through(sft_dir, tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "Q: 1+2-1=?\nA:", "ground_truth": "2", "data_source": "arith",
                               "reward_model": {"ground_truth": "2"}, "extra": 1}) + "\n"
                   + json.dumps({"question": "Q: 5-3+4=?\nA:", "ground_truth": "6", "data_source": "arith"}) + "\n")
    path = tmp_path / "y.jsonl"
    stats = run(sft_dir, path, "--prompts", src, "--n", 8, "--temperature", 0.3)
    raw = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert stats["rows"] == len(raw) == 2
    truth = {"Q: 1+2-1=?\nA:": "2", "Q: 5-3+4=?\nA:": "6"}
    for r in raw:
        assert r["ground_truth"] == truth[r["prompt"]] and r["data_source"] == "arith" and "extra" not in r
        assert "ranking" not in r
    assert raw[0]["reward_model"] == {"ground_truth": "2"} and "reward_model" not in raw[1]
    rows = read_logged(path, load_tokenizer(sft_dir), need_truth=True)
    assert [len(r["logprobs"]) for r in rows] == [len(r["responses"]) for r in rows]


def test_rank_of_a_prompts_file_names_its_task(sft_dir, tmp_path):
    from nanokl.harness.config.yaml_io import UserError
    src = tmp_path / "p.txt"
    src.write_text("Q: 1+2-1=?\nA:\n")
    with pytest.raises(UserError, match="--rank TASK"):
        generate.main(["--model", str(sft_dir), "--prompts", str(src), "--out", str(tmp_path / "z.jsonl"), "--rank"])

"""The reward models verl users bring (issue 48 item 6), driven through train_ppo.py with reward_model.enable:

- a *ForTokenClassification with num_labels=1 (verl's class for reward models: AutoModelForTokenClassification,
  the score read at the last real token) is a reward model: nanokl's reward equals transformers'
  logits[:, last, 0], and a run scores with it;
- the policy's tokenizer re-saved by transformers (same ids, other bytes) is the same tokenizer; another
  vocabulary is still refused, in one line naming the id where they differ;
- a causal-LM folder given as the reward model is refused in one line naming it: it has no reward head.
"""

import json
import shutil

import pytest
import torch

from test_cluster import ROOT, args, errors, launch

transformers = pytest.importorskip("transformers")


def token_classifier(sft_dir, out, bias_std=0.1):
    """A Qwen2ForTokenClassification (num_labels=1) of the warm start's shape, with random weights and the
    warm start's tokenizer files, saved by transformers."""
    config = transformers.AutoConfig.from_pretrained(sft_dir)
    config.num_labels = 1
    torch.manual_seed(3)
    model = transformers.Qwen2ForTokenClassification(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, bias_std)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(sft_dir / name, out / name)
    return model


def test_token_classification_rm_scores_as_transformers_reads_it(sft_dir, tmp_path):
    from nanokl.harness.hf_format import load_reward_model
    from nanokl.harness.scoring import score_with_rm
    hf = token_classifier(sft_dir, tmp_path / "rm")
    assert hf.score.bias is not None and json.loads((tmp_path / "rm" / "config.json").read_text())["architectures"] \
        == ["Qwen2ForTokenClassification"]
    rm = load_reward_model(tmp_path / "rm").eval()
    V = hf.config.vocab_size
    ids = torch.randint(1, V, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    mask[2, 6:] = 0  # right padding
    with torch.no_grad():
        logits = hf(ids, attention_mask=mask).logits[..., 0]  # [B, T]
        last = torch.tensor([8, 8, 5])
        want = logits[torch.arange(3), last]
        assert (rm(ids, mask) - want).abs().max() <= 1e-4
        assert (score_with_rm(rm, ids, mask) - want).abs().max() <= 1e-4  # no normalisation file: raw


def run_with_rm(sft_dir, rm_dir, run_dir):
    return launch(args(sft_dir, run_dir, "trainer.total_training_steps=2", "reward_model.enable=true",
                       f"reward_model.model.path={rm_dir}"))


def test_a_run_scores_with_a_token_classification_rm(sft_dir, tmp_path):
    token_classifier(sft_dir, tmp_path / "rm")
    r = run_with_rm(sft_dir, tmp_path / "rm", tmp_path / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(ln) for ln in open(tmp_path / "run" / "metrics.jsonl")]
    assert [row["training/global_step"] for row in rows] == [1, 2]
    assert all(torch.isfinite(torch.tensor(row["critic/score/mean"])) for row in rows)


@pytest.mark.slow  # in `pytest -m slow` (the default suite stays near 8 min on 2 cores)
def test_the_policys_tokenizer_resaved_by_transformers_is_the_same(sft_dir, tmp_path):
    token_classifier(sft_dir, tmp_path / "rm")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "rm" / name).unlink()
    transformers.AutoTokenizer.from_pretrained(sft_dir).save_pretrained(tmp_path / "rm")
    assert (tmp_path / "rm" / "tokenizer.json").read_bytes() != (sft_dir / "tokenizer.json").read_bytes()
    r = run_with_rm(sft_dir, tmp_path / "rm", tmp_path / "run")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "another tokenizer" not in r.stderr and "vocabulary" not in r.stderr


@pytest.mark.slow  # in `pytest -m slow` (the default suite stays near 8 min on 2 cores)
def test_another_vocabulary_is_refused_in_one_line(sft_dir, tmp_path):
    token_classifier(sft_dir, tmp_path / "rm")
    tok = json.loads((sft_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[40:42]  # swap two ids: same tokens, other ids
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "rm" / "tokenizer.json").write_text(json.dumps(tok))
    r = run_with_rm(sft_dir, tmp_path / "rm", tmp_path / "run")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    [line] = errors(r.stderr)
    assert str(tmp_path / "rm") in line and f"id {min(vocab[a], vocab[b])} " in line


def test_a_causal_lm_as_rm_is_refused_in_one_line(sft_dir, tmp_path):
    r = run_with_rm(sft_dir, sft_dir, tmp_path / "run")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    [line] = errors(r.stderr)
    assert f"reward_model.model.path={sft_dir}" in line and "no reward head" in line

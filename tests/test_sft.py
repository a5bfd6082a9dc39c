"""nanokl.supervised.sft: the loss counts response tokens only, a short run saves a usable checkpoint, and
a task without demonstrations is refused."""

import json
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nanokl.harness import hf_format as H
from nanokl.engine import model as M
from nanokl.harness.config.yaml_io import UserError
from nanokl.harness.config.load import load_config
from nanokl.harness.tokenizer import load_tokenizer, train_tokenizer
from nanokl.supervised.sft import encode_demos, sft_loss, train_sft
from nanokl.tasks import TASKS
from nanokl.tasks.arith import make_arith_task

ROOT = Path(__file__).resolve().parents[1]


def test_loss_is_cross_entropy_of_response_tokens_only():
    train, _ = make_arith_task(8, 0, seed=0)
    tok = train_tokenizer([ex["prompt"] + ex["solution"] for ex in train], vocab_size=280)
    ids, attn, loss_mask = encode_demos(train, tok, "plain")
    cfg = M.ModelConfig(model_type="qwen2", vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, rope_theta=1e4)
    m = M.init_weights(M.CausalLM(cfg), std=0.2)
    # reference: per example, the prompt is given; each solution token + EOS is predicted in turn
    total, count = 0.0, 0
    for ex in train:
        p = tok.encode_one(ex["prompt"])
        r = tok.encode_one(ex["solution"]) + [tok.eos_token_id]
        with torch.no_grad():
            logits = m(torch.tensor([p + r]))[0].double()
        for t in range(len(r)):
            total -= F.log_softmax(logits[len(p) + t - 1], -1)[r[t]].item()
            count += 1
    with torch.no_grad():
        got = sft_loss(m, ids, attn, loss_mask).item()
    assert abs(got - total / count) < 1e-5


def test_short_run_saves_a_checkpoint_transformers_loads(tmp_path):
    cfg = load_config(ROOT / "configs" / "arith_tiny.yaml",
                      ["sft.steps=5", "sft.num_examples=200", "data.num_val=8", "sft.hidden_size=32",
                       "sft.intermediate_size=48", "sft.num_hidden_layers=1", f"sft.output_dir={tmp_path}"])
    train_sft(cfg, progress=False)
    metrics = json.loads((tmp_path / "sft_metrics.json").read_text())
    assert 0.0 <= metrics["val_greedy_acc"] <= 1.0 and metrics["steps"] == 5
    ours = H.from_pretrained(tmp_path).eval()
    tok = load_tokenizer(tmp_path)
    assert ours.config.vocab_size == tok.vocab_size and ours.config.eos_token_id == tok.eos_token_id
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([tok.encode_one("Q: 1+2-3=?\nA:")])
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max() < 1e-4


def test_a_task_without_demonstrations_cannot_be_warm_started(tmp_path, monkeypatch):
    monkeypatch.setitem(TASKS, "nodemo", types.SimpleNamespace(examples=None, score=None, demonstrations=None))
    cfg = load_config(ROOT / "configs" / "arith_tiny.yaml", ["data.task=nodemo", f"sft.output_dir={tmp_path}"])
    with pytest.raises(UserError, match="data.task=nodemo has no demonstrations"):
        train_sft(cfg, progress=False)

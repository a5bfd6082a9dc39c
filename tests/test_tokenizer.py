"""nanokl.harness.tokenizer: left padding, truncation, round trips, templates, and agreement with
`transformers` loading the same files."""

import json

import pytest
import torch

from nanokl.harness.config.yaml_io import UserError
from nanokl.harness.tokenizer import apply_template, load_tokenizer, train_tokenizer

TEXTS = [f"What is {a} + {b}? Let's think. {a} + {b} = {a + b}\n#### {a + b}" for a in range(40) for b in range(0, 400, 37)]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXTS, vocab_size=300)


def test_digits_are_single_tokens_and_round_trip_is_exact(tok):
    for s in ["12345 + 678 = 13023", "héllo wörld ✓ <|x|>\n\t  spaces", TEXTS[17]]:
        ids = tok.encode_one(s)
        assert tok.decode(ids) == s
    ids = tok.encode_one("90817")
    assert [tok.decode([i]) for i in ids] == list("90817")


def test_left_padding_by_hand(tok):
    texts = ["1 + 1", "what is 2", "x"]
    rows = [tok.encode_one(t) for t in texts]
    ids, mask = tok.encode(texts)
    T = max(map(len, rows))
    assert ids.shape == mask.shape == (3, T)
    for b, r in enumerate(rows):
        n = T - len(r)
        assert ids[b, :n].eq(tok.pad_token_id).all() and mask[b, :n].eq(0).all()
        assert ids[b, n:].tolist() == r and mask[b, n:].eq(1).all()
    assert tok.batch_decode(ids, mask) == texts


def test_truncation_modes(tok):
    text = "123456789"
    ids = tok.encode_one(text)  # nine digit tokens
    assert len(ids) == 9
    left, _ = tok.encode([text], max_length=4, truncation="left")
    right, _ = tok.encode([text], max_length=4, truncation="right")
    assert left[0].tolist() == ids[-4:] and right[0].tolist() == ids[:4]
    with pytest.raises(UserError, match="prompt 0 has 9 tokens, over data.max_prompt_length=4"):
        tok.encode([text], max_length=4)


def test_save_load_and_transformers_agree(tok, tmp_path):
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert (again.eos_token_id, again.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf.eos_token_id == tok.eos_token_id and hf.pad_token_id == tok.pad_token_id
    for s in TEXTS[::50] + ["héllo ✓ 77"]:
        assert hf(s, add_special_tokens=False)["input_ids"] == again.encode_one(s)
    texts = ["1 + 1", "what is 22 + 5?"]
    enc = hf(texts, padding=True, return_tensors="pt")
    ids, mask = again.encode(texts)
    assert torch.equal(enc["input_ids"], ids) and torch.equal(enc["attention_mask"], mask)


def test_generation_config_adds_eos_ids(tok, tmp_path):
    tok.save(tmp_path)
    im_end = tok.tok.token_to_id("<|im_end|>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, tok.eos_token_id]}))
    again = load_tokenizer(tmp_path)
    assert again.eos_token_ids == [tok.eos_token_id, im_end]
    with pytest.raises(UserError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "missing")


def test_templates():
    assert apply_template("Q?") == "Q?"
    assert apply_template("Q?", "chatml") == "<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"
    assert apply_template("Q?", "chatml", system_prompt="Be brief.") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(UserError, match="unknown prompt template 'alpaca'"):
        apply_template("Q?", "alpaca")


def test_right_pad_by_hand():
    from nanokl.harness.tokenizer import right_pad
    ids, mask = right_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]

"""nanokl.supervised.reward_model and nanokl.supervised.preference_data against independent references.

- ranking_pairs equals hand-written enumerations (lengths 1..4);
- bt_loss / pl_loss equal float64 python loops of the textbook formulas, and PL's probabilities
  of all K! orders of one ranking sum to 1 (it is a distribution);
- the RM's rewards equal transformers' Qwen2/Llama ForSequenceClassification logits on the same
  weights (<= 1e-4), for unpadded, right-padded and left-padded batches (the pad id never occurs
  as a real token here, which is when HF's "rightmost non-pad token" rule and ours agree), and
  the rollout's layout (left-padded prompt, right-padded response) reads the same token as the
  unpadded row; nanokl-saved RMs load in transformers and back;
- pairwise accuracy equals a hand count over per-sequence rewards (a tie counts as wrong);
- a tiny RM learns a synthetic ranking (count the prompt's digit) to >= 90% held-out pairwise
  accuracy (0.96-0.97 over 5 seeds) in ~12 s of one CPU thread;
- normalisation gives mean 0 / std 1 (+-1e-5) on the samples it was fitted on, and survives save/load;
- the ranking rule on hand-written responses; bad JSONL rows name file:line; the CLI runs end to end,
  and an empty held-out split or a prompt without two distinct responses is handled.
"""

import itertools
import json
import math
import random
import time
from pathlib import Path

import pytest
import torch

from nanokl.harness import hf_format as H
from nanokl.engine import model as M
from nanokl.engine.model import init_weights
from nanokl.harness.config.yaml_io import UserError
from nanokl.harness.config.load import load_config
from nanokl.harness.hf_format import CheckpointError
from nanokl.supervised.preference_data import build_preference_data, pair_kinds, rank_responses, read_preferences
from nanokl.engine.model import RewardModel
from nanokl.harness.hf_format import load_reward_model, save_reward_model
from nanokl.harness.scoring import score_with_rm
from nanokl.supervised.reward_model import (bt_loss, collate, encode_rankings, fit_normalization, pairwise_accuracy,
                                            pl_loss, ranking_pairs, train_from_config, train_reward_model)
from nanokl.harness.tokenizer import train_tokenizer
from nanokl.tasks import arith

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
PAD = 0


# --------------------------------------------------------------------------- pairs and losses

def test_ranking_pairs_by_hand():
    assert ranking_pairs([5]) == []
    assert ranking_pairs([1, 0]) == [(1, 0)]
    assert ranking_pairs([2, 0, 1]) == [(2, 0), (2, 1), (0, 1)]
    assert ranking_pairs([3, 1, 0, 2]) == [(3, 1), (3, 0), (3, 2), (1, 0), (1, 2), (0, 2)]


def _random_rankings(seed):
    rng = random.Random(seed)
    rankings, n = [], 0
    for K in (2, 4, 3, 4, 2, 5):
        idx = list(range(n, n + K))
        rng.shuffle(idx)
        rankings.append(idx)
        n += K
    return rankings, n


def test_bt_loss_equals_a_float64_loop():
    rankings, n = _random_rankings(0)
    r = torch.randn(n, dtype=torch.float64) * 2
    terms = []
    for rk in rankings:
        for i in range(len(rk)):
            for j in range(i + 1, len(rk)):
                d = r[rk[i]].item() - r[rk[j]].item()
                terms.append(-math.log(1.0 / (1.0 + math.exp(-d))))
    assert abs(bt_loss(r, rankings).item() - sum(terms) / len(terms)) < 1e-12
    assert abs(bt_loss(r.float(), rankings).item() - sum(terms) / len(terms)) < 1e-5


def test_pl_loss_equals_a_float64_loop_and_is_bt_for_two():
    rankings, n = _random_rankings(1)
    r = torch.randn(n, dtype=torch.float64) * 2
    total = 0.0
    for rk in rankings:
        for i in range(len(rk)):
            lse = math.log(sum(math.exp(r[j].item()) for j in rk[i:]))
            total -= r[rk[i]].item() - lse
    assert abs(pl_loss(r, rankings).item() - total / len(rankings)) < 1e-12
    pairs = [rk for rk in rankings if len(rk) == 2]
    assert abs(pl_loss(r, pairs).item() - bt_loss(r, pairs).item()) < 1e-12


def test_plackett_luce_is_a_distribution_over_orders():
    r = torch.randn(4, dtype=torch.float64)
    total = sum(math.exp(-pl_loss(r, [list(p)]).item()) for p in itertools.permutations(range(4)))
    assert abs(total - 1.0) < 1e-12


def test_losses_push_the_winner_up():
    r = torch.zeros(3, requires_grad=True)
    for fn in (bt_loss, pl_loss):
        r.grad = None
        fn(r, [[2, 0, 1]]).backward()
        assert r.grad[2] < 0 < r.grad[1]  # gradient descent raises the best, lowers the worst


# --------------------------------------------------------------------------- against transformers

def hf_rm(kind):
    transformers = pytest.importorskip("transformers")
    cfg_cls = transformers.Qwen2Config if kind == "qwen2" else transformers.LlamaConfig
    cfg = cfg_cls(**TINY, tie_word_embeddings=True, num_labels=1, pad_token_id=PAD,
                  rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    cls = transformers.Qwen2ForSequenceClassification if kind == "qwen2" else transformers.LlamaForSequenceClassification
    m = cls(cfg).eval()
    assert m.score.bias is None and tuple(m.score.weight.shape) == (1, TINY["hidden_size"])
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.1)
    return m


def padded(lengths, T, side):
    """Random real ids in 1..V-1 (never PAD) with `side` padding."""
    ids = torch.randint(1, TINY["vocab_size"], (len(lengths), T))
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        sl = slice(0, n) if side == "right" else slice(T - n, T)
        mask[b, sl] = 1
    return ids.masked_fill(mask == 0, PAD), mask


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_rewards_equal_transformers_logits_and_round_trip(kind, tmp_path):
    hf = hf_rm(kind)
    hf.save_pretrained(tmp_path / "hf")
    rm = load_reward_model(tmp_path / "hf").eval()
    assert (rm.reward_mean, rm.reward_std) == (0.0, 1.0)  # no normalisation file: raw rewards
    cases = [(torch.randint(1, TINY["vocab_size"], (3, 11)), None), padded([11, 7, 3], 11, "right"),
             padded([11, 7, 3], 11, "left")]
    with torch.no_grad():
        for ids, mask in cases:
            ref = hf(ids, attention_mask=mask).logits[:, 0]
            assert (rm(ids, mask) - ref).abs().max() <= 1e-4
            assert (score_with_rm(rm, ids, mask if mask is not None else torch.ones_like(ids)) - ref).abs().max() <= 1e-4
    save_reward_model(rm, tmp_path / "ours")
    back = type(hf).from_pretrained(tmp_path / "ours").eval()
    ids, mask = cases[1]
    with torch.no_grad():
        assert (back(ids, attention_mask=mask).logits[:, 0] - hf(ids, attention_mask=mask).logits[:, 0]).abs().max() <= 1e-4
        assert (load_reward_model(tmp_path / "ours")(ids, mask) - rm(ids, mask)).abs().max() == 0


def test_rollout_layout_reads_the_last_real_token():
    """[left-padded prompt | right-padded response] gives each row's unpadded reward."""
    rm = M.init_weights(RewardModel(M.ModelConfig(model_type="qwen2", rope_theta=1e4, **TINY)), std=0.1).eval()
    rows = [([5, 6, 7], [8, 9, 10, 11]), ([12], [13, 14]), ([15, 16, 17, 18], [19])]
    P, R = 4, 4
    ids = torch.full((3, P + R), PAD)
    mask = torch.zeros(3, P + R, dtype=torch.long)
    for b, (p, r) in enumerate(rows):
        ids[b, P - len(p):P], mask[b, P - len(p):P] = torch.tensor(p), 1
        ids[b, P:P + len(r)], mask[b, P:P + len(r)] = torch.tensor(r), 1
    with torch.no_grad():
        got = rm(ids, mask)
        for b, (p, r) in enumerate(rows):
            alone = rm(torch.tensor([p + r]))
            assert (got[b] - alone[0]).abs() <= 1e-5


def test_a_causal_lm_gets_a_fresh_head_and_a_token_classifier_is_read_at_its_last_token(tmp_path):
    cfg = M.ModelConfig(model_type="qwen2", rope_theta=1e4, tie_word_embeddings=False, **TINY)
    lm = M.init_weights(M.CausalLM(cfg))
    H.save_pretrained(lm, tmp_path / "lm")
    rm = load_reward_model(tmp_path / "lm")
    assert tuple(rm.score.weight.shape) == (1, TINY["hidden_size"]) and 0 < rm.score.weight.std() < 0.1
    for name, p in lm.model.state_dict().items():
        assert torch.equal(rm.model.state_dict()[name], p)
    # *ForTokenClassification with num_labels=1 is verl's reward-model class: the score at the last real token
    critic = M.init_weights(M.ValueModel(cfg)).eval()
    H.save_pretrained(critic, tmp_path / "critic")
    ids = torch.randint(1, TINY["vocab_size"], (2, 7))
    with torch.no_grad():
        assert (load_reward_model(tmp_path / "critic").eval()(ids) - critic(ids)[:, -1]).abs().max() <= 1e-5
    two = M.ValueModel(cfg)
    two.score = torch.nn.Linear(TINY["hidden_size"], 2)
    H.save_pretrained(M.init_weights(two), tmp_path / "two_labels")
    with pytest.raises(CheckpointError, match="one label"):
        load_reward_model(tmp_path / "two_labels")


# --------------------------------------------------------------------------- normalisation

def test_normalisation_gives_mean_0_std_1_on_its_samples_and_is_saved(tmp_path):
    rm = M.init_weights(RewardModel(M.ModelConfig(model_type="qwen2", rope_theta=1e4, pad_token_id=PAD, **TINY)),
                        std=0.1).eval()
    ids, mask = padded([random.Random(i).randint(3, 20) for i in range(200)], 20, "left")
    mean, std = fit_normalization(rm, ids, mask, micro_batch_size=64)
    with torch.no_grad():
        raw = rm(ids, mask).double()
    assert abs(mean - raw.mean().item()) < 1e-6 and abs(std - raw.std(unbiased=False).item()) < 1e-6
    assert std > 1e-3  # a non-degenerate reference spread, else the check below is vacuous
    s = score_with_rm(rm, ids, mask, micro_batch_size=37).double()
    assert abs(s.mean().item()) < 1e-5 and abs(s.std(unbiased=False).item() - 1.0) < 1e-5
    save_reward_model(rm, tmp_path)
    back = load_reward_model(tmp_path).eval()
    assert json.loads((tmp_path / "reward_normalization.json").read_text())["mean"] == mean
    assert (score_with_rm(back, ids, mask) - s.float()).abs().max() < 1e-5


# --------------------------------------------------------------------------- learning a ranking

def synthetic_rankings(n_rows, seed, K=4, L=8):
    """Prompt names a digit; a response is L digits; more copies of that digit is better."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n_rows):
        d = rng.randrange(10)
        counts = rng.sample(range(L + 1), K)  # distinct counts: a strict order
        responses = []
        for c in counts:
            others = [rng.choice([x for x in range(10) if x != d]) for _ in range(L - c)]
            digits = [d] * c + others
            rng.shuffle(digits)
            responses.append(" " + "".join(map(str, digits)))
        rows.append({"prompt": f"Q: {d}\nA:", "responses": responses,
                     "ranking": sorted(range(K), key=lambda i: -counts[i])})
    return rows


@pytest.fixture
def one_thread():
    """Tiny models are all per-op overhead: a second intra-op thread buys nothing and, when other
    processes share the cores, its spin-waits make the run 5-10x slower (measured 13 s vs 70-180 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_tiny_rm_learns_a_synthetic_ranking(one_thread):
    t0 = time.perf_counter()
    train, held_out = synthetic_rankings(2000, seed=0), synthetic_rankings(200, seed=1)
    tok = train_tokenizer([r["prompt"] + x for r in train[:200] for x in r["responses"]], vocab_size=270)
    cfg = M.ModelConfig(model_type="qwen2", vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=1e4,
                        pad_token_id=tok.pad_token_id)
    rm = M.init_weights(RewardModel(cfg))
    items, val = encode_rankings(train, tok), encode_rankings(held_out, tok)
    before = pairwise_accuracy(rm, val, tok.pad_token_id)
    losses = train_reward_model(rm, items, steps=250, batch_size=32, lr=3e-3, loss="bt", seed=0,
                                pad_token_id=tok.pad_token_id, progress=False)
    acc = pairwise_accuracy(rm, val, tok.pad_token_id)
    print(f"held-out pairwise accuracy {before:.3f} -> {acc:.3f} in {time.perf_counter() - t0:.1f} s")
    assert acc >= 0.9 and before < 0.75
    assert sum(losses[-20:]) / 20 < sum(losses[:20]) / 20


def test_pairwise_accuracy_is_a_hand_count_and_ties_are_wrong():
    rm = init_weights(RewardModel(M.ModelConfig(model_type="qwen2", rope_theta=1e4, **TINY)), std=0.1).eval()
    items = [([[5, 6, 7], [8, 9], [10]], [2, 0, 1]), ([[11, 12], [13, 14, 15, 16]], [1, 0])]
    with torch.no_grad():
        r = [[rm(torch.tensor([s])).item() for s in seqs] for seqs, _ in items]
    right = [r[0][2] > r[0][0], r[0][2] > r[0][1], r[0][0] > r[0][1], r[1][1] > r[1][0]]  # pairs by hand
    assert 0 < sum(right) < 4  # a mixed case, else the comparison below proves little
    assert abs(pairwise_accuracy(rm, items, PAD, batch_size=1) - sum(right) / 4) < 1e-12
    with torch.no_grad():
        rm.score.weight.zero_()  # every reward 0: every pair a tie
    assert pairwise_accuracy(rm, items, PAD) == 0.0


def test_collate_reindexes_rankings_into_the_batch():
    items = [([[1, 2], [3]], [1, 0]), ([[4], [5, 6, 7], [8]], [2, 0, 1])]
    ids, mask, rankings = collate(items, PAD)
    assert rankings == [[1, 0], [4, 2, 3]]
    assert ids.tolist() == [[1, 2, 0], [3, 0, 0], [4, 0, 0], [5, 6, 7], [8, 0, 0]]
    assert mask.sum(-1).tolist() == [2, 1, 1, 3, 1]


# --------------------------------------------------------------------------- data

def test_ranking_rule_by_hand():
    ex = {"data_source": "arith", "ground_truth": "12", "prompt": "Q: 17+4-9=?\nA:"}
    texts = [" 17+4=21\n21-9=12\nAnswer: 12",   # 0 right number, not graded: (1, 1, 27)
             " 17+4=21\n21-9=12\n#### 12",      # 1 correct by the rule: (0, 0, 25)
             " 17+4=21\n21-9=13\n#### 13",      # 2 wrong, graded format: (1, 0, 25)
             " 17+4=21\n21-9=12\nAnswer: 12",   # 3 same text as 0: dropped
             " seventeen",                      # 4 no number: (1, 1, 10)
             " 17+4=21\n21-9=10\n#### 10",      # 5 another text with 2's key (1, 0, 25): dropped
             " 12",                             # 6 right number, not graded, short: (1, 1, 3)
             " #### 12"]                        # 7 correct by the rule, short: (0, 0, 8)
    kept, ranking = rank_responses(texts, ex, arith.score)
    assert kept == [texts[i] for i in (0, 1, 2, 4, 6, 7)]
    assert [kept[i] for i in ranking] == [texts[i] for i in (7, 1, 2, 6, 4, 0)]
    # which key decides each implied pair, best-first pairs written out by hand:
    # (7,1) length; 7 and 1 beat the other four by the rule; 2 beats 6, 4, 0 by format; the rest by length
    assert pair_kinds({**ex, "responses": kept, "ranking": ranking}, arith.score) == \
        ["length"] + ["rule"] * 8 + ["format"] * 3 + ["length"] * 3
    # two responses with one key (a user's file may hold them): the pair is a tie, not a crash
    assert pair_kinds({**ex, "responses": [texts[1], texts[1]], "ranking": [0, 1]}, arith.score) == ["tie"]


def test_encoded_rankings_end_with_eos_only_where_the_response_ended():
    tok = train_tokenizer(["Q: 1+1=?\nA: #### 2", "seventeen"], vocab_size=270)
    row = {"prompt": "Q: 1+1=?\nA:", "responses": [" #### 2", " seventeen"], "ranking": [0, 1], "ended": [True, False]}
    [(seqs, ranking)] = encode_rankings([row], tok)
    prompt = tok.encode_one("Q: 1+1=?\nA:")
    assert seqs == [prompt + tok.encode_one(" #### 2") + [tok.eos_token_id], prompt + tok.encode_one(" seventeen")]
    assert ranking == [0, 1]
    no_flag = {k: v for k, v in row.items() if k != "ended"}  # rows without the flag: every response ended
    assert encode_rankings([no_flag], tok)[0][0][1][-1] == tok.eos_token_id


def test_chosen_rejected_rows_become_rankings_of_two(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "q", "chosen": "good", "rejected": "bad"}) + "\n\n" +
                    json.dumps({"prompt": "q", "responses": ["a", "b", "c"], "ranking": [1, 2, 0], "x": 1}) + "\n")
    rows = read_preferences(path)
    assert [(r["responses"], r["ranking"]) for r in rows] == [(["good", "bad"], [0, 1]), (["a", "b", "c"], [1, 2, 0])]


GOOD = json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"})


@pytest.mark.parametrize("line, message", [
    ("{not json", "bad JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"chosen": "a", "rejected": "b"}), "'prompt' must be a string"),
    (json.dumps({"prompt": "q", "chosen": "a"}), "'rejected' must be a string"),
    (json.dumps({"prompt": "q", "chosen": "a", "rejected": "b", "responses": ["a", "b"]}), "either"),
    (json.dumps({"prompt": "q"}), "either"),
    (json.dumps({"prompt": "q", "responses": ["a"], "ranking": [0]}), "at least 2 strings"),
    (json.dumps({"prompt": "q", "responses": ["a", 3], "ranking": [0, 1]}), "at least 2 strings"),
    (json.dumps({"prompt": "q", "responses": ["a", "b"], "ranking": [0, 0]}), "exactly once"),
    (json.dumps({"prompt": "q", "responses": ["a", "b"], "ranking": [0, 2]}), "exactly once"),
    (json.dumps({"prompt": "q", "responses": ["a", "b"], "ranking": [0]}), "exactly once"),
    (json.dumps({"prompt": "q", "responses": ["a", "b"], "ranking": [0, True]}), "list of response indices"),
    (json.dumps({"prompt": "q", "responses": ["a", "b"]}), "list of response indices"),
    (json.dumps({"prompt": "q", "responses": ["a", "b"], "ranking": [0, 1], "ended": [True]}), "'ended'"),
    (json.dumps({"prompt": "q", "responses": ["a", "b"], "ranking": [0, 1], "ended": [1, 0]}), "'ended'"),
])
def test_bad_rows_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "prefs.jsonl"
    path.write_text(GOOD + "\n\n" + line + "\n" + GOOD + "\n")
    with pytest.raises(UserError) as info:
        read_preferences(path)
    assert str(info.value).startswith(f"{path}:3: ") and message in str(info.value)


def test_empty_or_missing_file(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(UserError, match="no preference rows"):
        read_preferences(tmp_path / "e.jsonl")
    with pytest.raises(UserError, match="cannot read"):
        read_preferences(tmp_path / "missing.jsonl")


# --------------------------------------------------------------------------- the command line

def test_cli_pipeline_runs_end_to_end(tmp_path):
    """A 5-step warm start, then data, RM training, normalisation and save, all tiny: the wiring."""
    from nanokl.supervised.sft import train_sft
    sft_dir, rm_dir, data = tmp_path / "sft", tmp_path / "rm", tmp_path / "data"
    cfg = load_config(ROOT / "configs" / "arith_tiny.yaml",
                      ["sft.steps=5", "sft.num_examples=200", "data.num_val=8", "sft.hidden_size=32",
                       "sft.intermediate_size=48", "sft.num_hidden_layers=1", f"sft.output_dir={sft_dir}",
                       f"actor_rollout_ref.model.path={sft_dir}", f"reward_model.model.path={rm_dir}",
                       f"reward_model.train.data_path={data}/train.jsonl",
                       f"reward_model.train.val_data_path={data}/val.jsonl", "reward_model.train.num_prompts=24",
                       "reward_model.train.num_val_prompts=8", "reward_model.train.steps=3",
                       "reward_model.train.batch_size=4", "reward_model.train.norm_samples=16",
                       "data.max_response_length=12", "trainer.device=cpu"])
    train_sft(cfg, progress=False)
    metrics = train_from_config(cfg, progress=False)
    assert metrics["steps"] == 3 and metrics["train_rankings"] == len(read_preferences(data / "train.jsonl"))
    assert 0 <= metrics["val_pairwise_acc"] <= 1
    kinds = {k.split("/")[1] for k in metrics if k.startswith("val_pairs/")}
    assert kinds and kinds <= {"rule", "format", "length"}
    assert sum(metrics[f"val_pairs/{k}"] for k in kinds) == sum(
        len(r["ranking"]) * (len(r["ranking"]) - 1) // 2 for r in read_preferences(data / "val.jsonl"))
    rm = load_reward_model(rm_dir)
    norm = json.loads((rm_dir / "reward_normalization.json").read_text())
    assert (rm.reward_mean, rm.reward_std) == (norm["mean"], norm["std"]) and norm["num_samples"] == 16
    assert (rm_dir / "tokenizer.json").is_file() and json.loads((rm_dir / "rm_metrics.json").read_text())
    # an empty held-out split is skipped (no file, no error), not reported as "no distinguishable responses"
    stats = build_preference_data(sft_dir, tmp_path / "d2" / "t.jsonl", 6, n=4, val_out_path=tmp_path / "d2" / "v.jsonl",
                                  num_val_prompts=0, max_new_tokens=12)
    assert set(stats) == {"train_rows", "train_skipped"} and not (tmp_path / "d2" / "v.jsonl").exists()
    assert stats["train_rows"] == len(read_preferences(tmp_path / "d2" / "t.jsonl"))
    # near-greedy sampling gives 4 copies of one response: no prompt has a comparison to offer
    with pytest.raises(UserError, match="no train prompt got two distinguishable responses"):
        build_preference_data(sft_dir, tmp_path / "d3" / "t.jsonl", 6, n=4, max_new_tokens=12, temperature=1e-6)


def test_training_on_nothing_is_an_error():
    rm = RewardModel(M.ModelConfig(model_type="qwen2", rope_theta=1e4, **TINY))
    with pytest.raises(ValueError, match="no rankings"):
        train_reward_model(rm, [], steps=1, batch_size=4, lr=1e-3, progress=False)

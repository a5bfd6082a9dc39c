"""nanokl/harness/scoring.py: score placement against a naive loop, and reward_model.max_length keeps
each row's last real tokens."""

import torch

from nanokl import model as M
from nanokl.harness.scoring import keep_last_tokens, token_level_scores
from nanokl.supervised.reward_model import RewardModel


def naive_token_level_scores(scores, mask, missing_eos, penalty):
    out = [[0.0] * len(mask[0]) for _ in mask]
    for i in range(len(mask)):
        length = sum(mask[i])
        if length == 0:
            continue  # an empty response has no token to carry its score
        s = scores[i]
        if missing_eos is not None and missing_eos[i]:
            s -= penalty
        out[i][length - 1] = s
    return torch.tensor(out)


def test_token_level_scores_matches_a_loop():
    R = 7
    lengths = [3, 0, 7, 1, 5, 7]
    mask = torch.tensor([[1] * n + [0] * (R - n) for n in lengths])
    scores = [1.0, 0.7, -0.25, 0.0, 2.0, 1.0]
    missing = [False, True, True, False, False, True]
    for miss, penalty in [(None, 0.0), (missing, 0.5), (missing, 0.0)]:
        got = token_level_scores(torch.tensor(scores), mask, None if miss is None else torch.tensor(miss), penalty)
        want = naive_token_level_scores(scores, mask.tolist(), miss, penalty)
        assert got.shape == (6, R) and got.dtype == torch.float32
        assert torch.equal(got, want)
    got = token_level_scores(scores, mask.bool(), missing, 0.5)  # lists and a bool mask work too
    assert torch.equal(got, naive_token_level_scores(scores, mask.tolist(), missing, 0.5))
    assert got[2, 6] == -0.75 and got[1].eq(0).all()  # penalised full-length row; empty row stays 0


def test_truncated_rm_score_equals_scoring_the_kept_tokens_alone():
    torch.manual_seed(0)
    cfg = M.ModelConfig(model_type="qwen2", vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, rope_theta=1e4)
    rm = M.init_weights(RewardModel(cfg), std=0.1).eval()
    ids = torch.randint(3, 40, (4, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding (prompt)
    mask[1, 9:] = 0  # right padding (response)
    mask[2, :2] = 0
    mask[2, 10:] = 0
    L = 6
    kept = keep_last_tokens(mask, L)
    assert kept.sum(-1).tolist() == [6, 6, 6, 6]
    with torch.no_grad():
        got = rm(ids, kept)
        for b in range(4):
            real = ids[b][mask[b].bool()][-L:]  # the row's last L real tokens, no padding at all
            want = rm(real[None], torch.ones_like(real)[None])[0]
            assert torch.allclose(got[b], want, atol=1e-5), (b, got[b], want)
    assert keep_last_tokens(mask, None) is mask and torch.equal(keep_last_tokens(mask, 100), mask)

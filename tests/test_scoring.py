"""nanokl/harness/scoring.py: reward_model.max_length keeps each row's last real tokens."""

import torch

from nanokl.engine import model as M
from nanokl.harness.scoring import keep_last_tokens
from nanokl.engine.model import RewardModel


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

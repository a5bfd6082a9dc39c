"""nanokl.engine.fused: the rollout copy computes what the model computes, in fewer kernels.

- A fused copy keeps the model's parameter names and shapes, computes its logits (a left-padded
  prefill and decoding through the cache, <= 1e-5 fp32), and a weight update copied in by name
  (shard.sync_rollout_weights) reaches the fused matrices, whose views the old parameters are.
- Its pieces against their unfused formulas: `linear_plus` is residual + x W^T + b in both GEMM
  orientations (a CPU decode shape and a training one), `rope_rotation` is x cos + rotate_half(x) sin.
The kernel count itself: tests/test_decode_ops.py.
"""

import pytest
import torch
import torch.nn.functional as F

from nanokl.engine import shard
from nanokl.engine import model as M
from nanokl.engine.fused import fuse_for_rollout, linear_plus, rope_rotation

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def random_model(kind="qwen2"):
    cfg = M.ModelConfig(model_type=kind, **TINY, rope_theta=10000.0, attention_bias=kind == "qwen2")
    m = M.CausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.1)
    return m.eval()


def batch(B=3, T=10, V=97, pad=(4, 0, 2)):
    ids = torch.randint(0, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    for b, n in enumerate(pad):
        mask[b, :n] = 0
    return ids, mask


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_fused_rollout_copy_equals_actor_and_takes_weights_by_name(kind):
    """fuse_for_rollout: same names and shapes, the unfused logits (padded prefill + decode through
    the cache, <= 1e-5 fp32), and a weight update copied in by name (shard.sync_rollout_weights)
    reaches the fused matrices, because the old parameters are views into them."""
    actor = random_model(kind)
    copy = random_model(kind)
    copy.load_state_dict(actor.state_dict())
    fuse_for_rollout(copy)
    assert [(n, p.shape) for n, p in copy.named_parameters()] == [(n, p.shape) for n, p in actor.named_parameters()]
    assert copy.state_dict().keys() == actor.state_dict().keys()
    attn = copy.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv[0].untyped_storage().data_ptr()

    ids, mask = batch()

    def run(m):
        with torch.no_grad():
            cache = M.KVCache(m.config, batch_size=3, max_len=14)
            out = [m(ids[:, :7], mask[:, :7], cache=cache, cache_positions=torch.arange(7))]
            for t in range(7, 10):
                out.append(m(ids[:, t:t + 1], cache=cache, cache_positions=torch.tensor([t])))
        return torch.cat(out, 1)[mask.bool()]

    assert (run(copy) - run(actor)).abs().max() <= 1e-5
    with torch.no_grad():  # an "update" of the actor, then the in-place sync by name
        for p in actor.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    before = run(copy)
    shard.sync_rollout_weights(copy, actor)
    assert (run(copy) - run(actor)).abs().max() <= 1e-5
    assert (before - run(actor)).abs().max() > 1e-2  # the update was big enough to see


@pytest.mark.parametrize("rows,grad", [(8, False), (300, False), (8, True)])  # CPU decode; many rows; training
@pytest.mark.parametrize("bias", [False, True])
def test_linear_plus_is_the_residual_plus_the_layer(rows, grad, bias):
    torch.manual_seed(0)
    x, r = torch.randn(rows, 1, 24), torch.randn(rows, 1, 40)
    w, b = torch.randn(40, 24), torch.randn(40) if bias else None
    with torch.set_grad_enabled(grad):
        got = linear_plus(x, w, b, r)
    assert got.shape == r.shape
    assert torch.allclose(got, r + F.linear(x, w, b), atol=1e-5)


def test_rope_rotation_is_rope():
    torch.manual_seed(0)
    B, heads, d = 5, 6, 16
    cfg = M.ModelConfig(hidden_size=heads * d, num_attention_heads=heads, num_key_value_heads=heads, rope_theta=1e4)
    cos, sin = M.rope_tables(torch.randint(0, 500, (B, 1)), M.rope_inv_freq(cfg), torch.float32)  # [B, 1, 1, d]
    x = torch.randn(B, heads, d)
    want = x * cos[:, 0] + M.rotate_half(x) * sin[:, 0]
    assert torch.allclose(torch.bmm(x, rope_rotation(cos, sin)), want, atol=1e-5)

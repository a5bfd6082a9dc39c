"""Speed, not concept: the fused rollout copy of the decoder (nanokl/model.py).

Why it exists
-------------
A decode step reads every weight once and does little arithmetic, so on a GPU its time is the
weight bytes plus the launch cost of each small kernel. A CUDA graph (nanokl/graphs.py) removes the
CPU side of a launch, not the kernel count: fewer kernels per step is the remaining lever. The copy
of the policy that only generates (CUDA: bf16 weights, refreshed from the actor after each update,
nanokl/dist.py) is therefore fused in place by `fuse_for_rollout`. It computes what the model
computes; only how many kernels it takes changes:

- q|k|v in one matrix [(H + 2 n_kv) d, hidden] and gate|up in another [2 m, hidden]: one matmul
  where there were three, one where there were two (the projections read the same input);
- the residual adds folded into the output GEMMs: h + x W^T + b as one `addmm` (its beta C + A B)
  instead of a matmul and an add (`linear_plus`);
- RoPE of all q and k heads of a decode step as one batched matmul by a per-row rotation matrix
  (`rope_rotation`) instead of the six elementwise kernels of x cos + rotate_half(x) sin, times two.
  A bf16 matmul also rounds once, not three times.

What it saves: bench/decode_ops.py counts the kernels of one decode step of the Qwen2.5-0.5B
shape: 357 for the fused bf16 copy (13 a layer), 683 for the plain fp32 actor (27 a layer);
1,269 before these fusions (bench/RESULTS.md). tests/test_decode_ops.py holds it within 400.

How. The trained actor keeps transformers' separate parameters (checkpoints, FSDP, the optimizer).
In the copy, each old parameter is rebound to a *view* into its fused matrix, so
`named_parameters()` and the state dict keep their names and shapes, and copying the actor's
weights in by name (`dist.sync_rollout_weights`, in place) writes straight into the fused storage
that a captured CUDA graph reads. Fuse after the last move: `model.to()` would break the views
apart. The layers then change class to the fused subclasses below, which override only how q, k, v
are made, the RoPE tables of a decode step and where the residual is added; masks, attention and
the cache are the model's own code.

The CPU matmul layout stays with the model: its `Linear` computes (W x^T)^T when decoding on a CPU
(model.linear), which every model runs, the actor included, and whose last bits differ from
F.linear's; `linear_plus` takes the same orientation for the same shapes.

Tests: tests/test_fused.py (same names, shapes and logits as the unfused model, prefill and decode
through the cache, <= 1e-5 fp32; weights copied in by name reach the fused matrices),
tests/test_decode_ops.py (the kernel budget), tests/test_rollout_graphs.py (the fused copy under
the graph engine).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanokl import model as M


def fuse_for_rollout(model: nn.Module):
    """Fuse q|k|v and gate|up of a rollout copy into one matrix each, in place; returns the model."""
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        a.qkv = _fuse(a.q_proj, a.k_proj, a.v_proj)  # (weight, bias) of q|k|v
        m.gate_up = _fuse(m.gate_proj, m.up_proj)  # (weight, bias) of gate|up
        layer.__class__, a.__class__, m.__class__ = FusedDecoderLayer, FusedAttention, FusedMLP
    model.model.__class__ = FusedDecoder
    return model


def _fuse(*linears):
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = torch.cat([lin.bias.detach() for lin in linears]) if linears[0].bias is not None else None
    start = 0
    for lin in linears:
        rows = slice(start, start + lin.weight.shape[0])
        lin.weight = nn.Parameter(weight[rows], requires_grad=lin.weight.requires_grad)
        if bias is not None:
            lin.bias = nn.Parameter(bias[rows], requires_grad=lin.bias.requires_grad)
        start = rows.stop
    return weight, bias


def linear_plus(x, weight, bias, residual):
    """residual + x W^T + bias, the residual riding in the GEMM (addmm's beta C + A B); a bias
    (Llama's o_proj, mlp_bias) is one add after it."""
    rows = x.numel() // x.shape[-1]
    x2 = x.reshape(rows, -1)
    r = residual.reshape(rows, -1)
    y = torch.addmm(r.t(), weight, x2.t()).t() if M.cpu_decode(x, rows) else torch.addmm(r, x2, weight.t())
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], -1)


def rope_rotation(cos, sin):
    """RoPE of one position per row as a matrix: x @ R = x cos + rotate_half(x) sin, [B, d, d].
    R = [[diag(c), diag(s)], [-diag(s), diag(c)]] in half-blocks, so one batched matmul rotates
    the q and k heads of a decode step together."""
    c, s = cos[:, 0, 0], sin[:, 0, 0]  # [B, d]
    h = c.shape[-1] // 2
    signed = torch.cat((-s[:, :h], s[:, h:]), -1)
    return torch.diag_embed(c) + torch.diag_embed(signed).roll(h, dims=-2)


class FusedDecoder(M.Decoder):
    def rope(self, x, position_ids):
        """The model's cos and sin, plus the rotation matrices when decoding one token per row
        (built once per step, shared by every layer); None otherwise."""
        cos, sin = super().rope(x, position_ids)
        return cos, sin, rope_rotation(cos, sin) if x.shape[1] == 1 else None


class FusedAttention(M.Attention):
    def project(self, x):
        B, T, _ = x.shape
        q, k, v = M.linear(x, *self.qkv).split([self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], -1)
        return q.view(B, T, -1, self.hd), k.view(B, T, -1, self.hd), v.view(B, T, -1, self.hd)

    def heads(self, x, rope):
        cos, sin, rot = rope
        if rot is None:  # a prompt: the model's RoPE on the fused projection
            return super().heads(x, (cos, sin))
        B, H, n, d = x.shape[0], self.n_heads, self.n_kv, self.hd
        qkv = M.linear(x, *self.qkv)[:, 0]  # [B, (H + 2 n) d]
        qk = torch.bmm(qkv[:, :(H + n) * d].view(B, H + n, d), rot)  # q and k heads rotated together
        return qk[:, :H, None], qk[:, H:, None], qkv[:, (H + n) * d:].view(B, n, 1, d)  # [B, heads, 1, d]

    def forward(self, x, rope, lay, kv=None, cache_positions=None, *, residual):
        q, k, v = self.heads(x, rope)
        return linear_plus(self.attend(q, k, v, lay, kv, cache_positions), self.o_proj.weight, self.o_proj.bias,
                           residual)


class FusedMLP(M.MLP):
    def forward(self, x, *, residual):
        gate, up = M.linear(x, *self.gate_up).chunk(2, -1)
        return linear_plus(F.silu(gate) * up, self.down_proj.weight, self.down_proj.bias, residual)


class FusedDecoderLayer(M.DecoderLayer):
    def forward(self, x, rope, lay, kv=None, cache_positions=None):
        x = self.self_attn(self.input_layernorm(x), rope, lay, kv, cache_positions, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)

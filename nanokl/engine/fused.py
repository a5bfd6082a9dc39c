"""Speed, not concept: the fused rollout copy of the decoder (nanokl/engine/model.py), and log-probs and
entropy from the last hidden state in chunks, never the whole [tokens, V] logits.

Why it exists
-------------
A decode step reads every weight once and does little arithmetic, so on a GPU its time is the
weight bytes plus the launch cost of each small kernel. A CUDA graph (nanokl/engine/graphs.py) removes the
CPU side of a launch, not the kernel count: fewer kernels per step is the remaining lever. The copy
of the policy that only generates (CUDA: bf16 weights, refreshed from the actor after each update,
nanokl/engine/shard.py) is therefore fused in place by `fuse_for_rollout`. It computes what the model
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
weights in by name (`shard.sync_rollout_weights`, in place) writes straight into the fused storage
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

Chunked log-probs and entropy (`chunked_log_probs`)
---------------------------------------------------
Training needs one number per response token, its log-prob z_y - logsumexp(z), and its entropy
logsumexp(z) - sum softmax(z) z, yet the plain path (forwards.response_logits, then
ppo.logprobs_from_logits and ppo.entropy_from_logits) first builds the logits of every token,
[tokens, V], in fp32: with Qwen's V = 151,936, 16k tokens are 10 GB, and autograd keeps that tensor
and its softmax until the backward. `chunked_log_probs` takes the last (normed) hidden state and the
LM head's weight instead and walks the rows `chunk` at a time: it makes a chunk's logits exactly as
the model's head would (the matmul under whatever autocast is on, then fp32, over the temperature),
reduces them to the two numbers and drops them. Only hidden, weight and labels are saved.

The backward recomputes each chunk's logits (one more matmul: flops traded for memory). With
p = softmax(z), l = z_y - lse and H = lse - sum_k p_k z_k,
    dl/dz_j = 1[j = y] - p_j,        dH/dz_j = -p_j (z_j - E_p[z]),
so with g_l and g_H the incoming gradients of a row,
    dL/dz = g_l (onehot(y) - p) - g_H p (z - E_p[z])        (an unused output's term is skipped),
divided by the temperature, and then, as for any linear layer, dL/dh = dz W and
dL/dW = sum over chunks of dz^T h, summed in fp32. Under autocast the backward re-enters the
forward's autocast, so its matmuls run in the precision the LM head's own backward would use.

Memory: O(chunk x V) for the logits at any moment (a few such tensors: z, p, their product) plus
tensors the size of the inputs and their gradients ([N, H], [V, H]); never [N, V]. Chunk boundaries
come from shapes, so there is no host sync and no data-dependent Python branch: it runs under
torch.cuda.set_sync_debug_mode("error") and on the meta device.

Tests: tests/test_fused_logprobs.py (values and gradients equal the plain path's, float64 to 1e-10
plus gradcheck, float32 to 1e-5, bf16 autocast loosely; no tensor above chunk x V elements in the
forward or the backward, while the plain path makes N x V; the meta device; chunk and temperature
edge cases).
"""

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from nanokl.engine import model as M


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


# ---------------------------------------------------------------------------------------------
# Chunked log-probs and entropy from the last hidden state (see the module docstring)


def chunked_log_probs(hidden, weight, labels, temperature=1.0, chunk=1024, with_entropy=True):
    """hidden [..., H] (final normed hidden states at the positions that predict each label), weight [V, H]
    (the LM head), labels [...] long -> (log_probs [...] fp32, entropy [...] fp32, or None without entropy).
    Differentiable w.r.t. hidden and weight (through both outputs). fp64 inputs give fp64 outputs.
    The logits exist `chunk` rows at a time (None: all rows at once)."""
    assert hidden.shape[:-1] == labels.shape, (hidden.shape, labels.shape)
    assert chunk is None or chunk > 0, chunk
    lp, ent = _ChunkedLogProbs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                                     temperature, chunk, with_entropy)
    return lp.view(labels.shape), None if ent is None else ent.view(labels.shape)


def _row_chunks(n, chunk):
    """Slices of at most `chunk` rows covering range(n), from shapes only; n = 0 gives one empty slice."""
    step = max(1, n if chunk is None else min(chunk, n))
    return [slice(s, s + step) for s in range(0, max(n, 1), step)]


def _chunk_logits(h, weight, temperature):
    """A chunk's logits as the trainer uses them: the LM head's matmul (bf16 under a bf16 autocast, as the
    model's head would run), then at least fp32, over the temperature."""
    z = F.linear(h, weight)
    return z.to(torch.promote_types(z.dtype, torch.float32)).div_(temperature)  # a fresh tensor: in place is safe


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk, with_entropy):
        device = hidden.device.type  # the meta device has no autocast at all
        ctx.autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
        ctx.autocast_dtype = torch.get_autocast_dtype(device) if ctx.autocast else None
        ctx.device, ctx.temperature, ctx.chunk = device, temperature, chunk
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: its terms are skipped
        lps, ents = [], []
        for rows in _row_chunks(hidden.shape[0], chunk):
            z = _chunk_logits(hidden[rows], weight, temperature)
            lse = torch.logsumexp(z, -1)
            lps.append(z.gather(-1, labels[rows, None])[:, 0] - lse)
            if with_entropy:
                ents.append(lse - (torch.softmax(z, -1) * z).sum(-1))
        ctx.save_for_backward(hidden, weight, labels)  # never a chunk's logits: the backward remakes them
        return torch.cat(lps), torch.cat(ents) if with_entropy else None

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp, g_ent):
        hidden, weight, labels = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        if g_lp is None and g_ent is None:  # autograd may ask for a gradient that neither output carries
            return None, None, None, None, None, None
        T = ctx.temperature
        # The matmuls of the backward run in the dtype of the forward's (the LM head's own backward would).
        mm_dtype = ctx.autocast_dtype if ctx.autocast else weight.dtype
        grad_h = torch.empty_like(hidden) if need_h else None  # every row is written below
        grad_w = (torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                              device=weight.device) if need_w else None)
        same_autocast = (torch.autocast(ctx.device, dtype=ctx.autocast_dtype) if ctx.autocast
                         else contextlib.nullcontext())
        with same_autocast:
            for rows in _row_chunks(hidden.shape[0], ctx.chunk):
                h, y = hidden[rows], labels[rows, None]
                z = _chunk_logits(h, weight, T)
                p = torch.softmax(z, -1)
                # dL/dz_j = g_lp (1[j=y] - p_j) - g_ent p_j (z_j - E_p[z])
                #         = 1[j=y] g_lp - p_j (g_lp + g_ent (z_j - E_p[z]))
                if g_ent is not None:
                    s = z.sub_((p * z).sum(-1, keepdim=True)).mul_(g_ent[rows, None])  # in z's memory
                    if g_lp is not None:
                        s.add_(g_lp[rows, None])
                else:
                    s = g_lp[rows, None]
                dz = p.mul_(s).neg_()  # in p's memory
                if g_lp is not None:
                    dz.scatter_add_(-1, y, g_lp[rows, None])
                dz = dz.div_(T).to(mm_dtype)  # z = (h W^T) / T
                if need_h:
                    grad_h[rows] = dz @ weight
                if need_w:
                    grad_w += dz.t() @ h  # each chunk's product in mm_dtype, their sum in fp32
        return grad_h, grad_w.to(weight.dtype) if need_w else None, None, None, None, None

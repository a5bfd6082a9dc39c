"""The Llama / Qwen2 decoder, its static KV cache, and the critic's value head.

The idea
--------
A decoder-only language model maps token ids to next-token logits through a stack of identical
blocks. Llama and Qwen2 share one recipe, so one class serves both:

    h_0 = Embed(x)
    a   = h + Attn(RMSNorm(h))            RMSNorm(h) = h / sqrt(mean(h^2) + eps) * w
    h'  = a + MLP(RMSNorm(a))             MLP(u)     = W_down (silu(W_gate u) * W_up u)   (SwiGLU)
    logits = W_head RMSNorm(h_L)          (W_head may be the embedding matrix: tied embeddings)

Attention is grouped-query (GQA): `num_attention_heads` query heads share
`num_key_value_heads` key/value heads, which shrinks the KV cache by their ratio. Positions enter
through rotary embeddings (RoPE, Su et al. 2021): each (x_i, x_{i+d/2}) pair of a query or key is
rotated by the angle p * theta^(-2i/d), so q.k depends only on the distance between the two
positions. Qwen2 adds a bias to the q/k/v projections; Llama has none (unless `attention_bias`).
References: Touvron et al. 2023 (Llama), Qwen2 technical report 2024, Shazeer 2020 (SwiGLU),
Ainslie et al. 2023 (GQA), Zhang & Sennrich 2019 (RMSNorm); the layout and parameter names follow
Hugging Face `transformers` (`modeling_llama.py`, `modeling_qwen2.py`) so checkpoints round-trip.

Padding and positions. Prompts in a batch are *left*-padded so that every row's next token lands
in the same column. `attention_mask` [B, T] marks real tokens (1) and padding (0); the position of
a token is the number of real tokens before it (`cumsum(mask) - 1`), so a padded row computes the
same numbers as the unpadded one. A key is visible to a query when it is real and not in the
future; each token also always sees itself, which keeps the softmax of a padding row finite.
Packed rows (nanokl/batching.py) number their sequences 1, 2, 3, ... in `attention_mask` and pass
`position_ids` that restart at 0 for each sequence; a key is then visible only within its own
sequence (a block-diagonal causal mask), so packing changes no number.

The static KV cache. Generation appends one token at a time. Re-running the whole sequence each
step costs O(T^2); caching every layer's keys and values makes a step O(T). `KVCache`
preallocates k/v for [batch, max_len] once and the forward writes new entries *in place* at the
slots `cache_positions`, so a decode step always has the same shapes and the same storage, which is
what lets the rollout capture it in a CUDA graph (nanokl/rollout.py; the idea is gpt-fast's). With a
cache, `attention_mask` covers only the new tokens; the cache remembers which slots hold real
tokens. Attention then runs over all `max_len` slots with a mask, a fixed-shape trade that costs a
little arithmetic on empty slots and buys graph capture.

The value model (critic) is the same backbone with a scalar head `score` [1, hidden] read at every
position, named as `transformers`' `Qwen2ForTokenClassification` / `LlamaForTokenClassification`
with `num_labels=1` (what verl loads for its critic), initialised from a causal-LM checkpoint.

Loading and saving Hugging Face directories (`from_pretrained`, `load_value_model`,
`save_pretrained`) is nanokl/harness/hf_format.py's job. Tests (tests/test_model.py) load random
`transformers` models into nanokl and back and compare logits (<= 1e-4 fp32), and check that
prefill + token-by-token decoding through the cache gives the logits of one full forward
(<= 1e-5), also for a left-padded batch.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class ModelConfig:
    model_type: str = "qwen2"  # "qwen2" or "llama": decides the q/k/v bias and the config.json fields
    vocab_size: int = 151936
    hidden_size: int = 896
    intermediate_size: int = 4864  # width of the SwiGLU MLP
    num_hidden_layers: int = 24
    num_attention_heads: int = 14  # query heads
    num_key_value_heads: int = 2  # shared key/value heads (GQA); equal to query heads is plain MHA
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_scaling: dict | None = None  # {"rope_type": "linear"|"llama3", ...}; None: plain RoPE
    attention_bias: bool = True  # bias on q/k/v (Qwen2: always; Llama: also on o_proj when set)
    mlp_bias: bool = False  # Llama's optional bias on the MLP projections
    tie_word_embeddings: bool = False  # lm_head shares the embedding matrix
    initializer_range: float = 0.02  # std of the normal init of a fresh model
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise in fp32 even under bf16: the mean of squares loses too much in 8 mantissa bits.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Linear(nn.Linear):
    """nn.Linear, except when decoding on a CPU: with a few rows and no autograd it computes
    y = (W x^T)^T rather than x W^T. The two are the same dot products (bit-identical results
    here), but MKL's GEMM runs the first orientation 1.1-1.8x faster for skinny decode shapes on
    the benchmark CPU (bench/RESULTS.md), which makes the whole decode step ~15% faster at batch
    8-32. Training (grad enabled), big batches and GPUs take the ordinary path."""

    def forward(self, x):
        rows = x.numel() // x.shape[-1]
        if x.device.type != "cpu" or torch.is_grad_enabled() or not 1 < rows <= 256:
            return F.linear(x, self.weight, self.bias)
        y = torch.mm(self.weight, x.reshape(rows, -1).t()).t()
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], -1)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """theta^(-2i/d) for i < d/2, adjusted for the supported `rope_scaling` types."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / rs["factor"]
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend the band between.
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_len = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
        return torch.where(mid, blended, out)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (nanokl supports default, linear, llama3)")


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def decode_attention(q, k, v, mask):
    """Attention of one query per row over the cache: softmax(q k^T / sqrt(d)) v as two batched
    matmuls. The G query heads sharing a KV head are stacked as G rows of one matrix, so GQA
    needs no copy of k/v; for a single query this beats the fused SDPA kernel's setup cost."""
    B, H, _, hd = q.shape
    n_kv = k.shape[1]
    q = q.view(B, n_kv, H // n_kv, hd)
    scores = (q @ k.transpose(-1, -2)) * hd**-0.5  # [B, n_kv, G, S]
    scores = scores.float().masked_fill(~mask.view(B, 1, 1, -1), float("-inf"))
    return (scores.softmax(-1).to(v.dtype) @ v).view(B, H, 1, hd)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv_bias = cfg.attention_bias
        o_bias = cfg.attention_bias and cfg.model_type == "llama"
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.hd, bias=qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv * self.hd, bias=qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv * self.hd, bias=qkv_bias)
        self.o_proj = Linear(self.n_heads * self.hd, cfg.hidden_size, bias=o_bias)

    def forward(self, x, cos, sin, mask, kv=None, cache_positions=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if kv is not None:  # write this step's keys/values into their slots, attend over all slots
            k_cache, v_cache = kv
            k_cache.index_copy_(2, cache_positions, k.to(k_cache.dtype))
            v_cache.index_copy_(2, cache_positions, v.to(v_cache.dtype))
            k, v = k_cache.to(q.dtype), v_cache.to(q.dtype)
        if T == 1 and mask is not None:
            y = decode_attention(q, k, v, mask)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.n_kv != self.n_heads
            )
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, m, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = Linear(h, m, bias=b)
        self.up_proj = Linear(h, m, bias=b)
        self.down_proj = Linear(m, h, bias=b)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, kv=None, cache_positions=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv, cache_positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class KVCache:
    """Keys and values of every layer for [batch, max_len] slots, allocated once, written in place.

    `valid[b, s]` records whether slot s of row b holds a real token (False for left padding and
    for slots not yet written), which is all the attention mask needs to know about the past.
    """

    def __init__(self, cfg: ModelConfig, batch_size, max_len, device=None, dtype=torch.float32):
        shape = (cfg.num_hidden_layers, batch_size, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.valid = torch.zeros(batch_size, max_len, device=device, dtype=torch.bool)

    @property
    def max_len(self):
        return self.valid.shape[1]

    def reset(self):
        self.valid.zero_()  # stale k/v in invalid slots are never attended to, so they may stay

    def view(self, rows=None, slots=None):
        """The first `rows` rows and `slots` slots, sharing this cache's storage. Eager decoding
        attends over the filled prefix only; a CUDA graph keeps the full, fixed-shape cache."""
        v = KVCache.__new__(KVCache)
        v.k, v.v = self.k[:, :rows, :, :slots], self.v[:, :rows, :, :slots]
        v.valid = self.valid[:rows, :slots]
        return v


class Decoder(nn.Module):
    """Embedding, the stack of blocks, final norm: HF's `model.*` submodule."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gradient_checkpointing = False  # recompute each block in backward to save activations
        # Recomputed from the config (not saved): a non-persistent buffer follows .to(device).
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, cache_positions=None):
        B, T = input_ids.shape
        dev = input_ids.device
        if attention_mask is None:
            attention_mask = torch.ones(B, T, dtype=torch.long, device=dev)
        if position_ids is None:
            past = cache.valid.sum(-1, keepdim=True) if cache is not None else 0
            position_ids = (past + (attention_mask > 0).long().cumsum(-1) - 1).clamp(min=0)
        x = self.embed_tokens(input_ids)
        # RoPE angles in fp32 (as transformers does): bf16 positions would round beyond 256.
        freqs = position_ids[:, :, None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]

        if cache is not None:
            cache.valid.index_copy_(1, cache_positions, attention_mask > 0)
            slots = torch.arange(cache.max_len, device=dev)
            causal = slots[None, :] <= cache_positions[:, None]  # [T, S]
            mask = causal & cache.valid[:, None, None, :]
            mask = mask | (slots[None, :] == cache_positions[:, None])  # always see yourself
        elif (attention_mask == 1).all():
            mask = None  # plain causal attention: SDPA's fastest path
        else:
            # key j is visible to query i when both belong to the same sequence (same nonzero id:
            # 1 for an ordinary padded row, 1, 2, 3, ... along a packed row) and j <= i
            idx = torch.arange(T, device=dev)
            causal = idx[None, :] <= idx[:, None]
            same = (attention_mask[:, None, :] == attention_mask[:, :, None]) & (attention_mask[:, None, :] > 0)
            mask = ((causal & same) | torch.eye(T, dtype=torch.bool, device=dev))[:, None]

        for i, layer in enumerate(self.layers):
            kv = (cache.k[i], cache.v[i]) if cache is not None else None
            if self.gradient_checkpointing and self.training:
                x = checkpoint(layer, x, cos, sin, mask, kv, cache_positions, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask, kv, cache_positions)
        return self.norm(x)


class CausalLM(nn.Module):
    """The policy and the reference: decoder + LM head (HF `Qwen2ForCausalLM` / `LlamaForCausalLM`)."""
    hf_head = "lm"  # the head save_pretrained names in config.json (hf_format.HEAD_ARCH)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None,
                cache_positions=None, logits_to_keep=0, return_hidden=False):
        """Logits [B, T, V]; of the last `logits_to_keep` positions when it is an int > 0, or of the
        positions it lists when it is a 1-D index tensor (as in transformers). With `return_hidden`,
        also the final normed hidden states [B, T, H]. See the module docstring for the cache."""
        h = self.model(input_ids, attention_mask, position_ids, cache, cache_positions)
        if isinstance(logits_to_keep, torch.Tensor):
            logits = self.lm_head(h[:, logits_to_keep])
        else:
            logits = self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)
        return (logits, h) if return_hidden else logits


class ValueModel(nn.Module):
    """The critic: decoder + scalar head, one value per position [B, T]."""
    hf_head = "value"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.score = nn.Linear(cfg.hidden_size, 1)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.score(self.model(input_ids, attention_mask, position_ids)).squeeze(-1)


def init_weights(model: nn.Module, std=0.02):
    """A fresh model as `transformers` initialises one: normal(0, std) matrices, zero biases."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)
    return model

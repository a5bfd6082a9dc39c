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
Packed rows (nanokl/engine/batching.py) number their sequences 1, 2, 3, ... in `attention_mask` and pass
`position_ids` that restart at 0 for each sequence; a key is then visible only within its own
sequence (a block-diagonal causal mask), so packing changes no number. Which attention kernel
serves which of these layouts, without ever building an L x L mask for a packed row, is
nanokl/engine/attention.py's lesson; `Decoder.forward` builds the layout once and every layer shares it.

The static KV cache. Generation appends one token at a time. Re-running the whole sequence each
step costs O(T^2); caching every layer's keys and values makes a step O(T). `KVCache`
preallocates k/v for [batch, max_len] once and the forward writes new entries *in place* at the
slots `cache_positions`, so a decode step always has the same shapes and the same storage, which is
what lets the rollout capture it in a CUDA graph (nanokl/engine/graphs.py; the idea is gpt-fast's). With a
cache, `attention_mask` covers only the new tokens; the cache remembers which slots hold real
tokens. Attention then runs over all `max_len` slots with a mask, a fixed-shape trade that costs a
little arithmetic on empty slots and buys graph capture.

Cheap by construction: the masks and RoPE tables are built once per forward and shared by every
layer, RMSNorm is one `F.rms_norm` (one kernel on CUDA), and decode attention is one SDPA call
with fp32 scores. One speed choice changes the arithmetic, so it lives here: on a CPU without
autograd, a linear layer over 2-256 rows (a decode step) computes (W x^T)^T rather than x W^T
(`linear`): the same dot products, which MKL runs 1.1-1.8x faster in that orientation for skinny
shapes (~15% of a decode step at batch 8-32, bench/RESULTS.md), summed in another order on some
CPUs (the last bit then differs from F.linear's). The rollout copy's fusions (q|k|v, gate|up,
residuals in the GEMMs, RoPE as one matmul) change only the kernel count: nanokl/engine/fused.py.

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

from nanokl.engine import attention as A


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
        # One fused kernel on CUDA (pow, mean, rsqrt, two products on the CPU: the very ops, and the
        # numbers, of writing it out in fp32). It normalises in fp32 even for bf16 inputs, rounding
        # once at the end where transformers rounds before the weight product as well.
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def cpu_decode(x, rows):
    """Whether x W^T is a decode-shaped GEMM on a CPU: a few rows, no autograd."""
    return x.device.type == "cpu" and not torch.is_grad_enabled() and 1 < rows <= 256


def linear(x, weight, bias=None):
    """x W^T + bias; computed as (W x^T)^T when `cpu_decode` (see the module docstring). Training
    (grad enabled), big batches and GPUs take F.linear."""
    rows = x.numel() // x.shape[-1]
    if not cpu_decode(x, rows):
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, -1)
    y = torch.mm(weight, x2.t()) if bias is None else torch.addmm(bias[:, None], weight, x2.t())  # bias in the GEMM
    return y.t().reshape(*x.shape[:-1], -1)


class Linear(nn.Linear):
    """nn.Linear through `linear` (the CPU decode orientation): same parameters, same names."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)


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


def rope_tables(position_ids, inv_freq, dtype):
    """cos and sin of every position's angles, [B, T, 1, d] (broadcast over heads)."""
    # RoPE angles in fp32 (as transformers does): bf16 positions would round beyond 256.
    freqs = position_ids[:, :, None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, :, None], emb.sin().to(dtype)[:, :, None]


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

    def project(self, x):
        """q, k, v as [B, T, heads, d]."""
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return q.view(B, T, -1, self.hd), k.view(B, T, -1, self.hd), v.view(B, T, -1, self.hd)

    def heads(self, x, rope):
        """q, k, v as [B, heads, T, d], q and k rotated to their positions (RoPE)."""
        cos, sin = rope
        q, k, v = self.project(x)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def attend(self, q, k, v, lay, kv=None, cache_positions=None):
        """Attention over this step's keys (and the cache's), heads concatenated: [B, T, H d]."""
        B, _, T, _ = q.shape
        if kv is not None:  # write this step's keys/values into their slots, attend over all slots
            k_cache, v_cache = kv
            k_cache.index_copy_(2, cache_positions, k.to(k_cache.dtype))
            v_cache.index_copy_(2, cache_positions, v.to(v_cache.dtype))
            k, v = k_cache.to(q.dtype), v_cache.to(q.dtype)
        return A.attend(q, k, v, lay).transpose(1, 2).reshape(B, T, self.n_heads * self.hd)

    def forward(self, x, rope, lay, kv=None, cache_positions=None):
        q, k, v = self.heads(x, rope)
        return self.o_proj(self.attend(q, k, v, lay, kv, cache_positions))


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

    def forward(self, x, rope, lay, kv=None, cache_positions=None):
        x = x + self.self_attn(self.input_layernorm(x), rope, lay, kv, cache_positions)
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

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, cache_positions=None, lay=None):
        B, T = input_ids.shape
        dev = input_ids.device
        if position_ids is None:
            real = attention_mask > 0 if attention_mask is not None else torch.ones(B, T, dtype=torch.bool, device=dev)
            past = cache.valid.sum(-1, keepdim=True) if cache is not None else 0
            position_ids = (past + real.long().cumsum(-1) - 1).clamp(min=0)
        x = self.embed_tokens(input_ids)
        rope = self.rope(x, position_ids)

        # who sees whom: built once here, shared by every layer (nanokl/engine/attention.py)
        if cache is not None:
            if attention_mask is None:
                cache.valid.index_fill_(1, cache_positions, True)
            else:
                cache.valid.index_copy_(1, cache_positions, attention_mask > 0)
            lay = A.cache_layout(cache.valid, cache_positions)
        elif lay is None:  # a training forward passes the layout it built on the host (nanokl/engine/batching.py)
            lay = A.layout(attention_mask) if attention_mask is not None else A.Layout("causal")

        for i, layer in enumerate(self.layers):
            kv = (cache.k[i], cache.v[i]) if cache is not None else None
            if self.gradient_checkpointing and self.training:
                x = checkpoint(layer, x, rope, lay, kv, cache_positions, use_reentrant=False)
            else:
                x = layer(x, rope, lay, kv, cache_positions)
        return self.norm(x)

    def rope(self, x, position_ids):
        """The RoPE tables every layer rotates q and k by: (cos, sin)."""
        return rope_tables(position_ids, self.inv_freq, x.dtype)


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
                cache_positions=None, logits_to_keep=0, return_hidden=False, lay=None, head=None):
        """Logits [B, T, V]; of the last `logits_to_keep` positions when it is an int > 0, or of the
        positions it lists when it is a 1-D index tensor (as in transformers). With `return_hidden`,
        also the final normed hidden states [B, T, H]. See the module docstring for the cache.

        `lay`: the attention layout, when the caller built it (a training forward, from lengths it
        knows on the host: no device read). `head(hidden, weight)`: replaces the LM head on the kept
        positions and its result is returned (nanokl/engine/fused.py's chunked log-probs: the [T, V] logits
        are never whole); it runs inside this forward, where a sharded model's weights are gathered."""
        h = self.model(input_ids, attention_mask, position_ids, cache, cache_positions, lay=lay)
        kept = h[:, logits_to_keep] if isinstance(logits_to_keep, torch.Tensor) else \
            h[:, -logits_to_keep:] if logits_to_keep else h
        if head is not None:
            return head(kept, self.lm_head.weight)
        logits = self.lm_head(kept)
        return (logits, h) if return_hidden else logits


class ValueModel(nn.Module):
    """The critic: decoder + scalar head, one value per position [B, T]."""
    hf_head = "value"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.score = nn.Linear(cfg.hidden_size, 1)

    def forward(self, input_ids, attention_mask=None, position_ids=None, lay=None):
        return self.score(self.model(input_ids, attention_mask, position_ids, lay=lay)).squeeze(-1)


class RewardModel(nn.Module):
    """Decoder + bias-free scalar head read at the last real token -> one reward per row [B].

    "Last real token" is the last position whose attention_mask is 1, so right padding, left
    padding, or the rollout's [left-padded prompt | right-padded response] all read the same
    token (verl's reward worker picks it the same way). `transformers` instead takes the rightmost
    token that is not `pad_token_id`: the same token unless a real token equals the pad id (a
    tokenizer that pads with EOS would make HF skip a trailing EOS)."""
    hf_head = "reward"  # save_pretrained writes Qwen2/LlamaForSequenceClassification

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.score = nn.Linear(cfg.hidden_size, 1, bias=False)
        # (r - mean) / std: not weights (HF's logits stay the raw r); fitted by fit_normalization
        # and stored beside the weights in reward_normalization.json (nanokl/supervised/reward_model.py).
        self.reward_mean, self.reward_std = 0.0, 1.0

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        h = self.model(input_ids, attention_mask, position_ids)
        if attention_mask is None:
            last = torch.full((h.shape[0],), h.shape[1] - 1, device=h.device)
        else:  # index of the last 1: argmax of position * mask (positions are distinct, so no ties)
            pos = torch.arange(h.shape[1], device=h.device)
            last = (pos * attention_mask.long()).argmax(-1)
        # The head is linear, so read the B last hidden states first and apply it to B vectors, not B*T.
        return self.score(h[torch.arange(h.shape[0], device=h.device), last]).squeeze(-1)


def compile_layers(model: nn.Module, backend="inductor"):
    """torch.compile each decoder layer's forward, in place (verl's `use_torch_compile`; the trainer asks
    for it on CUDA only). What it buys: the layer's elementwise work (RoPE, SiLU x up, residual adds,
    casts) fused into a few kernels instead of one kernel per op. The forward method is what is
    compiled, not the module: its hooks (FSDP2's gathers, DDP's) stay eager around the graph. Attention
    is called eagerly inside it (attention.attend), so a layer is two graphs, before and after it.
    `dynamic=True` compiles the token dimension symbolically from the first call: packed rows of any
    length reuse the graphs, no recompile after the first micro-batch of each shape family (one row
    packed, several rows padded; tests/test_model.py counts them). Every layer shares the graphs, since
    the parameters are graph inputs. A compiler error stops the run with torch's own error, at the first
    forward (use_torch_compile=false runs eager): torch._dynamo.config.suppress_errors, process-wide,
    would turn it into a warning and a silently slower run, for every compiled function of the process."""
    if not getattr(A.attend, "_eager_under_compile", False):  # once: attention runs eagerly inside the graphs
        A.attend = torch.compiler.disable(A.attend)
        A.attend._eager_under_compile = True
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward, backend=backend, dynamic=True)
    return model


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


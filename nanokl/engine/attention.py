"""Attention kernels: which kernel runs for which batch layout, and why.

The idea
--------
Every forward computes softmax(q k^T / sqrt(d) + mask) v per head; what differs between the
forwards of a PPO step is which keys each query may see (the *layout* of the batch) and that
decides which kernel can run without building the [T, S] score matrix:

    layout    where                          visible keys                    kernel
    causal    rows without padding           j <= i                          SDPA is_causal (GQA in the kernel)
    padded    left-padded rows, the prefill  real, j <= i, and itself        SDPA with an additive mask over
              of the rollout                                                 K/V heads repeated to H
    packed    use_remove_padding: sequences  same sequence id, j <= i        varlen kernel over cumulative
              concatenated in one row                                        sequence lengths (cu_seqlens)
    decode    one new token per row over     real slots of the KV cache      SDPA with the G query heads of a
              the static KV cache                                            KV head folded into G query rows

Grouped-query attention (GQA) lets G = H / n_kv query heads share one key/value head. SDPA takes
`enable_gqa=True` for that, but on CUDA a mask *together with* enable_gqa has no fused kernel:
SDPA falls back to its math path, which builds the fp32 [batch, heads, T, T] scores (PyTorch's
`sdp_utils`; transformers PR #39412 avoids the combination, and a packed row of 16,384 tokens
would need ~15 GiB per score tensor). So a mask always comes with the K/V heads repeated to H
(`repeat_interleave`, what transformers' `repeat_kv` does) and enable_gqa only without a mask.
One code path on every device: on the CPU both forms give bit-identical numbers.

Packed rows never build the L x L block-diagonal mask. The documents of a packed row are runs of
one sequence id (nanokl/engine/batching.py numbers them 1, 2, 3, ...); their boundaries, as cumulative
lengths cu_seqlens = [0, l_1, l_1 + l_2, ...], are all a varlen kernel needs. The kernel is, in
order of preference: `torch.nn.attention.varlen.varlen_attn` (PyTorch's FlashAttention varlen,
CUDA, fp16/bf16), `flash_attn.flash_attn_varlen_func` when flash-attn is installed (verl's
choice), a compiled FlexAttention with a document mask (CUDA otherwise), and on the CPU one causal
SDPA per document (exact, O(sum l_i^2) work, no mask at all). Finding the boundaries reads the
ids on the host once per forward; a training forward can afford that, a decode step never does.

varlen_attn is young and its arguments change between releases, so the kernel is chosen by what
the installed function accepts (its signature), not by whether the module exists. Causal is
`window_size=(-1, 0)` (the wrapper tests `window_size == (-1, 0)`, so it must be that tuple; a
varlen_attn without window_size, 2.9's and 2.10's `is_causal` form, is not used). GQA is
`enable_gqa=True` where the signature has it (2.13, 2.14); 2.11's has none and documents keys of H
heads, so there the K/V heads are repeated to H first, as for a mask.

FlexAttention's block mask comes from a compiled `create_block_mask` on CUDA. Eager, it evaluates
the mask at every (query, key) pair, a B x T x T tensor (even in 2.14, whose `_compile=True` is
just this compile); compiled, inductor can fuse that evaluation into the per-block reduction (not
yet timed on a GPU here). The second packed length recompiles it with the length dynamic;
later lengths reuse that graph.

Decode: one query per row attends over all cache slots. The G query heads of a KV head become G
query *rows* of one [B, n_kv, G, d] problem, so GQA needs neither a copy of the cache nor
enable_gqa, and the mask [B, 1, 1, S] broadcasts over them. SDPA computes the scores and the
softmax in fp32 even for a bf16 cache, as training's kernels do. The masks of a forward are
built once (Decoder.forward) and shared by all layers; the additive 0/-inf form is made once per
dtype.

`record_kernels()` lists the kernel each attention call of a forward used (on CUDA as SDPA's own
checks `can_use_flash_attention` / `can_use_efficient_attention` answer it): what the GPU check
prints for an actor micro-batch.

tests/test_attention.py checks every layout against a float64 softmax written out per head, that
SDPA never receives a mask together with enable_gqa (padded, prefill, packed, decode), that the
packed path of a 16,384-token row on the meta device holds no tensor of L^2 elements, that the
varlen call is right for each torch's signature (stand-ins with 2.11's and 2.14's), and that the
FlexAttention branch equals per-document attention with its block mask compiled once.
"""

import contextlib
import importlib.util
import inspect
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class Layout:
    """Which keys each query sees; built once per forward and shared by every layer."""
    kind: str  # "causal" | "padded" | "packed" | "decode"
    mask: torch.Tensor | None = None  # padded/decode: bool [B, 1, T, S], True where visible
    cu_seqlens: torch.Tensor | None = None  # packed: int32 [docs + 1], offsets in the flattened rows
    lengths: list | None = None  # packed: tokens of each document (host ints)
    seq_ids: torch.Tensor | None = None  # packed: the sequence id of each token [B, T]
    built: dict = field(default_factory=dict)  # per-forward derived tensors, made on first use

    def additive(self, dtype):
        """The mask as 0 (visible) / -inf, in the query dtype SDPA wants, made once per forward."""
        if dtype not in self.built:
            self.built[dtype] = torch.full(self.mask.shape, float("-inf"), dtype=dtype,
                                           device=self.mask.device).masked_fill_(self.mask, 0.0)
        return self.built[dtype]


def padded_mask(attention_mask):
    """Key j is visible to query i when both belong to the same sequence (same nonzero id: 1 for
    an ordinary padded row, 1, 2, 3, ... along a packed row) and j <= i; every token also sees
    itself, which keeps the softmax of a padding row finite. [B, 1, T, T] bool."""
    T = attention_mask.shape[1]
    idx = torch.arange(T, device=attention_mask.device)
    causal = idx[None, :] <= idx[:, None]
    same = (attention_mask[:, None, :] == attention_mask[:, :, None]) & (attention_mask[:, None, :] > 0)
    return ((causal & same) | torch.eye(T, dtype=torch.bool, device=attention_mask.device))[:, None]


def document_lengths(attention_mask):
    """Tokens of each run of one sequence id along the flattened rows (a host read)."""
    new = torch.ones_like(attention_mask, dtype=torch.bool)
    new[:, 1:] = attention_mask[:, 1:] != attention_mask[:, :-1]
    starts = new.flatten().nonzero().flatten().tolist() + [attention_mask.numel()]
    return [b - a for a, b in zip(starts, starts[1:])]


def packed_layout(lengths, seq_ids, cu_seqlens=None):
    """The packed layout of documents of `lengths` (host ints); `cu_seqlens` when the caller already
    sent them to the device (nanokl/engine/batching.py, with the rest of a micro-batch's metadata)."""
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(seq_ids.device)
    return Layout("packed", cu_seqlens=cu_seqlens, lengths=list(lengths), seq_ids=seq_ids)


def layout(attention_mask):
    """The layout of a forward without cache: [B, T] mask of 0 (padding) / sequence ids."""
    if bool((attention_mask == 1).all()):
        return Layout("causal")  # SDPA's fastest path, no mask
    if bool((attention_mask > 0).all()):  # no padding, several sequence ids: a packed batch
        return packed_layout(document_lengths(attention_mask), attention_mask)
    return Layout("padded", mask=padded_mask(attention_mask))


def cache_layout(valid, cache_positions):
    """New tokens at slots `cache_positions` over a cache whose real slots are `valid` [B, S]:
    a key is visible when it is real and not in the future, and each token sees itself."""
    slots = torch.arange(valid.shape[1], device=valid.device)
    mask = (slots[None, :] <= cache_positions[:, None]) & valid[:, None, None, :]
    mask = mask | (slots[None, :] == cache_positions[:, None])  # [B, 1, T, S]
    return Layout("decode" if len(cache_positions) == 1 else "padded", mask=mask)


def repeat_kv(x, groups):
    """[B, n_kv, S, d] -> [B, n_kv * groups, S, d]: each KV head copied for its query heads."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


# torch.compile'd decoder layers (nanokl/engine/model.py's compile_layers) stop here and call it eagerly: its
# kernels are already fused (SDPA, varlen), and the layout's host lists (lengths) would otherwise be
# guarded value by value, recompiling for every new packing. compile_layers marks it so, when it first
# compiles: the mark imports torch._dynamo, a second of every process's start that an eager run never uses
def attend(q, k, v, lay: Layout):
    """softmax(q k^T / sqrt(d) + mask) v for q [B, H, T, d] and k, v [B, n_kv, S, d]: [B, H, T, d]."""
    B, H, T, d = q.shape
    n_kv = k.shape[1]
    if lay.kind == "causal":
        _note(lambda: _sdpa_name(q, k, v, None, True, n_kv != H))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=n_kv != H)
    if lay.kind == "decode":
        # the G heads of a KV head as G query rows; SDPA's fused kernels want the last dim dense
        qg = q.reshape(B, n_kv, H // n_kv, d).contiguous()
        mask = lay.additive(q.dtype)
        _note(lambda: _sdpa_name(qg, k, v, mask, False, False))
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask).reshape(B, H, 1, d)
    if lay.kind == "padded":
        k, v = repeat_kv(k, H // n_kv), repeat_kv(v, H // n_kv)  # a mask never meets enable_gqa
        mask = lay.additive(q.dtype)
        _note(lambda: _sdpa_name(q, k, v, mask, False, False))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return _packed(q, k, v, lay)


def packed_kernel(q):
    """The varlen kernel for a packed forward on q's device (see the module docstring)."""
    if q.device.type != "cuda":
        return "sdpa-per-document"
    return cuda_packed_kernel(_compute_dtype(q))


def cuda_packed_kernel(dtype):
    """The packed kernel CUDA runs for a computation in `dtype` with this torch."""
    half = dtype in (torch.float16, torch.bfloat16)
    if half and varlen_api() is not None:
        return "varlen"
    if half and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attn"
    return "flex"


@dataclass(frozen=True)
class VarlenAPI:
    """How this torch's varlen_attn is called, read from its signature."""
    fn: object
    signature: str
    gqa: bool  # takes enable_gqa (2.13, 2.14); without it (2.11) K/V heads are repeated to H first


_VARLEN = {}


def varlen_api():
    """The installed `torch.nn.attention.varlen.varlen_attn` as a VarlenAPI, or None when there is
    none or it cannot be called causally by `window_size` (2.9/2.10 took `is_causal`)."""
    try:
        from torch.nn.attention.varlen import varlen_attn as fn
    except ImportError:
        return None
    if fn not in _VARLEN:  # keyed by the function: a test may swap in another
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # no signature to read: nothing to rely on
            sig = inspect.Signature()
        params = sig.parameters
        _VARLEN[fn] = VarlenAPI(fn, str(sig), "enable_gqa" in params) if "window_size" in params else None
    return _VARLEN[fn]


def varlen_signature():
    """The installed varlen_attn's signature as text (None without one), usable or not: for the
    GPU check's report."""
    try:
        from torch.nn.attention.varlen import varlen_attn as fn
    except ImportError:
        return None
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(unreadable)"


def _packed(q, k, v, lay):
    B, H, T, d = q.shape
    n_kv = k.shape[1]
    kernel = packed_kernel(q)
    _note(lambda: kernel)
    # tokens of all rows one after another: [B*T, heads, d], the layout varlen kernels take
    flat = [t.transpose(1, 2).reshape(B * T, t.shape[1], d) for t in (q, k, v)]
    if kernel in ("varlen", "flash_attn"):
        flat = [t.to(_compute_dtype(q)) for t in flat]  # a custom op: autocast does not cast for it
        cu, longest = lay.cu_seqlens, max(lay.lengths)
        if kernel == "varlen":
            api, gqa = varlen_api(), {}
            if n_kv != H and api.gqa:
                gqa["enable_gqa"] = True
            elif n_kv != H:  # no enable_gqa (2.11): each KV head copied for its G query heads, as repeat_kv
                flat[1:] = [t.repeat_interleave(H // n_kv, dim=1) for t in flat[1:]]
            # causal is exactly the tuple (-1, 0): the wrapper compares window_size == (-1, 0)
            y = api.fn(*flat, cu, cu, longest, longest, window_size=(-1, 0), **gqa)
        else:
            from flash_attn import flash_attn_varlen_func
            y = flash_attn_varlen_func(*flat, cu, cu, longest, longest, causal=True)
        return y.view(B, T, H, d).transpose(1, 2)
    if kernel == "flex":
        return _flex(q, k, v, lay, compiled=q.device.type == "cuda")
    qf, kf, vf = (t.transpose(0, 1)[None] for t in flat)  # [1, heads, B*T, d]
    outs, start = [], 0
    for n in lay.lengths:
        s = slice(start, start + n)
        outs.append(F.scaled_dot_product_attention(qf[:, :, s], kf[:, :, s], vf[:, :, s], is_causal=True,
                                                   enable_gqa=n_kv != H))
        start += n
    return torch.cat(outs, 2)[0].transpose(0, 1).reshape(B, T, H, d).transpose(1, 2)


def document_causal(ids):
    """FlexAttention's mask_mod: key ki is visible to query qi in the same document, ki <= qi.
    Each forward's is a new closure of this one code, which the compiled create_block_mask takes
    without recompiling."""
    return lambda b, h, qi, ki: (ids[b, qi] == ids[b, ki]) & (ki <= qi)


def _flex(q, k, v, lay, compiled):
    """FlexAttention with a document-causal block mask, both compiled on CUDA. Eager (`compiled`
    False: only the tests run it) the mask is evaluated at every (query, key) pair, B x T x T."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    B, H, T, _ = q.shape
    if "block_mask" not in lay.built:  # once per forward, shared by the layers
        make = _compiled(create_block_mask) if compiled else create_block_mask
        lay.built["block_mask"] = make(document_causal(lay.seq_ids), B, None, T, T, device=q.device)
    fn = _compiled(flex_attention) if compiled else flex_attention
    q, k, v = (t.to(_compute_dtype(q)) for t in (q, k, v))  # not an autocast op either
    return fn(q, k, v, block_mask=lay.built["block_mask"], enable_gqa=k.shape[1] != H)


_COMPILED = {}


def _compiled(fn):
    """torch.compile(fn), made once per process. Not create_block_mask(_compile=True): in 2.11 and
    2.14 that is this same call plus a DeprecationWarning. The second packed length recompiles with
    the length dynamic (torch.compile's automatic dynamic shapes); later lengths reuse that graph."""
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn)
    return _COMPILED[fn]


def _compute_dtype(q):
    """The dtype the kernel will compute in: autocast's when it is on for q's device."""
    dev = q.device.type
    on = torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev)
    return torch.get_autocast_dtype(dev) if on else q.dtype


# ---------------------------------------------------------------------------------------------
# Which kernel ran: a diagnostic for the GPU check, free unless someone records.

_RECORDS = []


@contextlib.contextmanager
def record_kernels():
    """`with record_kernels() as names: model(...)` lists the kernel of every attention call."""
    names = []
    _RECORDS.append(names)
    try:
        yield names
    finally:
        _RECORDS.remove(names)


def _note(name_fn):
    if _RECORDS:
        name = name_fn()
        for r in _RECORDS:
            r.append(name)


def _sdpa_name(q, k, v, mask, is_causal, gqa):
    """SDPA's kernel for these inputs: on CUDA by its own checks, with autocast's dtype applied."""
    if q.device.type != "cuda":
        return f"sdpa-{q.device.type}"
    from torch.nn.attention import SDPAParams, can_use_efficient_attention, can_use_flash_attention
    dt = _compute_dtype(q)
    q, k, v = (t.to(dt) for t in (q, k, v))
    mask = mask.to(dt) if mask is not None and mask.is_floating_point() else mask
    params = SDPAParams(q, k, v, mask, 0.0, is_causal, gqa)
    if can_use_flash_attention(params):
        return "sdpa-flash"
    if can_use_efficient_attention(params):
        return "sdpa-efficient"
    return "sdpa-math"

"""nanokl.engine.attention: each batch layout against a float64 softmax written out per head, the CUDA
rule (SDPA never gets a mask together with enable_gqa), the memory of the packed path at a
16,384-token budget, and the kernel record.

- Every layout (causal, padded, packed, decode with a cache) equals a float64 reference that
  loops over heads and builds the visibility matrix by hand (<= 1e-5 fp32).
- A TorchFunctionMode sees every SDPA call of a training forward (padded), a packed forward, a
  prefill and decode steps (plain and fused rollout copy) and fails on attn_mask + enable_gqa.
- On the meta device (shapes, no memory) the packed forward and backward of the 0.5B shape at
  16,384 tokens, with the CUDA varlen kernel forced, hold no tensor larger than
  L x intermediate_size elements (79.7M; the block-diagonal mask alone is L^2 = 268M), apart from
  parameter-shaped gradients; the mask path, measured the same way, exceeds L^2.
- Decode attention on a bf16 cache computes its scores in fp32: its error against float64 is the
  final rounding of the output, below what rounding scores and probabilities to bf16 gives.
- The packed CUDA path, forced on the CPU, calls stand-ins with the exact signatures of torch
  2.11's and 2.14.1's varlen_attn (a keyword either lacks is a TypeError, as in the real one) and
  equals the float64 reference for MHA and GQA: causal only if window_size is the tuple (-1, 0),
  2.11 given K/V heads repeated to H, 2.14 given enable_gqa. The kernel is chosen by the
  signature (2.10's is_causal form and a torch without the module are not "varlen"), and one of
  the stand-ins has the installed torch's signature, so they cannot drift from the torch tested.
- The compiled FlexAttention branch (a counting backend on the CPU) equals per-document attention
  and compiles the block mask twice over four packed lengths (the second with dynamic shapes).
"""

import importlib.util
import inspect
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nanokl.engine import attention as A
from nanokl.engine import model as M
from nanokl.engine.fused import fuse_for_rollout


def reference(q, k, v, visible):
    """float64 softmax(q k^T / sqrt(d) + mask) v, head by head; visible [B, T, S] bool."""
    B, H, T, d = q.shape
    G = H // k.shape[1]
    out = torch.zeros(B, H, T, d, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            s = q[b, h].double() @ k[b, h // G].double().T / d ** 0.5
            s = s.masked_fill(~visible[b], float("-inf"))
            out[b, h] = s.softmax(-1) @ v[b, h // G].double()
    return out


def qkv(B, H, n, T, S, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, H, T, d, generator=g, dtype=dtype), torch.randn(B, n, S, d, generator=g, dtype=dtype),
            torch.randn(B, n, S, d, generator=g, dtype=dtype))


def test_every_layout_matches_float64_reference():
    T = 9
    tril = torch.ones(T, T, dtype=torch.bool).tril()
    # causal: no padding
    q, k, v = qkv(2, 4, 2, T, T)
    lay = A.layout(torch.ones(2, T, dtype=torch.long))
    assert lay.kind == "causal"
    assert (A.attend(q, k, v, lay) - reference(q, k, v, tril.expand(2, T, T))).abs().max() <= 1e-5
    # padded: left padding of 3 and 0; a padding query sees only itself
    mask = torch.ones(2, T, dtype=torch.long)
    mask[0, :3] = 0
    lay = A.layout(mask)
    assert lay.kind == "padded"
    vis = tril & mask.bool()[:, None, :] | torch.eye(T, dtype=torch.bool)
    assert (A.attend(q, k, v, lay) - reference(q, k, v, vis)).abs().max() <= 1e-5
    # packed: one row of three sequences (ids 1, 2, 3), block-diagonal causal visibility
    ids = torch.tensor([[1, 1, 1, 1, 2, 2, 3, 3, 3]])
    q, k, v = qkv(1, 4, 2, T, T)
    lay = A.layout(ids)
    assert lay.kind == "packed" and lay.lengths == [4, 2, 3] and lay.cu_seqlens.tolist() == [0, 4, 6, 9]
    vis = tril & (ids[0][:, None] == ids[0][None, :])
    assert (A.attend(q, k, v, lay) - reference(q, k, v, vis[None])).abs().max() <= 1e-5
    # decode: one query at slot 6 over 10 cache slots, some of them padding
    q, k, v = qkv(3, 6, 2, 1, 10)
    valid = torch.rand(3, 10, generator=torch.Generator().manual_seed(1)) > 0.4
    valid[:, 6] = True
    lay = A.cache_layout(valid, torch.tensor([6]))
    assert lay.kind == "decode"
    vis = (valid & (torch.arange(10) <= 6))[:, None, :]
    assert (A.attend(q, k, v, lay) - reference(q, k, v, vis)).abs().max() <= 1e-5


class SDPACalls(TorchFunctionMode):
    """Records (has mask, enable_gqa) of every scaled_dot_product_attention call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.calls.append((mask is not None, bool(kwargs.get("enable_gqa", False))))
        return func(*args, **kwargs)


def tiny_model(fused=False):
    cfg = M.ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, rope_theta=1e4)
    torch.manual_seed(0)
    m = M.init_weights(M.CausalLM(cfg), std=0.2).eval()
    return fuse_for_rollout(m) if fused else m


@pytest.mark.parametrize("fused", [False, True])
def test_sdpa_never_gets_a_mask_with_enable_gqa(fused):
    """The CUDA rule (no fused kernel takes both; the math fallback builds fp32 [B, H, T, T]
    scores), checked on the CPU where the code path is the same."""
    m = tiny_model(fused)
    ids = torch.randint(0, 61, (3, 10))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    seq = torch.tensor([[1] * 4 + [2] * 6])
    pos = torch.tensor([list(range(4)) + list(range(6))])
    paths = {}
    with torch.no_grad():
        for name, call in [
            ("padded", lambda: m(ids, mask)),
            ("packed", lambda: m(ids[:1], seq, pos)),
            ("causal", lambda: m(ids)),
        ]:
            with SDPACalls() as rec:
                call()
            paths[name] = rec.calls
        cache = M.KVCache(m.config, 3, 14)
        with SDPACalls() as rec:
            m(ids[:, :8], mask[:, :8], cache=cache, cache_positions=torch.arange(8))
        paths["prefill"] = rec.calls
        with SDPACalls() as rec:
            for t in (8, 9):
                m(ids[:, t:t + 1], cache=cache, cache_positions=torch.tensor([t]))
        paths["decode"] = rec.calls
    for name, calls in paths.items():
        assert calls, f"{name}: no SDPA call seen"
        assert not any(has_mask and gqa for has_mask, gqa in calls), f"{name}: attn_mask with enable_gqa"
    assert all(has_mask for has_mask, _ in paths["padded"] + paths["prefill"] + paths["decode"])
    assert not any(has_mask for has_mask, _ in paths["packed"])  # per-document causal: no mask at all


class Largest(TorchDispatchMode):
    """The largest tensor any op returns, skipping those shaped like a parameter (gradients)."""

    def __init__(self, skip_shapes):
        super().__init__()
        self.skip, self.numel, self.op = skip_shapes, 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and tuple(t.shape) not in self.skip and t.numel() > self.numel:
                self.numel, self.op = t.numel(), str(func)
        return out


def packed_peak(monkeypatch, use_mask):
    L, docs = 16384, 16
    lengths = [L // docs] * docs
    cfg = M.ModelConfig(num_hidden_layers=2)  # the 0.5B shape, two layers (every layer is alike)
    with torch.device("meta"):
        dec = M.Decoder(cfg)
    seq = torch.repeat_interleave(torch.arange(1, docs + 1), torch.tensor(lengths))[None].to("meta")
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to("meta")
    ids = torch.zeros(1, L, dtype=torch.long, device="meta")
    # meta tensors hold no values: supply the layout the host read of the sequence ids would give
    if use_mask:
        monkeypatch.setattr(A, "layout", lambda m: A.Layout("padded", mask=A.padded_mask(m)))
    else:
        monkeypatch.setattr(A, "layout", lambda m: A.packed_layout(lengths, m))
        monkeypatch.setattr(A, "packed_kernel", lambda q: "varlen")
    with Largest({tuple(p.shape) for p in dec.parameters()}) as rec:
        dec(ids, seq, pos).float().pow(2).mean().backward()
    return rec.numel, L, cfg


def test_packed_path_holds_no_quadratic_tensor_at_16k_tokens(monkeypatch):
    peak, L, cfg = packed_peak(monkeypatch, use_mask=False)
    assert peak <= L * cfg.intermediate_size  # the MLP's [L, 4864]: 79.7M elements, 319 MB fp32
    assert peak < L * L // 3


def test_mask_path_is_quadratic_control(monkeypatch):
    """The same measurement on the block-diagonal mask path: it exceeds L^2 (so the bound above bites)."""
    peak, L, _ = packed_peak(monkeypatch, use_mask=True)
    assert peak >= L * L


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_branch_equals_per_document(monkeypatch):
    T = 12
    ids = torch.tensor([[1] * 5 + [2] * 3 + [3] * 4])
    q, k, v = qkv(1, 4, 2, T, T)
    lay = A.layout(ids)
    want = A.attend(q, k, v, lay)
    monkeypatch.setattr(A, "packed_kernel", lambda q: "flex")
    with A.record_kernels() as names:
        got = A.attend(q, k, v, lay)
    assert names == ["flex"]
    assert (got - want).abs().max() <= 1e-5


def test_record_kernels_names_each_call():
    m = tiny_model()
    ids = torch.randint(0, 61, (1, 10))
    with torch.no_grad(), A.record_kernels() as names:
        m(ids, torch.tensor([[1] * 4 + [2] * 6]), torch.tensor([list(range(4)) + list(range(6))]))
        m(ids)
    assert names == ["sdpa-per-document"] * 2 + ["sdpa-cpu"] * 2  # two layers each


def test_decode_scores_in_fp32_on_a_bf16_cache():
    """Scores and softmax in fp32 (as training's kernels compute them): what is left is rounding
    the probabilities for the product with v and the output to bf16, each <= 2^-9 of
    m = sum_i p_i |v_i|; the bound allows 2^-7 m. Rounding the scores to bf16 as well (the old
    decode path: bf16 q k^T) breaks it: a score of a few units moves by ~2^-8 of itself."""
    q, k, v = qkv(8, 14, 2, 1, 200, d=64, dtype=torch.bfloat16)
    q = q * 3  # scores of a few units, as in a trained model
    valid = torch.ones(8, 200, dtype=torch.bool)
    lay = A.cache_layout(valid, torch.tensor([199]))
    ref = reference(q, k, v, valid[:, None, :])
    p = ((q.double().view(8, 2, 7, 64) @ k.double().transpose(-1, -2)) / 8).softmax(-1)
    bound = 2 ** -7 * (p @ v.double().abs()).view(8, 14, 1, 64)
    assert ((A.attend(q, k, v, lay).double() - ref).abs() <= bound).all()
    s = (q.view(8, 2, 7, 64) @ k.transpose(-1, -2)) * 64 ** -0.5
    old = (s.float().softmax(-1).to(torch.bfloat16) @ v).view(8, 14, 1, 64).double()
    assert not ((old - ref).abs() <= bound).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernels_are_fused_under_bf16_autocast():
    m = tiny_model().cuda()
    ids = torch.randint(0, 61, (4, 64), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    seq = torch.repeat_interleave(torch.arange(1, 5), torch.tensor([16, 20, 12, 16]))[None].cuda()
    pos = torch.cat([torch.arange(n) for n in (16, 20, 12, 16)])[None].cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16), A.record_kernels() as names:
        m(ids, mask)
        m(ids[:1], seq, pos)
    assert "sdpa-math" not in names, names
    assert names[-1] == "varlen"


# ---------------------------------------------------------------------------------------------
# torch.nn.attention.varlen.varlen_attn as each torch has it. The parameter lists are copied from
# the released sources (2.11.0: the installed wheel; 2.14.1: torch/nn/attention/varlen.py of its
# wheel; 2.10: a stored copy of that file): names, keyword-only marker and defaults exactly, no
# **kwargs, so a keyword the real function lacks is a TypeError here too. The body is what the
# FlashAttention kernel computes, per document, in float64; causal exactly when the real wrapper
# makes it so (`is_causal = window_size == (-1, 0)`: a list would be full attention).

VARLEN_CALLS = []


def _varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal, scale):
    assert cu_seq_q.dtype == torch.int32 and cu_seq_k.equal(cu_seq_q)
    lengths = cu_seq_q.diff().tolist()
    assert cu_seq_q[0] == 0 and cu_seq_q[-1] == query.shape[0] and max_q == max_k == max(lengths)
    assert isinstance(max_q, int)  # the real op takes a SymInt, not a tensor
    groups = query.shape[1] // key.shape[1]
    out = torch.empty(query.shape, dtype=torch.float64)
    for a, b in zip(cu_seq_q.tolist(), cu_seq_q.tolist()[1:]):
        q = query[a:b].double().transpose(0, 1)  # [H, n, d]
        k, v = (t[a:b].double().transpose(0, 1).repeat_interleave(groups, 0) for t in (key, value))
        s = q @ k.transpose(1, 2) * (scale if scale is not None else query.shape[-1] ** -0.5)
        if causal:
            s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        out[a:b] = (s.softmax(-1) @ v).transpose(0, 1)
    return out.to(query.dtype)


def varlen_attn_2_11(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    return_aux=None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
):
    # 2.11 documents key/value as (T_k, H, D), H the query heads, and checks nothing: a GQA key
    # goes straight to the kernel, outside the documented contract. The stand-in refuses it.
    if key.shape[1] != query.shape[1] or value.shape[1] != query.shape[1]:
        raise ValueError(f"2.11 takes key/value of (T_k, H, D): H={query.shape[1]}, got {key.shape[1]}")
    VARLEN_CALLS.append("2.11")
    is_causal = window_size == (-1, 0)
    return _varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale)


def varlen_attn_2_14(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux=None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    num_splits: int | None = None,
):
    # 2.14.1's own checks, word for word in substance
    num_heads_q, num_heads_k = query.size(1), key.size(1)
    if not enable_gqa and num_heads_q != num_heads_k:
        raise ValueError(f"Expect query and key/value to have the same number of heads but got Hq={num_heads_q} "
                         f"and Hkv={num_heads_k}. Try setting enable_gqa=True for GQA.")
    if enable_gqa and num_heads_q % num_heads_k != 0:
        raise ValueError(f"Expect number of query heads to be a multiple of kv heads for GQA but got "
                         f"Hq={num_heads_q} and Hkv={num_heads_k}.")
    assert seqused_k is None and block_table is None  # inference-only extras nanokl never passes
    VARLEN_CALLS.append("2.14")
    is_causal = window_size == (-1, 0)
    return _varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, scale)


def varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    VARLEN_CALLS.append("2.10")  # causal by a flag, no window_size, no GQA: nanokl does not use it
    return _varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, None)


STANDINS = {"2.11": varlen_attn_2_11, "2.14": varlen_attn_2_14}


def packed_rows():
    """Two packed rows (documents 5, 3, 4 and 7, 5) and their float64 visibility."""
    ids = torch.tensor([[1] * 5 + [2] * 3 + [3] * 4, [1] * 7 + [2] * 5])
    T = ids.shape[1]
    vis = torch.ones(T, T, dtype=torch.bool).tril() & (ids[:, :, None] == ids[:, None, :])
    return ids, vis


@pytest.mark.parametrize("n_kv", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("version", list(STANDINS))
def test_varlen_call_fits_each_torch_signature(monkeypatch, version, n_kv):
    """The packed CUDA path through each torch's varlen_attn equals the float64 reference. Before
    the kernel read the signature it passed enable_gqa to every torch: 2.11 raised TypeError."""
    import torch.nn.attention.varlen as V
    monkeypatch.setattr(V, "varlen_attn", STANDINS[version])
    monkeypatch.setattr(A, "packed_kernel", lambda q: "varlen")  # the CUDA choice, forced as on meta above
    ids, vis = packed_rows()
    q, k, v = qkv(2, 4, n_kv, ids.shape[1], ids.shape[1])
    VARLEN_CALLS.clear()
    got = A.attend(q, k, v, A.layout(ids))
    assert VARLEN_CALLS == [version]
    assert (got - reference(q, k, v, vis)).abs().max() <= 1e-5


def test_packed_kernel_follows_the_signature(monkeypatch):
    """varlen only where window_size makes it causal; GQA by enable_gqa only where it exists."""
    import torch.nn.attention.varlen as V
    otherwise = "flash_attn" if importlib.util.find_spec("flash_attn") is not None else "flex"
    for fn, gqa in ((varlen_attn_2_11, False), (varlen_attn_2_14, True)):
        monkeypatch.setattr(V, "varlen_attn", fn)
        assert A.cuda_packed_kernel(torch.bfloat16) == A.cuda_packed_kernel(torch.float16) == "varlen"
        assert A.cuda_packed_kernel(torch.float32) == "flex"  # FlashAttention is fp16/bf16 only
        assert A.varlen_api().gqa is gqa
    monkeypatch.setattr(V, "varlen_attn", varlen_attn_2_10)
    assert A.varlen_api() is None and A.cuda_packed_kernel(torch.bfloat16) == otherwise
    monkeypatch.delattr(V, "varlen_attn")
    assert A.varlen_api() is None and A.varlen_signature() is None
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)  # torch 2.6-2.8: no module
    assert A.varlen_api() is None and A.cuda_packed_kernel(torch.bfloat16) == otherwise


def test_a_standin_has_the_installed_signature():
    """The stand-ins are the torch this suite runs on (2.11 or 2.13/2.14, whose varlen_attn are
    alike): a torch whose varlen_attn differs from both needs a stand-in of its own here."""
    from torch.nn.attention.varlen import varlen_attn

    def params(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert params(varlen_attn) in [params(fn) for fn in STANDINS.values()], inspect.signature(varlen_attn)
    assert A.varlen_signature() == str(inspect.signature(varlen_attn))


def test_compiled_flex_builds_the_mask_once_per_shape_family(monkeypatch):
    """The CUDA flex branch (compiled create_block_mask and flex_attention) with a counting backend
    that runs the captured graphs eagerly: correct numbers, and four packed lengths compile each
    function twice (the second time with the length dynamic), not four times."""
    from torch._dynamo.testing import CompileCounter
    counter, compile_ = CompileCounter(), torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend=counter, **kw))
    monkeypatch.setattr(A, "_COMPILED", {})
    torch._dynamo.reset()
    frames = []
    for lengths in ([5, 3, 4], [7, 6], [4, 4, 4, 5], [9, 2, 3, 3, 1]):
        ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))[None]
        T = ids.shape[1]
        vis = torch.ones(T, T, dtype=torch.bool).tril() & (ids[0][:, None] == ids[0][None, :])
        q, k, v = qkv(1, 4, 2, T, T)
        got = A._flex(q, k, v, A.layout(ids), compiled=True)
        assert (got - reference(q, k, v, vis[None])).abs().max() <= 1e-5
        frames.append(counter.frame_count)
    torch._dynamo.reset()
    assert frames[1] == frames[2] == frames[3] == 2 * frames[0], frames

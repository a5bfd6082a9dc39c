"""nanokl/lora.py against independent references.

- Gradients of lora_A and lora_B (float64, B != 0) equal those of a dense path that builds
  W + (alpha/r)·B·A from leaf copies of A and B with plain matmuls: one Linear and a whole
  CausalLM (torch.func.functional_call on the base model), to 1e-12 relative.
- At B = 0 the adapted model's logits equal the base model's bit for bit; under `adapters_off` its
  log-probs equal the base model's bit for bit after B was randomised, and the state is restored.
- `merged_state_dict` loaded into a plain CausalLM gives the adapted model's logits (fp32, <= 1e-5),
  and the base's own state dict, bit for bit, at B = 0.
- `targets` against name lists written out by hand; bad entries raise naming themselves.
- Trainable parameters: only lora_A/lora_B, r·(d_in + d_out) per matrix (closed form from the config).
- The adapter state's round trip into a freshly adapted model: logits bit for bit.
(No comparison with PEFT: it is not installed here, and nanokl does not depend on it.)
"""

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanokl import lora as L
from nanokl.engine import model as M

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def base_model(tie=False, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    cfg = M.ModelConfig(model_type="qwen2", **TINY, tie_word_embeddings=tie, rope_theta=10000.0)
    m = M.CausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.1)
    return m.to(dtype).eval()


def adapted(base, rank=4, alpha=8.0, target="all-linear", seed=1, **kw):
    m = copy.deepcopy(base)
    L.add_adapters(m, rank, alpha, target, generator=torch.Generator().manual_seed(seed), **kw)
    return m


def randomise_b(model, seed=2, std=0.1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in L.adapters(model).values():
            mod.lora_B.copy_(torch.randn(mod.lora_B.shape, generator=g, dtype=mod.lora_B.dtype) * std)


def batch(B=3, T=13, pad=(4, 1, 0)):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, TINY["vocab_size"], (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    for b, n in enumerate(pad):
        mask[b, :n] = 0
    return ids, mask


def token_logprobs(logits, ids):
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# ---- 1. gradients against a dense W + s·B·A ----

def test_linear_gradients_equal_the_dense_update_float64():
    torch.manual_seed(0)
    base = nn.Linear(7, 5).double()
    mod = L.LoRALinear(base, rank=3, alpha=6.0, generator=torch.Generator().manual_seed(1))
    assert mod.base_layer is base and mod.base_layer.weight is base.weight and not base.weight.requires_grad
    with torch.no_grad():
        mod.lora_B.normal_()  # at B = 0, ∂L/∂A would be 0: nothing to compare
    x, w = torch.randn(4, 7, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    (torch.tanh(mod(x)) * w).sum().backward()

    A = mod.lora_A.detach().clone().requires_grad_()
    B = mod.lora_B.detach().clone().requires_grad_()
    W_eff = base.weight.detach() + (6.0 / 3) * (B @ A)
    (torch.tanh(x @ W_eff.T + base.bias.detach()) * w).sum().backward()
    assert rel(mod.lora_A.grad, A.grad) < 1e-12 and rel(mod.lora_B.grad, B.grad) < 1e-12
    assert A.grad.abs().max() > 1e-3 and B.grad.abs().max() > 1e-3
    assert base.weight.grad is None  # frozen


def test_model_gradients_equal_the_dense_update_float64():
    base = base_model(dtype=torch.float64)
    pol = adapted(base, rank=4, alpha=8.0)
    randomise_b(pol)
    ids, mask = batch()

    def loss(logits):  # a sequence log-likelihood over the real tokens
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return (lp * mask[:, 1:]).sum()

    loss(pol(ids, mask)).backward()

    leaves, weights = {}, {}
    for name, mod in L.adapters(pol).items():
        A = mod.lora_A.detach().clone().requires_grad_()
        B = mod.lora_B.detach().clone().requires_grad_()
        leaves[name] = (A, B)
        weights[f"{name}.weight"] = base.get_submodule(name).weight.detach() + mod.scale * (B @ A)
    loss(torch.func.functional_call(base, weights, (ids, mask))).backward()
    worst = 0.0
    for name, mod in L.adapters(pol).items():
        A, B = leaves[name]
        worst = max(worst, rel(mod.lora_A.grad, A.grad), rel(mod.lora_B.grad, B.grad))
        assert A.grad.abs().max() > 0 and B.grad.abs().max() > 0
    assert len(leaves) == 14 and worst < 1e-12, worst


# ---- 2. the reference for free ----

@pytest.mark.parametrize("grad", [False, True])
def test_at_init_and_with_adapters_off_the_base_model_bit_for_bit(grad):
    base = base_model()
    pol = adapted(base)
    ids, mask = batch()
    with torch.set_grad_enabled(grad):
        ref = base(ids, mask)
        assert torch.equal(pol(ids, mask), ref)  # B = 0: the policy starts exactly at π_ref
        randomise_b(pol)
        assert (pol(ids, mask) - ref).abs().max() > 1e-2  # now the adapters do something
        with L.adapters_off(pol):
            assert torch.equal(token_logprobs(pol(ids, mask), ids), token_logprobs(ref, ids))
        assert (pol(ids, mask) - ref).abs().max() > 1e-2  # on again after the block
    # decode-shaped rows on the CPU take nanokl's other GEMM orientation: the base's, still bit for bit
    with torch.no_grad(), L.adapters_off(pol):
        assert torch.equal(pol(ids[:, :1]), base(ids[:, :1]))


def test_adapters_off_restores_each_state_also_after_an_error():
    pol = adapted(base_model())
    mods = list(L.adapters(pol).values())
    mods[0].enabled = False
    with pytest.raises(RuntimeError, match="boom"):
        with L.adapters_off(pol):
            assert not any(m.enabled for m in mods)
            raise RuntimeError("boom")
    assert [m.enabled for m in mods] == [False] + [True] * (len(mods) - 1)


def test_a_starts_kaiming_uniform_and_b_at_zero():
    pol = adapted(base_model(), rank=8)
    for name, mod in L.adapters(pol).items():
        d_in = pol.get_submodule(name).base_layer.in_features
        bound = 1 / d_in ** 0.5  # kaiming_uniform(a=√5): gain √(1/3) · √(3/d_in)
        assert mod.lora_A.abs().max() <= bound and mod.lora_A.abs().max() > 0.8 * bound
        assert torch.equal(mod.lora_B, torch.zeros_like(mod.lora_B))


def test_dropout_acts_in_training_only():
    torch.manual_seed(0)
    base = nn.Linear(16, 8)
    plain = L.LoRALinear(copy.deepcopy(base), 4, 4.0, generator=torch.Generator().manual_seed(1))
    drop = L.LoRALinear(copy.deepcopy(base), 4, 4.0, dropout=0.5, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain.lora_B.normal_()
        drop.lora_B.copy_(plain.lora_B)
    x = torch.randn(32, 16)
    assert torch.equal(drop.eval()(x), plain(x))
    assert not torch.allclose(drop.train()(x), plain(x))


# ---- 3. merging ----

@pytest.mark.parametrize("tie", [False, True])
def test_merged_state_dict_loads_into_a_plain_model(tie):
    base = base_model(tie)
    pol = adapted(base)
    ids, mask = batch()

    merged = L.merged_state_dict(pol)  # B = 0: the base's own weights
    assert merged.keys() == base.state_dict().keys()
    assert all(torch.equal(merged[k], v) for k, v in base.state_dict().items())

    randomise_b(pol)
    merged = L.merged_state_dict(pol)
    plain = M.CausalLM(base.config).eval()
    plain.load_state_dict(merged)  # strict: exactly the base names
    with torch.no_grad():
        want, got = pol(ids, mask), plain(ids, mask)
        assert (got - want).abs().max() <= 1e-5  # (W + sBA)x vs Wx + s·B(Ax): summation order only
        assert (want - base(ids, mask)).abs().max() > 1e-2


# ---- 4. which matrices ----

def test_targets():
    m = base_model()
    every = [f"model.layers.{i}.{p}" for i in range(2) for p in PROJ]
    assert L.targets(m, "all-linear") == every  # lm_head is left alone
    qv = [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    assert L.targets(m, ["q_proj", "v_proj"]) == qv
    assert L.targets(m, ["self_attn.q_proj", "v_proj"]) == qv  # a dotted tail matches too
    assert L.targets(m, "all-linear", ["mlp.gate_proj", "mlp.up_proj", "down_proj", "o_proj", "k_proj"]) == qv
    assert L.targets(m, ["q_proj", "v_proj"], ["model.layers.0.self_attn.q_proj"]) == qv[1:]
    assert L.targets(m, r"model\.layers\.1\..*proj") == every[7:]  # a string: PEFT's full regex match
    assert L.targets(m, ["lm_head"]) == ["lm_head"]  # named explicitly, the head may be adapted
    assert L.targets(m, "all-linear", r".*\.0\..*") == every[7:]
    for bad, kw in ((["q_proj", "qproj"], {}), (["proj"], {}), (["embed_tokens"], {}),
                    (["q_proj"], {"exclude_modules": ["gate"]})):
        with pytest.raises(ValueError) as e:
            L.targets(m, bad, **kw)
        word = (kw.get("exclude_modules") or [bad[-1]])[0]
        assert repr(word) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="no module"):
        L.targets(m, ["q_proj"], ["q_proj"])


def test_add_adapters_refuses_a_tied_head_and_a_second_pass():
    with pytest.raises(ValueError, match="lm_head.*tied"):
        L.add_adapters(base_model(tie=True), 4, 8, ["lm_head"])
    m = adapted(base_model())
    with pytest.raises(ValueError, match="already"):
        L.add_adapters(m, 4, 8)


# ---- 5. what trains ----

def test_only_adapters_train_and_their_count_is_the_closed_form():
    m, r = base_model(), 8
    names = L.add_adapters(m, r, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])
    c = m.config
    h, q, kv, inter = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, \
        c.intermediate_size
    per_layer = r * ((h + q) + 2 * (h + kv) + (q + h) + (inter + h))
    assert L.trainable_parameters(m) == c.num_hidden_layers * per_layer == 2 * 8 * (128 + 2 * 96 + 128 + 160)
    train = sorted(n for n, p in m.named_parameters() if p.requires_grad)
    assert train == sorted(f"{n}.lora_{x}" for n in names for x in "AB")


def test_the_docstrings_qwen_0_5b_count():
    with torch.device("meta"):
        m = M.CausalLM(M.ModelConfig())  # the Qwen2.5-0.5B shape
    full = sum(m.get_submodule(n).weight.numel() for n in L.targets(m))
    L.add_adapters(m, 8, 16)
    assert round(L.trainable_parameters(m) / 1e6, 2) == 4.40 and round(full / 1e6) == 358


# ---- 6. the adapter checkpoint ----

def test_adapter_state_round_trip():
    base = base_model()
    pol = adapted(base, seed=1)
    randomise_b(pol)
    buf = io.BytesIO()
    torch.save(L.adapter_state_dict(pol), buf)
    state = torch.load(io.BytesIO(buf.getvalue()))
    assert sorted(state) == sorted(f"{n}.lora_{x}" for n in L.adapters(pol) for x in "AB")

    fresh = adapted(base, seed=5)  # another A, B = 0
    ids, mask = batch()
    with torch.no_grad():
        assert not torch.equal(fresh(ids, mask), pol(ids, mask))
        L.load_adapter_state_dict(fresh, state)
        assert torch.equal(fresh(ids, mask), pol(ids, mask))

    with pytest.raises(ValueError, match="missing.*q_proj.lora_A"):
        L.load_adapter_state_dict(fresh, {k: v for k, v in state.items() if "layers.1.self_attn.q_proj" not in k})
    with pytest.raises(ValueError, match="shape .*lora_rank"):
        L.load_adapter_state_dict(adapted(base, rank=2), state)

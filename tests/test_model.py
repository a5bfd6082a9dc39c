"""nanokl.engine.model against `transformers` (the independent implementation) and against itself.

- Random tiny Qwen2 / Llama models, tied and untied, saved by transformers load into nanokl with
  max |delta logits| <= 1e-4 fp32, and nanokl-saved models load back in transformers likewise.
- Prefill + token-by-token decoding through the static KV cache equals one full forward
  (<= 1e-5), and each row of a left-padded batch equals that row run alone without padding.
- Broken checkpoints fail with one-line errors naming what is wrong.
"""

import json

import pytest
import torch

from nanokl.harness import hf_format as H
from nanokl.engine import model as M
from nanokl.harness.hf_format import CheckpointError

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def hf_model(kind, tie, head="lm", **extra):
    cfg_cls = transformers.Qwen2Config if kind == "qwen2" else transformers.LlamaConfig
    extra.setdefault("rope_parameters", {"rope_theta": 10000.0, "rope_type": "default"})
    cfg = cfg_cls(**TINY, tie_word_embeddings=tie, **extra)
    if head == "lm":
        cls = transformers.Qwen2ForCausalLM if kind == "qwen2" else transformers.LlamaForCausalLM
    else:
        cfg.num_labels = 1
        cls = transformers.Qwen2ForTokenClassification if kind == "qwen2" else transformers.LlamaForTokenClassification
    m = cls(cfg).eval()
    with torch.no_grad():  # HF zero-inits biases and one-inits norms; randomise every parameter
        for p in m.parameters():
            p.normal_(0.0, 0.1)
    return m


def batch(B=3, T=13, V=97, pad=(4, 1, 0)):
    ids = torch.randint(0, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    for b, n in enumerate(pad):
        mask[b, :n] = 0
    return ids, mask


CASES = [("qwen2", True, {}), ("qwen2", False, {}), ("llama", True, {}), ("llama", False, {}),
         ("llama", False, {"attention_bias": True})]


@pytest.mark.parametrize("kind,tie,extra", CASES)
def test_transformers_interop_both_ways(kind, tie, extra, tmp_path):
    hf = hf_model(kind, tie, **extra)
    hf.save_pretrained(tmp_path / "hf")
    ours = H.from_pretrained(tmp_path / "hf").eval()
    assert ours.config.tie_word_embeddings == tie
    ids, mask = batch()
    with torch.no_grad():
        ref = hf(ids).logits
        assert (ours(ids) - ref).abs().max() <= 1e-4
        ref_m = hf(ids, attention_mask=mask).logits
        got_m = ours(ids, attention_mask=mask)
        real = mask.bool()
        assert (got_m - ref_m)[real].abs().max() <= 1e-4

    H.save_pretrained(ours, tmp_path / "ours")
    back = type(hf).from_pretrained(tmp_path / "ours").eval()
    assert back.config.tie_word_embeddings == tie
    with torch.no_grad():
        assert (back(ids).logits - ref).abs().max() <= 1e-4
        assert (back(ids, attention_mask=mask).logits - ref_m)[real].abs().max() <= 1e-4


def test_old_style_rope_theta_and_llama3_scaling(tmp_path):
    """rope_theta at the top level (older config.json), and Llama 3.1 frequency scaling."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    hf = hf_model("llama", False, rope_parameters={"rope_theta": 500.0, **scaling})
    hf.save_pretrained(tmp_path)
    ours = H.from_pretrained(tmp_path).eval()
    assert ours.config.rope_scaling["rope_type"] == "llama3" and ours.config.rope_theta == 500.0
    ids = torch.randint(0, 97, (2, 40))  # past original_max_position_embeddings, where scaling acts
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() <= 1e-4

    # the same weights under an older config.json: top-level rope_theta, no rope_parameters
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg.update(rope_theta=500.0, rope_scaling=scaling)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    old = H.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert (old(ids) - hf(ids).logits).abs().max() <= 1e-4


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_value_model_round_trip_and_init_from_causal_lm(kind, tmp_path):
    hf = hf_model(kind, False, head="value")
    hf.save_pretrained(tmp_path / "v")
    critic = H.load_value_model(tmp_path / "v").eval()
    ids, mask = batch()
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).logits[..., 0]
        got = critic(ids, mask)
        assert (got - ref)[mask.bool()].abs().max() <= 1e-4
    H.save_pretrained(critic, tmp_path / "v2")
    back = type(hf).from_pretrained(tmp_path / "v2").eval()
    with torch.no_grad():
        assert (back(ids, attention_mask=mask).logits[..., 0] - ref)[mask.bool()].abs().max() <= 1e-4

    # from a causal LM: same backbone, fresh score head, so value = score(hidden of the LM)
    lm = hf_model(kind, True)
    lm.save_pretrained(tmp_path / "lm")
    critic = H.load_value_model(tmp_path / "lm").eval()
    ours_lm = H.from_pretrained(tmp_path / "lm").eval()
    with torch.no_grad():
        _, h = ours_lm(ids, mask, return_hidden=True)
        expect = h @ critic.score.weight[0] + critic.score.bias[0]
        assert torch.allclose(critic(ids, mask), expect, atol=1e-5)
    assert 0 < critic.score.weight.std() < 0.1  # a random init, not zeros


def random_model(kind="qwen2", tie=False):
    cfg = M.ModelConfig(model_type=kind, **TINY, tie_word_embeddings=tie, rope_theta=10000.0,
                        attention_bias=kind == "qwen2")
    m = M.CausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.1)
    return m.eval()


def test_incremental_decoding_equals_full_forward():
    m = random_model()
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        full = m(ids)
        cache = M.KVCache(m.config, batch_size=2, max_len=16)
        steps = [m(ids[:, :5], cache=cache, cache_positions=torch.arange(5))]  # prefill
        for t in range(5, 12):  # then one token at a time
            steps.append(m(ids[:, t:t + 1], cache=cache, cache_positions=torch.tensor([t])))
    assert (torch.cat(steps, 1) - full).abs().max() <= 1e-5


def test_left_padded_batch_with_cache_equals_each_row_alone():
    m = random_model("llama", tie=True)
    ids, mask = batch(B=3, T=10, pad=(4, 0, 2))
    with torch.no_grad():
        cache = M.KVCache(m.config, batch_size=3, max_len=14)
        out = [m(ids[:, :7], mask[:, :7], cache=cache, cache_positions=torch.arange(7))]
        for t in range(7, 10):
            out.append(m(ids[:, t:t + 1], cache=cache, cache_positions=torch.tensor([t])))
        out = torch.cat(out, 1)
        no_cache = m(ids, mask)
        for b in range(3):
            real = mask[b].bool()
            alone = m(ids[b:b + 1, real])[0]  # the row with its padding removed
            assert (out[b, real] - alone).abs().max() <= 1e-5
            assert (no_cache[b, real] - alone).abs().max() <= 1e-5


def test_gradient_checkpointing_gives_same_gradients():
    m = random_model().train()
    ids, mask = batch()
    grads = []
    for ckpt in (False, True):
        m.zero_grad()
        m.model.gradient_checkpointing = ckpt
        m(ids, mask).logsumexp(-1).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_bad_checkpoints_give_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        H.from_pretrained(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="missing config.json"):
        H.from_pretrained(tmp_path / "empty")

    H.save_pretrained(random_model(), tmp_path / "good")
    cfg = json.loads((tmp_path / "good" / "config.json").read_text())

    bad = dict(cfg, architectures=["GPT2LMHeadModel"])
    (tmp_path / "good" / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="unsupported architecture 'GPT2LMHeadModel'"):
        H.from_pretrained(tmp_path / "good")

    wrong = dict(cfg, intermediate_size=128)  # every MLP tensor now has the wrong shape
    (tmp_path / "good" / "config.json").write_text(json.dumps(wrong))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \(96, 64\), expected \(128, 64\)"):
        H.from_pretrained(tmp_path / "good")

    more = dict(cfg, num_hidden_layers=3)
    (tmp_path / "good" / "config.json").write_text(json.dumps(more))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\."):
        H.from_pretrained(tmp_path / "good")

    (tmp_path / "good" / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "good" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        H.from_pretrained(tmp_path / "good")



def test_compiled_layers_equal_eager_and_stop_compiling_after_warm_up():
    """compile_layers (verl's use_torch_compile) with dynamo's eager backend, so the numbers are the same
    ops: log-probs and the gradient equal the uncompiled model's exactly, packed and padded micro-batches
    of every length reuse the graphs of the first micro-batch of their shape family (one packed row;
    several padded rows), and all layers share them. Counted with a backend that records each compile."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from test_workers import rollout_batch, tiny
    from nanokl import forwards
    from nanokl.engine.batching import Batching
    compiles = []

    def counting(gm, inputs):
        compiles.append(len(gm.graph.nodes))
        return gm.forward
    torch._dynamo.reset()
    eager, compiled = tiny(), M.compile_layers(tiny(), backend=counting)
    batch, _ = rollout_batch(eager.eval(), B=8)
    warm = {}
    for family, sizes in (("packed", (2, 3, 8)), ("padded", (2, 5))):
        for size in sizes:
            spec = Batching(micro_size=size, packed=family == "packed")
            want, _ = forwards.compute_log_probs(eager, batch, 0.7, spec)
            got, _ = forwards.compute_log_probs(compiled, batch, 0.7, spec)
            assert torch.equal(want, got), (family, size)
            warm.setdefault(family, len(compiles))
        assert len(compiles) == warm[family], f"{family}: recompiled after the first micro-batch ({compiles})"
    assert 0 < warm["packed"] <= 6  # the layer's graphs around attention, shared by both layers
    # gradients through the compiled layers
    for m in (eager, compiled):
        m.zero_grad()
        forwards.response_logits(m.train(), batch, 0.7).logsumexp(-1).sum().backward()
    for p, q in zip(eager.parameters(), compiled.parameters()):
        assert torch.equal(p.grad, q.grad)
    torch._dynamo.reset()

"""nanokl.rollout on CPU, each property against an independent reference:

- greedy generation equals a step-by-step argmax over full forwards with no cache, token for token,
  for a left-padded batch with different prompt lengths;
- the returned log-probs equal those recomputed by a full training forward (<= 1e-5 fp32);
- with top-k / top-p no sampled token ever falls outside the allowed set (computed in the test by
  sorting), and seeded sampling frequencies pass a chi-square test against the distribution;
- EOS handling and the masks equal a hand-written loop.
"""

import math

import pytest
import torch

from nanokl.harness import hf_format as H
from nanokl.engine import model as M
from nanokl.rollout import generate, sample_tokens

V, EOS, PAD = 40, 1, 0


def tiny_model(seed=0, scale=0.3):
    torch.manual_seed(seed)
    cfg = M.ModelConfig(model_type="qwen2", vocab_size=V, hidden_size=64, intermediate_size=96,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=1e4)
    m = M.CausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, scale)  # large weights: peaked, distinct next-token distributions
    return m.eval()


def left_padded_prompts(lengths=(5, 2, 7), T=7):
    ids = torch.randint(2, V, (len(lengths), T))
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, T - n:] = 1
    return ids.masked_fill(mask == 0, PAD), mask


def greedy_reference(m, ids, mask, max_new, eos):
    """Row by row, no padding, no cache: the whole sequence through the model for every token."""
    rows = []
    for b in range(ids.shape[0]):
        seq = ids[b][mask[b].bool()].tolist()
        out = []
        for _ in range(max_new):
            with torch.no_grad():
                tok = int(m(torch.tensor([seq]))[0, -1].argmax())
            out.append(tok)
            seq.append(tok)
            if tok == eos:
                break
        rows.append(out)
    return rows


def recompute_log_probs(m, out, temperature=1.0):
    with torch.no_grad():
        logits = m(out.sequences, out.attention_mask, out.position_ids)
    P = out.prompt_length
    logp = (logits[:, P - 1:-1] / temperature).log_softmax(-1)
    return logp.gather(-1, out.responses[..., None])[..., 0] * out.response_mask


def test_greedy_equals_argmax_over_full_forwards():
    m = tiny_model()
    ids, mask = left_padded_prompts()
    free = generate(m, ids, mask, 12, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    # pick an EOS that row 0 emits at step 4, so at least one row stops early
    eos = int(free.responses[0, 4])
    out = generate(m, ids, mask, 12, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    ref = greedy_reference(m, ids, mask, 12, eos)
    assert ref[0][-1] == eos and len(ref[0]) <= 5
    for b, toks in enumerate(ref):
        n = len(toks)
        assert out.responses[b, :n].tolist() == toks
        assert out.response_mask[b, :n].eq(1).all() and out.response_mask[b, n:].eq(0).all()
        assert out.responses[b, n:].eq(PAD).all()
    assert (recompute_log_probs(m, out) - out.log_probs).abs().max() <= 1e-5


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 5, 1.0), (1.3, -1, 0.8)])
def test_log_probs_equal_training_forward(temperature, top_k, top_p):
    m = tiny_model(1, scale=0.15)
    ids, mask = left_padded_prompts((3, 6, 4, 1), T=6)
    g = torch.Generator().manual_seed(0)
    out = generate(m, ids, mask, 10, temperature=temperature, top_k=top_k, top_p=top_p,
                   eos_token_id=EOS, pad_token_id=PAD, generator=g, n=3)
    assert out.responses.shape[0] == 12
    assert (recompute_log_probs(m, out, temperature) - out.log_probs).abs().max() <= 1e-5
    # sequences/attention/positions are what the training forward needs
    P = out.prompt_length
    assert torch.equal(out.sequences[:, P:], out.responses)
    assert torch.equal(out.attention_mask[:, P:], out.response_mask)
    real = mask.repeat_interleave(3, 0).sum(-1, keepdim=True)
    assert torch.equal(out.position_ids[:, P:], real + torch.arange(out.responses.shape[1]))


def test_n_samples_share_one_prefill_and_match_n_equals_1():
    m = tiny_model(2)
    ids, mask = left_padded_prompts()
    one = generate(m, ids, mask, 8, do_sample=False, eos_token_id=EOS, pad_token_id=PAD)
    three = generate(m, ids, mask, 8, do_sample=False, eos_token_id=EOS, pad_token_id=PAD, n=3)
    R = one.responses.shape[1]
    assert torch.equal(three.responses[:, :R], one.responses.repeat_interleave(3, 0))
    assert torch.allclose(three.log_probs[:, :R], one.log_probs.repeat_interleave(3, 0), atol=1e-6)


def test_eos_and_masks_equal_a_hand_loop():
    m = tiny_model(3, scale=0.05)  # flat distributions: EOS is sampled at varied steps
    ids, mask = left_padded_prompts((4, 4, 2, 3, 1, 5), T=5)
    out = generate(m, ids, mask, 30, eos_token_id=[EOS, 2], pad_token_id=PAD,
                   generator=torch.Generator().manual_seed(5), n=4)
    R = out.responses.shape[1]
    ended = 0
    for b in range(out.responses.shape[0]):
        toks, alive = out.responses[b].tolist(), True
        for t in range(R):
            assert out.response_mask[b, t] == int(alive)
            if not alive:
                assert toks[t] == PAD and out.log_probs[b, t] == 0
            elif toks[t] in (EOS, 2):
                alive, ended = False, ended + 1
        # a row still alive at the end ran to max_new_tokens, or generation would not have stopped
        assert not alive or R == 30
    assert ended > 0
    if ended == out.responses.shape[0]:
        assert out.response_mask[:, -1].any()  # trimmed to the last column anyone used


def test_seeded_generation_is_reproducible():
    m = tiny_model(4, scale=0.1)
    ids, mask = left_padded_prompts()
    a = generate(m, ids, mask, 10, eos_token_id=EOS, generator=torch.Generator().manual_seed(7))
    b = generate(m, ids, mask, 10, eos_token_id=EOS, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.responses, b.responses)


def allowed_set(logits, top_k, top_p):
    """Indices a top-k / top-p sampler may return, by sorting (independent of filter_logits)."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    keep = order[:top_k] if top_k > 0 else order
    probs = torch.tensor([logits[i] for i in keep]).double().softmax(0).tolist()
    out, mass = [], 0.0
    for i, p in zip(keep, probs):
        out.append(i)
        mass += p
        if mass >= top_p:
            break
    return set(out), keep[:len(out)]


def chi2_critical(dof, z=3.09):
    """Upper 0.1% point of chi-square (Wilson-Hilferty): a fair sampler fails 1 time in 1000."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("top_k,top_p", [(4, 1.0), (-1, 0.7), (6, 0.5)])
def test_top_k_top_p_never_sample_outside_the_allowed_set(top_k, top_p):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(12, generator=g) * 2
    allowed, _ = allowed_set(base.tolist(), top_k, top_p)
    tokens, _ = sample_tokens(base.expand(50_000, -1), 1.0, top_k, top_p, generator=g)
    seen = set(tokens.tolist())
    assert seen <= allowed and len(seen) == len(allowed)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.6, -1, 1.0), (1.5, 5, 1.0), (1.0, -1, 0.9)])
def test_sampled_frequencies_match_the_distribution(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(10, generator=g)
    n = 200_000
    tokens, logp = sample_tokens(logits.expand(n, -1), temperature, top_k, top_p, generator=g)
    # expected: softmax(logits / T) restricted to the allowed set and renormalised, in float64
    _, keep = allowed_set((logits / temperature).tolist(), top_k, top_p)
    p = (logits.double() / temperature).softmax(0)
    expected = torch.zeros_like(p)
    expected[keep] = p[keep] / p[keep].sum()
    counts = torch.bincount(tokens, minlength=10).double()
    chi2 = ((counts[keep] - n * expected[keep]) ** 2 / (n * expected[keep])).sum().item()
    assert chi2 < chi2_critical(len(keep) - 1)
    # the recorded log-prob is of the unfiltered temperature-scaled distribution
    assert torch.allclose(logp.double(), p.log()[tokens], atol=1e-6)


def test_generate_cli(tmp_path):
    """generate.py prints n completions per prompt, and a missing model directory exits 2 in one line."""
    import subprocess
    import sys
    from pathlib import Path

    from nanokl.harness.tokenizer import train_tokenizer

    tok = train_tokenizer([f"Q: {a} + {b} = ?\nA: {a + b}" for a in range(30) for b in range(30)], vocab_size=120)
    cfg = M.ModelConfig(model_type="qwen2", vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, rope_theta=1e4)
    H.save_pretrained(M.init_weights(M.CausalLM(cfg)), tmp_path / "m")
    tok.save(tmp_path / "m")
    (tmp_path / "p.txt").write_text("Q: 1 + 2 = ?\nQ: 3 + 4 = ?\n")
    script = Path(__file__).resolve().parents[1] / "generate.py"
    run = subprocess.run([sys.executable, script, "--model", tmp_path / "m", "--prompts", tmp_path / "p.txt",
                          "--n", "2", "--max-new-tokens", "5"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("=== prompt") == 4 and "Q: 3 + 4 = ?" in run.stdout
    bad = subprocess.run([sys.executable, script, "--model", tmp_path / "nope", "--prompt", "x"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [f"error: model directory '{tmp_path / 'nope'}' does not exist"]

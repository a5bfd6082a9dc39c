"""The CUDA precision setup, run on a CPU: fp32 master weights under bf16 autocast for the actor
and the reference, a bf16 fused rollout copy for generation (nanokl/harness/run.py's `setup`).

- Step-0 KL is exactly 0: the reference is loaded like the actor (fp32) and runs under the same
  autocast (forwards.AUTOCAST), so on the same tokens both compute the same numbers. The old setup
  (reference in bf16 weights) gives a nonzero KL at step 0: the control.
- rollout/log_prob_max_diff, the largest |rollout log-prob - training log-prob| over response
  tokens, stays within 2^-6 max|logit|. Why that bound: bf16 keeps 8 significant bits, so one
  rounding of a logit z moves it by at most half an ulp, <= 2^-8 |z|; a log-prob is
  z_token - logsumexp(z), the difference of two such quantities, and the bf16 copy and the autocast
  forward round differently inside the network (weights, residual stream, attention), so we
  allow two ulps of the largest logit on each side: 4 x 2^-8 = 2^-6 max|z|. Measured: 0.024 nats
  at max|z| = 3.0 (bound 0.047).
- Autocast really ran on the CPU (its log-probs differ from plain fp32), and the default CPU path
  stays plain fp32 (forwards.autocast is a no-op without the test's setting).
"""

import torch

from nanokl.engine import model as M
from nanokl import forwards
from nanokl.engine.fused import fuse_for_rollout
from nanokl.kl import kl_penalty
from nanokl.rollout import generate

CFG = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, rope_theta=1e4)


def copy_of(model, dtype=torch.float32):
    m = M.CausalLM(model.config).eval()
    m.load_state_dict(model.state_dict())
    return m.to(dtype)


def test_cuda_precision_setup_on_cpu(monkeypatch):
    torch.manual_seed(0)
    actor = M.init_weights(M.CausalLM(M.ModelConfig(**CFG)), std=0.1).eval()
    ref = copy_of(actor)  # as setup() now loads it: fp32
    rollout = fuse_for_rollout(copy_of(actor, torch.bfloat16))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 97, (16, 8), generator=g)
    mask = torch.ones_like(ids)
    mask[::3, :3] = 0
    out = generate(rollout, ids.masked_fill(mask == 0, 0), mask, 16, eos_token_id=1, pad_token_id=0, generator=g)
    batch = {k: getattr(out, k) for k in ("sequences", "attention_mask", "position_ids", "responses", "response_mask")}
    rm = out.response_mask.bool()

    assert "cpu" not in forwards.AUTOCAST  # the default CPU run: plain fp32
    fp32, _ = forwards.compute_log_probs(actor, batch, 1.0)
    monkeypatch.setitem(forwards.AUTOCAST, "cpu", torch.bfloat16)
    old, _ = forwards.compute_log_probs(actor, batch, 1.0)
    ref_logp, _ = forwards.compute_log_probs(ref, batch, 1.0)
    assert (old - fp32)[rm].abs().max() > 0  # autocast ran

    # step-0 KL: exactly zero, by every estimator
    assert torch.equal(old, ref_logp)
    for kind in ("k1", "k3"):
        assert (kl_penalty(old, ref_logp, kind)[rm] == 0).all()
    bf16_ref, _ = forwards.compute_log_probs(copy_of(actor, torch.bfloat16), batch, 1.0)  # the old setup
    assert (old - bf16_ref)[rm].abs().max() > 1e-3

    # rollout vs training log-probs: within two bf16 ulps of the largest logit on each side
    with torch.no_grad():
        zmax = actor(out.sequences, out.attention_mask, out.position_ids).abs().max()
    gap = (out.log_probs - old)[rm].abs().max()
    assert gap <= 2 ** -6 * zmax, (gap, zmax)

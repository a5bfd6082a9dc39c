"""nanokl.workers: the micro-batched forwards and updates against one-batch / float64 references.

- Response log-probs equal a per-sequence float64 reference (each row run alone, unpadded).
- Critic values are read at the positions that precede each response token.
- For every loss_agg_mode, the gradient accumulated over micro-batches (fixed counts, token budgets,
  packed or padded) equals the gradient of the whole mini-batch loss computed in one piece (policy
  loss + KL loss + entropy bonus): elementwise to float error and within 1e-6 relative in norm.
"""

from types import SimpleNamespace

import pytest
import torch

from nanokl import workers as W
from nanokl import model as M
from nanokl.batching import Batching
from nanokl.ppo import LOSS_AGG_MODES
from nanokl.kl import kl_penalty
from nanokl.ppo import agg_loss, compute_policy_loss, entropy_from_logits
from nanokl.rollout import generate

V = 37


def tiny(cls=M.CausalLM, seed=0):
    torch.manual_seed(seed)
    cfg = M.ModelConfig(model_type="qwen2", vocab_size=V, hidden_size=32, intermediate_size=48,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=1e4)
    m = cls(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.2)
    return m


def rollout_batch(m, B=6, T=5, R=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (B, T), generator=g)
    mask = torch.ones_like(ids)
    for b in range(B):
        mask[b, : b % 3] = 0
    out = generate(m, ids.masked_fill(mask == 0, 0), mask, R, eos_token_id=1, pad_token_id=0, generator=g)
    return {"sequences": out.sequences, "attention_mask": out.attention_mask, "position_ids": out.position_ids,
            "responses": out.responses, "response_mask": out.response_mask}, out


def test_log_probs_equal_per_sequence_float64_reference():
    m = tiny().eval()
    batch, out = rollout_batch(m)
    logp, ent = W.compute_log_probs(m, batch, temperature=0.7, spec=Batching(micro_size=4), with_entropy=True)
    m64 = tiny().double().eval()
    P = out.prompt_length
    for b in range(len(batch["responses"])):
        real = batch["attention_mask"][b].bool()
        seq = batch["sequences"][b][real]
        n_prompt = int(batch["attention_mask"][b, :P].sum())
        with torch.no_grad():
            logits = m64(seq[None])[0] / 0.7
        for t in range(int(batch["response_mask"][b].sum())):
            lp = logits[n_prompt + t - 1].log_softmax(-1)
            assert abs(lp[seq[n_prompt + t]].item() - logp[b, t].item()) < 1e-5
            p = lp.exp()
            assert abs(-(p * lp).sum().item() - ent[b, t].item()) < 1e-5


def test_values_are_read_before_each_response_token():
    critic = tiny(M.ValueModel).eval()
    batch, out = rollout_batch(tiny().eval())
    values = W.compute_values(critic, batch, Batching(micro_size=5))
    with torch.no_grad():
        full = critic(batch["sequences"], batch["attention_mask"], batch["position_ids"])
    P = out.prompt_length
    assert torch.allclose(values, full[:, P - 1:P - 1 + values.shape[1]], atol=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batched_gradient_equals_the_mini_batch_gradient(mode):
    m = tiny().train()
    batch, _ = rollout_batch(m.eval(), B=6)
    m.train()
    g = torch.Generator().manual_seed(1)
    rmask = batch["response_mask"]
    batch["old_log_probs"], _ = W.compute_log_probs(m, batch, 1.0)
    batch["old_log_probs"] = batch["old_log_probs"] + 0.3 * torch.randn(rmask.shape, generator=g) * rmask
    batch["ref_log_probs"] = batch["old_log_probs"] - 0.2 * torch.rand(rmask.shape, generator=g)
    batch["advantages"] = torch.randn(rmask.shape, generator=g)
    a = SimpleNamespace(loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                        entropy_coeff=0.01, use_kl_loss=True, kl_loss_type="low_var_kl", kl_loss_coef=0.1,
                        ppo_epochs=1, shuffle=False, grad_clip=1e9, ppo_micro_batch_size_per_gpu=None)
    R = rmask.shape[1]

    # reference: the whole mini-batch in one forward, the loss written out here
    m.zero_grad()
    logits = W.response_logits(m, batch, 1.0)
    logp = torch.log_softmax(logits, -1).gather(-1, batch["responses"][..., None])[..., 0]
    pg, _ = compute_policy_loss(batch["old_log_probs"], logp, batch["advantages"], rmask, 0.2, 0.28, 3.0, mode,
                                horizon=R)
    loss = pg - 0.01 * agg_loss(entropy_from_logits(logits), rmask, mode, horizon=R)
    loss = loss + 0.1 * agg_loss(kl_penalty(logp, batch["ref_log_probs"], "low_var_kl"), rmask, mode, horizon=R)
    loss.backward()
    ref = [p.grad.clone() for p in m.parameters()]

    # update_actor with micro-batches of 2 and an optimizer that records the gradient it is given
    class Recorder(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})
            self.seen = None

        def step(self):
            self.seen = [p.grad.clone() for g in self.param_groups for p in g["params"]]

    # fixed micro-batches of 2 and 4 responses, token budgets (padded and packed), all alike
    lengths = batch["attention_mask"].sum(-1)
    specs = [Batching(micro_size=2), Batching(micro_size=4),
             Batching(token_budget=2 * batch["attention_mask"].shape[1]),
             Batching(token_budget=int(lengths.max()) + 3, packed=True), Batching(packed=True)]
    for spec in specs:
        opt = Recorder(m.parameters())
        m.zero_grad()
        W.update_actor(m, opt, batch, a, 1.0, mini_size=6, spec=spec, horizon=R)
        for r, s in zip(ref, opt.seen):
            assert torch.allclose(r, s, rtol=1e-5, atol=1e-7), (mode, spec)
        g_ref, g = torch.cat([r.flatten() for r in ref]), torch.cat([s.flatten() for s in opt.seen])
        assert (g - g_ref).norm() <= 1e-6 * g_ref.norm(), (mode, spec)  # the 1e-6 relative bound

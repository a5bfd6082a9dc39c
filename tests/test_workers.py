"""nanokl.forwards and nanokl.workers: the micro-batched forwards and updates against one-batch / float64 references.

- Response log-probs equal a per-sequence float64 reference (each row run alone, unpadded).
- Critic values are read at the positions that precede each response token.
- For every loss_agg_mode, the gradient accumulated over micro-batches (fixed counts, token budgets,
  packed or padded, the LM head whole or chunked) equals the gradient of the whole mini-batch loss computed in one piece (policy
  loss + KL loss + entropy bonus): elementwise to float error and within 1e-6 relative in norm.
- The exact KL (`full`): compute_full_kl equals torch's kl_div on each sequence's own float64
  forwards and does not depend on the micro-batching; the micro-batched gradient of the `full` KL
  loss equals the one-batch gradient of kl_div, and its metrics (kl_loss, k1, k3) equal their
  one-batch values.
- Bypass: where the rollout's log-probs may stand in for the old ones (rollout_log_probs_are_old),
  the update they give equals the recomputed one (gradient within 1e-5 relative), and the entropy
  update_actor returns comes from each row's first pass (checked against copies of the policy
  before and after the first optimizer step).
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from nanokl import forwards
from nanokl import workers as W
from nanokl.engine import model as M
from nanokl.engine.batching import Batching
from nanokl.ppo import LOSS_AGG_MODES
from nanokl.kl import kl_penalty
from nanokl.ppo import agg_loss, compute_policy_loss, entropy_from_logits
from nanokl.rollout import generate

VANILLA = SimpleNamespace(loss_mode="vanilla")  # actor.policy_loss: the clipped PPO loss

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


class Recorder(torch.optim.Optimizer):
    """An optimizer that records the gradient it is given instead of stepping."""

    def __init__(self, params):
        super().__init__(params, {})
        self.seen = None

    def step(self):
        self.seen = [p.grad.clone() for g in self.param_groups for p in g["params"]]


def test_log_probs_equal_per_sequence_float64_reference():
    m = tiny().eval()
    batch, out = rollout_batch(m)
    logp, ent = forwards.compute_log_probs(m, batch, temperature=0.7, spec=Batching(micro_size=4), with_entropy=True)
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
    values = forwards.compute_values(critic, batch, Batching(micro_size=5))
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
    batch["old_log_probs"], _ = forwards.compute_log_probs(m, batch, 1.0)
    batch["old_log_probs"] = batch["old_log_probs"] + 0.3 * torch.randn(rmask.shape, generator=g) * rmask
    batch["ref_log_probs"] = batch["old_log_probs"] - 0.2 * torch.rand(rmask.shape, generator=g)
    batch["advantages"] = torch.randn(rmask.shape, generator=g)
    a = SimpleNamespace(loss_mode="ppo", policy_loss=VANILLA,
                        loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                        entropy_coeff=0.01, use_kl_loss=True, kl_loss_type="low_var_kl",
                        ppo_epochs=1, shuffle=False, grad_clip=1e9, ppo_micro_batch_size_per_gpu=None)
    R = rmask.shape[1]

    # reference: the whole mini-batch in one forward, the loss written out here
    m.zero_grad()
    logits = forwards.response_logits(m, batch, 1.0)
    logp = torch.log_softmax(logits, -1).gather(-1, batch["responses"][..., None])[..., 0]
    pg, _ = compute_policy_loss(batch["old_log_probs"], logp, batch["advantages"], rmask, 0.2, 0.28, 3.0, mode,
                                horizon=R)
    loss = pg - 0.01 * agg_loss(entropy_from_logits(logits), rmask, mode, horizon=R)
    loss = loss + 0.1 * agg_loss(kl_penalty(logp, batch["ref_log_probs"], "low_var_kl"), rmask, mode, horizon=R)
    loss.backward()
    ref = [p.grad.clone() for p in m.parameters()]

    # fixed micro-batches of 2 and 4 responses, token budgets (padded and packed), all alike
    lengths = batch["attention_mask"].sum(-1)
    specs = [Batching(micro_size=2), Batching(micro_size=4),
             Batching(token_budget=2 * batch["attention_mask"].shape[1]),
             Batching(token_budget=int(lengths.max()) + 3, packed=True), Batching(packed=True),
             # the chunked LM head (nanokl/engine/fused.py) inside the micro-batched loop, padded and packed
             Batching(micro_size=4, chunk=5), Batching(token_budget=int(lengths.max()) + 3, packed=True, chunk=3)]
    for spec in specs:
        opt = Recorder(m.parameters())
        m.zero_grad()
        W.update_actor(m, opt, batch, a, 1.0, mini_size=6, spec=spec, horizon=R, kl_loss_coef=0.1)
        for r, s in zip(ref, opt.seen):
            assert torch.allclose(r, s, rtol=1e-5, atol=1e-7), (mode, spec)
        g_ref, g = torch.cat([r.flatten() for r in ref]), torch.cat([s.flatten() for s in opt.seen])
        assert (g - g_ref).norm() <= 1e-6 * g_ref.norm(), (mode, spec)  # the 1e-6 relative bound


# --------------------------------------------------------------------------------------
# The exact KL (`full`): both models' logits, micro-batch by micro-batch.
# --------------------------------------------------------------------------------------

def kl_div_rows(logits, ref_logits):
    """KL(π‖π_ref) over the last dim with torch's kl_div: input log π_ref, target log π."""
    return F.kl_div(ref_logits.log_softmax(-1), logits.log_softmax(-1), log_target=True, reduction="none").sum(-1)


def end_early(batch, P, lengths={1: 3, 4: 5}):
    """Responses that stopped early, as after an EOS: the rest of the row is right padding."""
    for b, n in lengths.items():
        batch["response_mask"][b, n:] = 0
        batch["attention_mask"][b, P + n:] = 0
    return batch


def budget_specs(batch):
    lengths = batch["attention_mask"].sum(-1)
    return [Batching(micro_size=2), Batching(micro_size=4), Batching(token_budget=2 * batch["attention_mask"].shape[1]),
            Batching(token_budget=int(lengths.max()) + 3, packed=True), Batching(packed=True)]


def test_full_kl_equals_per_sequence_float64_kl_div():
    """Each sequence alone (unpadded) through float64 copies of both models: kl_div of the two
    next-token distributions at the positions before each response token, temperature 0.7.
    compute_full_kl runs in float32: agreement within 2e-6 (absolute; seen: 2.4e-7) on KLs of
    0.07-0.2, i.e. about 1e-5 relative."""
    pol, ref = tiny(seed=0).eval(), tiny(seed=1).eval()
    batch, out = rollout_batch(pol)
    end_early(batch, out.prompt_length)
    kl = forwards.compute_full_kl(pol, ref, batch, 0.7, Batching(micro_size=4))
    pol64, ref64 = tiny(seed=0).double().eval(), tiny(seed=1).double().eval()
    P, rmask = out.prompt_length, batch["response_mask"]
    assert kl.shape == rmask.shape and kl.dtype == torch.float32
    expected = torch.zeros(rmask.shape, dtype=torch.float64)
    for b in range(len(rmask)):
        seq = batch["sequences"][b][batch["attention_mask"][b].bool()]
        n_prompt, n_resp = int(batch["attention_mask"][b, :P].sum()), int(rmask[b].sum())
        with torch.no_grad():
            rows = slice(n_prompt - 1, n_prompt - 1 + n_resp)
            expected[b, :n_resp] = kl_div_rows(pol64(seq[None])[0, rows] / 0.7, ref64(seq[None])[0, rows] / 0.7)
    assert (rmask.sum(-1) < rmask.shape[1]).any()  # some padding, where the KL must be 0
    assert expected[rmask.bool()].mean() > 0.05  # two different models: a KL worth checking
    assert (kl.double() - expected).abs().max() <= 2e-6
    assert (kl[rmask == 0] == 0).all()


def test_full_kl_does_not_depend_on_the_micro_batching():
    """Fixed counts, token budgets, packed or not: the one-batch values within 2e-6 (float32
    rounding of different matmul shapes and of packed attention; seen: <= 5e-7)."""
    pol, ref = tiny(seed=0).eval(), tiny(seed=1).eval()
    batch, out = rollout_batch(pol, B=7)
    end_early(batch, out.prompt_length)
    one = forwards.compute_full_kl(pol, ref, batch, 0.7)
    assert one.abs().max() > 0.1
    for spec in budget_specs(batch):
        assert (forwards.compute_full_kl(pol, ref, batch, 0.7, spec) - one).abs().max() <= 2e-6, spec


def full_loss_setup(mode):
    pol, ref = tiny(seed=0).train(), tiny(seed=1).eval()
    batch, out = rollout_batch(pol.eval(), B=6)
    end_early(batch, out.prompt_length)
    pol.train()
    rmask = batch["response_mask"]
    batch["old_log_probs"], _ = forwards.compute_log_probs(pol, batch, 0.7)
    batch["advantages"] = torch.zeros(rmask.shape)  # no policy-gradient term: the KL loss alone
    # no kl_loss_coef attribute: update_actor must take the coefficient it is given
    a = SimpleNamespace(loss_mode="ppo", policy_loss=VANILLA,
                        loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                        entropy_coeff=0.0, use_kl_loss=True, kl_loss_type="full", ppo_epochs=1, shuffle=False,
                        grad_clip=1e9)
    return pol, ref, batch, out.prompt_length, a


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_full_kl_loss_gradient_equals_the_one_batch_kl_div_gradient(mode):
    """The reference is written here: one padded forward of each model over the whole batch,
    kl_div of the temperature-0.7 distributions, agg_loss, x coef, backward. update_actor with
    kl_loss_type="full" under every micro-batching must hand the optimizer the same gradient
    (1e-5 relative elementwise, 1e-6 in norm), log kl_loss, k1 and k3 equal to their one-batch
    values, and leave the reference without gradients."""
    pol, ref, batch, P, a = full_loss_setup(mode)
    rmask, R, coef = batch["response_mask"], batch["response_mask"].shape[1], 0.5

    def logits_of(model):
        full = model(batch["sequences"], batch["attention_mask"], batch["position_ids"])
        return full[:, P - 1:P - 1 + R] / 0.7

    pol.zero_grad()
    logits = logits_of(pol)
    with torch.no_grad():
        ref_logits = logits_of(ref)
    kl_loss = agg_loss(kl_div_rows(logits, ref_logits), rmask, mode, horizon=R)
    (coef * kl_loss).backward()
    expected = [p.grad.clone() for p in pol.parameters()]
    lp = logits.detach().log_softmax(-1).gather(-1, batch["responses"][..., None])[..., 0]
    ref_lp = ref_logits.log_softmax(-1).gather(-1, batch["responses"][..., None])[..., 0]
    est = {k: agg_loss(kl_penalty(lp, ref_lp, k), rmask, mode, horizon=R).item() for k in ("k1", "k3")}
    assert kl_loss.item() > 0.05

    for spec in [Batching()] + budget_specs(batch):
        opt = Recorder(pol.parameters())
        pol.zero_grad()
        metrics, _ = W.update_actor(pol, opt, batch, a, 0.7, mini_size=6, spec=spec, horizon=R, kl_loss_coef=coef,
                                    ref=ref)
        for e, s in zip(expected, opt.seen):
            assert torch.allclose(e, s, rtol=1e-5, atol=1e-7), (mode, spec)
        g_ref, g = torch.cat([e.flatten() for e in expected]), torch.cat([s.flatten() for s in opt.seen])
        assert (g - g_ref).norm() <= 1e-6 * g_ref.norm(), (mode, spec)
        assert all(p.grad is None for p in ref.parameters())  # the reference ran without autograd
        assert metrics["actor/kl_coef"] == [coef]
        assert metrics["actor/kl_loss"][0] == pytest.approx(kl_loss.item(), rel=1e-5)
        for k in ("k1", "k3"):
            v = metrics[f"actor/kl_loss_{k}"]
            assert len(v) == 1 and v[0] == pytest.approx(est[k], rel=1e-5, abs=1e-6), (k, spec)
        assert metrics["actor/kl_loss_k3"][0] >= 0


def test_full_kl_loss_runs_over_epochs_and_needs_the_reference():
    """Two epochs of two mini-batches with an entropy bonus and a real optimizer: every KL metric
    is finite, one value per mini-batch; without `ref` the call says what is missing."""
    pol, ref, batch, _, a = full_loss_setup("token-mean")
    batch["advantages"] = torch.randn(batch["response_mask"].shape, generator=torch.Generator().manual_seed(3))
    a.ppo_epochs, a.entropy_coeff, a.grad_clip = 2, 0.01, 1.0
    opt = torch.optim.AdamW(pol.parameters(), lr=1e-3)
    metrics, entropy = W.update_actor(pol, opt, batch, a, 0.7, mini_size=3, spec=Batching(micro_size=2),
                                      kl_loss_coef=0.1, ref=ref)
    assert entropy is None  # recorded only when asked
    for k in ("actor/kl_loss", "actor/kl_loss_k1", "actor/kl_loss_k3", "actor/grad_norm"):
        assert len(metrics[k]) == 4 and all(torch.isfinite(torch.tensor(metrics[k]))), k
    assert "actor/nan_skipped" not in metrics
    with pytest.raises(ValueError, match="reference"):
        W.update_actor(pol, opt, batch, a, 0.7, mini_size=3, kl_loss_coef=0.1)


# --------------------------------------------------------------------------------------
# Old log-probs from the rollout (verl's bypass mode) instead of a recomputing forward.
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode, same, do_sample, temperature, expected", [
    ("auto", True, True, 0.7, True),     # the fp32 actor sampled, at the training temperature
    ("auto", False, True, 1.0, False),   # a bf16 rollout copy (CUDA): other numerics, recompute
    ("auto", True, False, 1.0, True),    # greedy records temperature 1: the training temperature here
    ("auto", True, False, 0.7, False),   # ... but not here
    (True, False, True, 0.7, True),      # asked for: the sampler's own log-probs anchor PPO
    (True, True, False, 0.7, False),     # never a different temperature's (rules refuses it)
    (False, True, True, 1.0, False),
])
def test_when_rollout_log_probs_are_the_old_ones(mode, same, do_sample, temperature, expected):
    assert forwards.rollout_log_probs_are_old(mode, same_numerics=same, do_sample=do_sample,
                                       temperature=temperature) is expected


@pytest.mark.parametrize("top_k, top_p, spec", [(-1, 1.0, Batching()), (5, 0.8, Batching(micro_size=2)),
                                                (-1, 1.0, Batching(packed=True))])
def test_rollout_log_probs_give_the_recomputed_update(top_k, top_p, spec):
    """The rollout's log-probs (temperature 0.7, with and without top-k/top-p filtering, which the
    recorded log-prob ignores as training does) are the actor's old log-probs up to float error
    (<= 1e-5), and one update_actor with them equals one with the recomputed ones: the gradient the
    optimizer gets within 1e-5 relative in norm, the metrics within 1e-5. The entropy recorded from
    the update's own logits equals compute_log_probs' entropy on the unchanged policy (<= 1e-5)."""
    m = tiny().eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, V, (6, 5), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = mask[4, :1] = 0
    out = generate(m, ids.masked_fill(mask == 0, 0), mask, 7, temperature=0.7, top_k=top_k, top_p=top_p,
                   eos_token_id=1, pad_token_id=0, generator=g)
    batch = {"sequences": out.sequences, "attention_mask": out.attention_mask, "position_ids": out.position_ids,
             "responses": out.responses, "response_mask": out.response_mask}
    rmask = out.response_mask
    recomputed, ent = forwards.compute_log_probs(m, batch, 0.7, with_entropy=True)
    assert ((out.log_probs - recomputed).abs() * rmask).max() <= 1e-5
    batch["ref_log_probs"] = recomputed - 0.1 * torch.rand(rmask.shape, generator=g)
    batch["advantages"] = torch.randn(rmask.shape, generator=g)
    a = SimpleNamespace(loss_mode="ppo", policy_loss=VANILLA,
                        loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                        entropy_coeff=0.0, use_kl_loss=True, kl_loss_type="low_var_kl", ppo_epochs=1,
                        shuffle=False, grad_clip=1e9)
    results = []
    for old in (recomputed, out.log_probs):
        m.train().zero_grad()
        opt = Recorder(m.parameters())
        metrics, got = W.update_actor(m, opt, {**batch, "old_log_probs": old}, a, 0.7, mini_size=6, spec=spec,
                                      kl_loss_coef=0.04, record_entropy=True)
        results.append((torch.cat([s.flatten() for s in opt.seen]), metrics, got))
    (g_re, m_re, ent_re), (g_by, m_by, ent_by) = results
    assert (g_by - g_re).norm() <= 1e-5 * g_re.norm()
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/ppo_kl", "actor/pg_clipfrac"):
        assert abs(m_by[k][0] - m_re[k][0]) <= 1e-5, k
    for e in (ent_re, ent_by):
        assert ((e - ent).abs() * rmask).max() <= 1e-5  # every row recorded, from pi_old's logits


def test_entropy_is_recorded_on_the_first_pass_over_each_row():
    """Two mini-batches and two epochs: each row's entropy comes from the pass that first saw it,
    i.e. the policy before (rows 0-2) or after (rows 3-5) the first optimizer step, never from the
    second epoch. Checked against compute_log_probs on copies of the policy at those two moments."""
    m = tiny().train()
    batch, _ = rollout_batch(m.eval(), B=6)
    rmask = batch["response_mask"]
    batch["old_log_probs"], before = forwards.compute_log_probs(m, batch, 1.0, with_entropy=True)
    batch["advantages"] = torch.randn(rmask.shape, generator=torch.Generator().manual_seed(2))
    a = SimpleNamespace(loss_mode="ppo", policy_loss=VANILLA,
                        loss_agg_mode="token-mean", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                        entropy_coeff=0.0, use_kl_loss=False, kl_loss_type="low_var_kl", ppo_epochs=2,
                        shuffle=False, grad_clip=1.0)
    seen = []

    class Snap(torch.optim.SGD):  # the entropy of every row right after each optimizer step
        def step(self):
            super().step()
            seen.append(forwards.compute_log_probs(m, batch, 1.0, with_entropy=True)[1])
    _, got = W.update_actor(m.train(), Snap(m.parameters(), lr=0.5), batch, a, 1.0, mini_size=3, kl_loss_coef=0.0,
                            record_entropy=True)
    assert ((got[:3] - before[:3]).abs() * rmask[:3]).max() <= 1e-5
    assert ((got[3:] - seen[0][3:]).abs() * rmask[3:]).max() <= 1e-5
    assert ((seen[0][3:] - before[3:]).abs() * rmask[3:]).max() > 1e-3  # the step did move the policy


def test_first_pass_entropy_records_without_a_tensor_made_from_a_host_value():
    """What a CUDA run's sync check (tests/test_workers_cuda.py) needs, seen on the CPU: record() makes no
    tensor from a Python scalar (lift_fresh / scalar_tensor, the host-to-device copy of `x[rows] = True`)
    and copies nothing; and it keeps the first pass's entropy of each row (a float64 reference)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from nanokl.workers import FirstPassEntropy

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))
    mask = torch.ones(4, 3)
    rec = FirstPassEntropy({"response_mask": mask})
    first, second, rows = torch.rand(2, 3), torch.rand(2, 3), torch.tensor([1, 3])
    with Ops() as ops:
        rec.record(rows, first)
    rec.record(torch.tensor([3, 0]), second)  # row 3 was seen: it keeps its first entropy
    assert not {n for n in ops.names if n.startswith(("lift_fresh", "scalar_tensor", "_to_copy", "copy_"))}, ops.names
    want = torch.zeros(4, 3, dtype=torch.float64)
    want[1], want[3], want[0] = first[0].double(), first[1].double(), second[1].double()
    assert torch.equal(rec.entropy.double(), want) and rec.seen.tolist() == [True, True, False, True]

"""DPO/IPO losses and gradients against float64 closed forms, metrics against python loops,
and the lesson's claim: DPO's population optimum on a bandit is π* ∝ π_ref exp(r/β).

How the tests prove it. Both losses and their gradients with respect to all four inputs equal
float64 closed forms written by hand, including β h = ±50 where the naive log(1 + exp(−βh))
overflows; the metrics equal python loops; sequence_log_probs equals a python loop with NaN/inf
under the mask. The update itself (update_policy on a tiny float64 model, micro-batched): its
loss and gradient equal the papers' gradient written out on per-row float64 log-probs, to 1e-6
(with float64 logits; to float32 rounding with the step's fp32 logits). IPO's h is on summed
log-probs in nanokl (the paper's); TRL's "ipo" averages them over tokens (bench/dpo_trl.py
compares the two trainers). And the claim of nanokl/dpo.py, numerically: on a one-prompt bandit with 4
responses and Bradley-Terry preferences in true rewards r, minimising the exact expected DPO loss
over the policy's logits recovers π* ∝ π_ref exp(r/β) (log π/π_ref − r/β constant across
responses).
"""

import itertools
import math

import pytest
import torch

from nanokl.dpo import DPO_LOSSES, dpo_loss, sequence_log_probs


def split_pairs(x):
    """The tests' helper: rows alternate (chosen, rejected) of one prompt, as update_policy reads them
    (rows 2k, 2k+1): [2P, ...] -> ([P, ...], [P, ...])."""
    return x[0::2], x[1::2]


def stable_neg_log_sigmoid(z):
    """−log σ(z) = log(1 + e^{−z}), in python float64, written so neither branch overflows."""
    return math.log1p(math.exp(-z)) if z >= 0 else -z + math.log1p(math.exp(z))


def sigmoid(z):
    return 1 / (1 + math.exp(-z)) if z >= 0 else math.exp(z) / (1 + math.exp(z))


def pair_inputs(beta):
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(8, generator=g, dtype=torch.float64) * 3 for _ in range(4))
    # two pairs at βh = +50 and −50: far in the tails, where a loss or gradient built from
    # exp(±βh) loses everything (see test_naive_formula_really_overflows for the overflow itself)
    pc[0], pr[0], rc[0], rr[0] = 50 / beta, 0.0, 0.0, 0.0
    pc[1], pr[1], rc[1], rr[1] = -50 / beta, 0.0, 0.0, 0.0
    return pc, pr, rc, rr


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("loss_type", DPO_LOSSES)
def test_loss_and_gradients_match_closed_forms(loss_type, dtype):
    beta = 0.7
    pc, pr, rc, rr = pair_inputs(beta)
    ins = [t.to(dtype).clone().requires_grad_() for t in (pc, pr, rc, rr)]
    losses, _ = dpo_loss(*ins, beta=beta, loss_type=loss_type)
    losses.sum().backward()
    losses = losses.detach()
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    for k in range(8):
        h = (float(pc[k]) - float(rc[k])) - (float(pr[k]) - float(rr[k]))
        if loss_type == "sigmoid":
            want = stable_neg_log_sigmoid(beta * h)
            dh = -beta * sigmoid(-beta * h)
        else:
            want = (h - 1 / (2 * beta)) ** 2
            dh = 2 * (h - 1 / (2 * beta))
        assert math.isfinite(float(losses[k]))
        assert float(losses[k]) == pytest.approx(want, rel=tol, abs=tol)
        for t, sign in zip(ins, (1, -1, -1, 1)):
            assert float(t.grad[k]) == pytest.approx(sign * dh, rel=tol, abs=tol)
    if loss_type == "sigmoid":  # the pair at βh = −50: loss ≈ 50, not inf; at +50: ≈ e^−50
        assert float(losses[1]) == pytest.approx(50.0, rel=1e-6)
        assert 0 <= float(losses[0]) < 1e-20


def test_naive_formula_really_overflows():
    z = torch.tensor([-100.0])  # βh = −100 in float32: exp(−βh) = exp(100) = inf
    assert torch.isinf(torch.log(1 + torch.exp(-z)))
    losses, _ = dpo_loss(torch.tensor([-100.0]), torch.tensor([0.0]), torch.tensor([0.0]),
                         torch.tensor([0.0]), beta=1.0)
    assert float(losses[0]) == pytest.approx(stable_neg_log_sigmoid(-100.0), rel=1e-6)


def test_metrics_match_python_loops():
    beta = 0.3
    pc, pr, rc, rr = pair_inputs(beta)
    _, m = dpo_loss(pc.clone().requires_grad_(), pr, rc, rr, beta=beta)
    chosen = [beta * (float(a) - float(b)) for a, b in zip(pc, rc)]
    rejected = [beta * (float(a) - float(b)) for a, b in zip(pr, rr)]
    assert float(m["dpo/chosen_reward"]) == pytest.approx(sum(chosen), rel=1e-12)
    assert float(m["dpo/rejected_reward"]) == pytest.approx(sum(rejected), rel=1e-12)
    assert float(m["dpo/reward_margin"]) == pytest.approx(sum(c - r for c, r in zip(chosen, rejected)), rel=1e-12)
    assert float(m["dpo/reward_accuracy"]) == sum(1 for c, r in zip(chosen, rejected) if c > r)
    assert 0 < float(m["dpo/reward_accuracy"]) < 8  # the inputs hold both kinds of pair
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())


def test_bad_arguments():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="sigmoid, ipo"):
        dpo_loss(x, x, x, x, beta=0.1, loss_type="hinge")
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(x, x, x, x, beta=0.0)


def test_sequence_log_probs():
    g = torch.Generator().manual_seed(1)
    lp = -torch.rand(6, 5, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.4
    mask[2] = False  # an all-padding row sums to 0
    lp[~mask] = torch.tensor([float("nan"), float("inf"), -float("inf")]).repeat(10)[: int((~mask).sum())]
    got = sequence_log_probs(lp, mask)
    for i in range(6):
        want = sum(float(lp[i, j]) for j in range(5) if mask[i, j])
        assert float(got[i]) == pytest.approx(want, abs=1e-6)


def test_expected_dpo_loss_recovers_the_kl_regularized_optimum():
    # Why this is the right check: with Bradley-Terry preferences in r, each unordered pair (i, j)
    # contributes p·(−log σ(z)) + (1 − p)·(−log σ(−z)), p = σ(r_i − r_j), z = β h_ij, minimised
    # exactly at σ(z) = p, i.e. β(log π_i/π_ref,i − log π_j/π_ref,j) = r_i − r_j for every pair:
    # log π/π_ref − r/β is constant, which is π* ∝ π_ref exp(r/β), the maximiser of PPO's
    # E[r] − β KL(π‖π_ref). Softmax logits can only fix π up to that constant (Σπ = 1 pins it).
    beta = 0.5
    ref = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    r = torch.tensor([0.2, -0.5, 1.0, 0.3], dtype=torch.float64)
    pairs = list(itertools.permutations(range(4), 2))
    w_idx = torch.tensor([i for i, _ in pairs])
    l_idx = torch.tensor([j for _, j in pairs])
    weights = torch.sigmoid(r[w_idx] - r[l_idx])  # P(i beats j): the chance this ordered pair is logged so
    logits = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([logits], lr=1, max_iter=200, tolerance_grad=1e-12,
                            tolerance_change=1e-15, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        logp = torch.log_softmax(logits, 0)
        losses, _ = dpo_loss(logp[w_idx], logp[l_idx], ref.log()[w_idx], ref.log()[l_idx], beta)
        loss = (weights * losses).sum()
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
    gap = torch.log_softmax(logits.detach(), 0) - ref.log() - r / beta
    assert float(gap.max() - gap.min()) < 1e-4
    target = ref * torch.exp(r / beta)
    assert torch.allclose(torch.softmax(logits.detach(), 0), target / target.sum(), atol=1e-5)
    # and it is not the reference policy nor the greedy one: the test can fail
    assert float((torch.softmax(logits.detach(), 0) - ref).abs().max()) > 0.1


@pytest.mark.parametrize("fp32_logits", [False, True])
@pytest.mark.parametrize("loss_type", DPO_LOSSES)
def test_update_gradient_equals_float64_per_pair_formula(loss_type, fp32_logits, monkeypatch):
    # The whole path a training step takes: a model's micro-batched response log-probs, their
    # masked sums (nanokl sums log-probs over the response for IPO too; TRL's "ipo" averages them),
    # the per-pair loss and its mean over pairs (two micro-batches accumulating). A step takes
    # both models' logits in fp32 (forwards.response_logits), which alone puts ~1e-6 on h (measured:
    # 2e-6 on an IPO loss of 1.8): so the update is checked to 1e-6 with float64 logits (the same
    # slicing, no cast) and to float32 rounding as trained. Reference: each row run alone,
    # unpadded, in float64, and the papers' gradient written out:
    #   ∇ (1/P) Σ_k ℓ(h_k) = (1/P) Σ_k ℓ'(h_k) (∇log π(y_w,k) − ∇log π(y_l,k)),
    #   ℓ' = −β σ(−β h) (DPO, Rafailov et al. eq. 7)  or  2 (h − 1/(2β)) (IPO, Azar et al. eq. 17).
    from types import SimpleNamespace
    from nanokl import dpo
    from nanokl.engine.batching import Batching
    from nanokl.forwards import compute_log_probs
    from test_workers import Recorder, rollout_batch, tiny

    beta, T = 0.3, 0.8
    ref = tiny().double().eval()
    batch, out = rollout_batch(ref, B=6, R=7)  # rows (2k, 2k+1) are pair k: 3 pairs
    P = out.prompt_length

    def token_log_probs(model, b):  # log π of each response token of row b: its own unpadded forward
        real = batch["attention_mask"][b].bool()
        seq = batch["sequences"][b][real]
        n_prompt = int(batch["attention_mask"][b, :P].sum())
        logits = model(seq[None])[0] / T
        return [logits[n_prompt + t - 1].log_softmax(-1)[seq[n_prompt + t]]
                for t in range(int(batch["response_mask"][b].sum()))]

    if fp32_logits:  # fp32, as the step computes them
        batch["ref_log_probs"], _ = compute_log_probs(ref, batch, T)
    else:  # float64 everywhere: response_logits' slicing without its fp32 cast, float64 reference log-probs
        def logits64(model, mb, temperature, packed=False, inputs=None):
            R = mb["responses"].shape[1]
            logits = model(mb["sequences"], mb["attention_mask"], mb["position_ids"], logits_to_keep=R + 1)
            return logits[:, :-1] / temperature
        monkeypatch.setattr(dpo, "response_logits", logits64)
        batch["ref_log_probs"] = torch.zeros(batch["response_mask"].shape, dtype=torch.float64)
        with torch.no_grad():
            for b in range(6):
                lps = token_log_probs(ref, b)
                batch["ref_log_probs"][b, :len(lps)] = torch.stack(lps) if lps else 0.0
    pol = tiny().double()
    with torch.no_grad():  # off π_ref, so that the pairs have different h and weights
        for p in pol.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype))
    opt = Recorder(pol.parameters())
    a = SimpleNamespace(objective={"sigmoid": "dpo", "ipo": "ipo"}[loss_type], ppo_epochs=1, grad_clip=1e9)
    m = dpo.update_policy(pol.train(), opt, batch, a, T, mini_size=6, spec=Batching(micro_size=2), beta=beta)
    params = list(pol.parameters())

    def seq_log_prob(model, b):  # log π(y) of row b: a python sum over its tokens
        return sum(token_log_probs(model, b))

    want_loss, want_grad = 0.0, [torch.zeros_like(p) for p in params]
    for chosen, rejected in zip(*split_pairs(range(6))):  # pair k: rows (2k, 2k+1)
        with torch.no_grad():
            r_w, r_l = (float(seq_log_prob(ref, b)) for b in (chosen, rejected))
        lp_w, lp_l = seq_log_prob(pol, chosen), seq_log_prob(pol, rejected)
        h = (lp_w.item() - r_w) - (lp_l.item() - r_l)
        if loss_type == "sigmoid":
            want_loss += stable_neg_log_sigmoid(beta * h) / 3
            dh = -beta * sigmoid(-beta * h)
        else:
            want_loss += (h - 1 / (2 * beta)) ** 2 / 3
            dh = 2 * (h - 1 / (2 * beta))
        g_w = torch.autograd.grad(lp_w, params)
        g_l = torch.autograd.grad(lp_l, params)
        for acc, gw, gl in zip(want_grad, g_w, g_l):
            acc += dh * (gw - gl) / 3
    tol = 2e-5 if fp32_logits else 1e-6  # the logged loss is a float32 metric either way
    assert m["actor/dpo_loss"][0] == pytest.approx(want_loss, abs=tol)
    scale = max(float(g.abs().max()) for g in want_grad)
    assert scale > 1e-3  # the gradient is not trivially zero: the test can fail
    assert max(float((g - w).abs().max()) for g, w in zip(opt.seen, want_grad)) <= tol * max(1.0, scale)

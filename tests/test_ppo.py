"""Tests for nanokl/ppo.py's policy losses: the dual-clip policy loss branch by branch, GSPO and CISPO
(POLICY_LOSSES), and the actor's full micro-batch loss, also with NaN/±inf under the mask. The value
loss, the four aggregation modes, entropy and log-probs are tests/test_loss_agg.py.

How the tests prove it. The policy loss equals a per-token python reference written branch by
branch, on inputs built to hit every clip branch (each branch asserted hit), reduced by the
python-loop aggregation of tests/test_loss_agg.py; the three metrics equal their definitions; the
gradient in the unclipped region equals −A·ρ per token (token-mean times the token count) and is 0
where clipped.

Masks hold for gradients too (tests/poison.py). NaN, +inf, −inf or a mix of them are planted
under the mask in every input of every policy loss (log_prob, old_log_prob, advantages, is_weights;
the entropy and KL matrices of the actor's full loss), one input at a time and all at once, for
every loss_agg_mode, with and without is_weights and global_norm/horizon, for bool/int/float
masks. Then (1) the loss and metrics are torch.equal to those with finite numbers there, (2) every
gradient is finite and torch.equal to the finite version's, (3) the gradient under the mask is
exactly 0. Against the code before the inputs were selected, the policy and actor tests fail
(0·inf = NaN in the backward).

GSPO and CISPO (POLICY_LOSSES, one signature) equal float64 loops written from verl's formulas at
b178a3c: GSPO's sequence ratio s_i = exp(min(mean_t log ρ_it, 10)), its clip, its per-token
gradient −A·s_i where the unclipped term wins (0 where clipped or where log s_i > 10), equal to the
gradient of the sequence-level objective when A is constant per row; CISPO's −clip(ρ)·A·log π and
its gradient −clip(ρ)·A at every token. Loss, metrics and the gradients with respect to log_prob,
advantages and is_weights (old_log_prob gets none) in every allowed loss_agg_mode, with
global_norm, with rows that hit every branch; and the same poisoned-mask checks as above.
"""

import itertools
import math

import pytest
import torch

from nanokl.ppo import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    agg_loss,
    compute_policy_loss,
    compute_policy_loss_cispo,
    compute_policy_loss_gspo,
)
from nanokl.kl import kl_penalty
from nanokl.masked import zero_masked
from poison import POISONS, assert_mask_holds
from test_loss_agg import NORMS, python_agg

EPS_LOW, EPS_HIGH, CLIP_C = 0.2, 0.28, 3.0


def policy_token_reference(a, log_ratio):
    """One token's loss and the branch it took, written case by case (PPO paper + dual clip)."""
    r = math.exp(min(max(log_ratio, -20.0), 20.0))
    if a > 0:
        if r > 1 + EPS_HIGH:
            return -a * (1 + EPS_HIGH), "pos_clipped"
        return -a * r, "pos_unclipped"
    if a < 0:
        if r < 1 - EPS_LOW:
            return -a * (1 - EPS_LOW), "neg_clipped"
        if r > CLIP_C:
            return -a * CLIP_C, "neg_dual_clipped"
        return -a * r, "neg_unclipped"
    return 0.0, "zero_adv"


def policy_inputs():
    """Rows 0-1 are hand-built to hit each branch; rows 2-3 are random; row 3 is padded with
    garbage that must not matter."""
    cases = [  # (advantage, log ratio)
        (1.0, math.log(1.5)), (0.7, math.log(0.5)), (2.0, math.log(1.1)), (1.3, 30.0),
        (-1.0, math.log(0.5)), (-0.5, math.log(1.1)), (-2.0, math.log(2.0)), (-1.5, math.log(5.0)),
        (-0.8, 30.0), (-1.1, -30.0), (0.0, math.log(2.0)), (0.4, -30.0),
    ]
    adv = torch.randn(4, 6, dtype=torch.float64)
    log_ratio = torch.randn(4, 6, dtype=torch.float64) * 0.4
    for k, (a, lr) in enumerate(cases):
        adv[k // 6, k % 6], log_ratio[k // 6, k % 6] = a, lr
    mask = torch.ones(4, 6, dtype=torch.float64)
    mask[3, 3:] = 0.0
    adv[3, 3:], log_ratio[3, 3:] = -50.0, 10.0
    old = -torch.rand(4, 6, dtype=torch.float64) * 3
    return old, old + log_ratio, adv, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_policy_loss_matches_branchwise_reference(mode):
    old, new, adv, mask = policy_inputs()
    loss, metrics = compute_policy_loss(old, new, adv, mask, EPS_LOW, EPS_HIGH, CLIP_C, mode)
    rows, branches, lr_all = [], [], []
    for i in range(4):
        row = []
        for t in range(6):
            lr = new[i, t].item() - old[i, t].item()
            l, b = policy_token_reference(adv[i, t].item(), lr)
            row.append(l)
            if mask[i, t] > 0:
                branches.append(b)
                lr_all.append(min(max(lr, -20.0), 20.0))
        rows.append(row)
    for b in ("pos_clipped", "pos_unclipped", "neg_clipped", "neg_dual_clipped", "neg_unclipped", "zero_adv"):
        assert b in branches, b
    assert loss.item() == pytest.approx(python_agg(rows, mask.tolist(), mode), rel=1e-12)

    n = len(branches)
    assert metrics["pg_clipfrac"].item() == pytest.approx(
        sum(b in ("pos_clipped", "neg_clipped") for b in branches) / n, rel=1e-12)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(branches.count("neg_dual_clipped") / n, rel=1e-12)
    assert metrics["ppo_kl"].item() == pytest.approx(-sum(lr_all) / n, rel=1e-12)
    for v in metrics.values():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad


def test_policy_gradient_per_token():
    """token-mean loss × token count = Σ per-token losses, so its gradient is per token:
    −A·ρ where unclipped (d(−Aρ)/dlogπ = −Aρ), 0 where clipped, dual-clipped, padded, or
    where the log-ratio clamp at ±20 is saturated."""
    old, new, adv, mask = policy_inputs()
    new.requires_grad_(True)
    loss, _ = compute_policy_loss(old, new, adv, mask, EPS_LOW, EPS_HIGH, CLIP_C, "token-mean")
    (grad,) = torch.autograd.grad(loss * mask.sum(), new)
    live = 0
    for i in range(4):
        for t in range(6):
            lr = new[i, t].item() - old[i, t].item()
            a = adv[i, t].item()
            _, b = policy_token_reference(a, lr)
            if mask[i, t] == 0 or b not in ("pos_unclipped", "neg_unclipped") or abs(lr) > 20:
                want = 0.0
            else:
                want = -a * math.exp(lr)
                live += 1
            assert grad[i, t].item() == pytest.approx(want, rel=1e-12, abs=1e-300)
    assert live >= 5  # the check covered real unclipped tokens, not only zeros


def test_policy_loss_rejects_bad_dual_clip():
    old, new, adv, mask = policy_inputs()
    with pytest.raises(ValueError):
        compute_policy_loss(old, new, adv, mask, 0.2, 0.2, clip_ratio_c=1.0)


def poison_inputs():
    """policy_inputs() plus an empty row, a hole in a random row and is_weights; rows 0-1 still hit
    every clip branch (the dual clip included) at real tokens."""
    old, new, adv, mask = policy_inputs()
    w = torch.rand(4, 6, dtype=torch.float64) * 2
    pad = lambda t, fill: torch.cat([t, torch.full((1, 6), fill, dtype=t.dtype)])  # noqa: E731
    old, new, adv, w, mask = pad(old, -1.0), pad(new, -1.0), pad(adv, 0.5), pad(w, 1.0), pad(mask, 0.0)
    mask[2, 1] = 0.0
    return old, new, adv, w, mask


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_policy_loss_value_and_gradient_ignore_non_finite_masked_inputs(mode, poison):
    """NaN/±inf at masked entries of log_prob, old_log_prob, advantages, is_weights (one at a time
    and all together), with and without is_weights and global_norm/horizon, for bool/int/float
    masks: loss, metrics and all four gradients equal those of finite numbers there; the gradients
    are finite and exactly 0 under the mask. compute_policy_loss selects its inputs first, so
    no 0 from the mask ever meets an inf in the backward (exp, −A·ρ, the clips, the weight)."""
    old, new, adv, w, mask = poison_inputs()
    for m in (mask, mask.bool(), mask.long()):
        for weighted, norms in itertools.product((False, True), NORMS):
            def fn(old_log_prob, log_prob, advantages, is_weights=None):
                return compute_policy_loss(old_log_prob, log_prob, advantages, m, EPS_LOW, EPS_HIGH, CLIP_C, mode,
                                           is_weights=is_weights, **norms)
            inputs = {"old_log_prob": old, "log_prob": new, "advantages": adv}
            if weighted:
                inputs["is_weights"] = w
            for targets in (None, *([k] for k in inputs)):
                grads = assert_mask_holds(fn, inputs, m, poison, targets)
            assert (grads["log_prob"][mask > 0] != 0).any() and (grads["advantages"][mask > 0] != 0).any()


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_actor_loss_with_entropy_bonus_and_kl_loss_ignores_non_finite_masked_inputs(mode, poison):
    """The actor's micro-batch loss as nanokl/workers.py builds it: policy loss − c_H·agg_loss(entropy)
    + c_KL·agg_loss(w·kl_penalty(log_prob, ref_log_prob)), with every input poisoned under the mask
    (the entropy matrix too): value and gradients are those of finite numbers there."""
    old, new, adv, w, mask = poison_inputs()
    ent = torch.rand(5, 6, dtype=torch.float64) * 2
    ref = new - torch.randn(5, 6, dtype=torch.float64) * 0.3
    w = zero_masked(w, mask)  # truncated_is_weights returns 0 under the mask
    for kind in ("k1", "k2", "k3", "abs", "k3+", "low_var_kl+"):
        def fn(old_log_prob, log_prob, advantages, entropy, ref_log_prob):
            pg, metrics = compute_policy_loss(old_log_prob, log_prob, advantages, mask, EPS_LOW, EPS_HIGH, CLIP_C,
                                              mode, is_weights=w)
            kl = agg_loss(w * kl_penalty(log_prob, ref_log_prob, kind), mask, mode)
            return pg - 0.01 * agg_loss(entropy, mask, mode) + 0.1 * kl, metrics
        inputs = {"old_log_prob": old, "log_prob": new, "advantages": adv, "entropy": ent, "ref_log_prob": ref}
        assert_mask_holds(fn, inputs, mask, poison)


# ---- GSPO and CISPO: loops written from verl's formulas (b178a3c), float64 ----------------------

def agg_weight(mode, n_i, n_tok, n_seq, horizon, global_norm=None):
    """d loss / d loss_mat[i, t] of each aggregation mode, from its definition."""
    if mode == "token-mean":
        return 1 / (global_norm or n_tok)
    per_seq = {"seq-mean-token-sum": 1.0, "seq-mean-token-mean": 1 / n_i, "seq-mean-token-sum-norm": 1 / horizon}
    return per_seq[mode] / (global_norm or n_seq)


def gspo_inputs(empty_row=True):
    """Rows whose mean log-ratio is chosen: s above the band, below it, inside, log s > 10 (the clamp),
    log s = −30 (no lower clamp), random; per-token advantages of both signs; an empty row; holes."""
    g = torch.Generator().manual_seed(7)
    targets = [math.log(1.6), math.log(0.6), math.log(1.05), 12.0, -30.0, 0.15]
    B, T = len(targets) + int(empty_row), 7
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    noise = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 5:], mask[2, 1], mask[5, 3:] = False, False, False
    if empty_row:
        mask[-1] = False
    for i, target in enumerate(targets):  # shift row i so that its mean over real tokens is the target
        real = noise[i][mask[i]]
        noise[i] += target - real.mean()
    w = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    return old, old + noise, adv, w, mask


def gspo_reference(old, new, adv, mask, w=None, global_norm=None):
    """(loss, d/d log_prob, d/d advantages, branches) from GSPO's definition, row by row."""
    B, T = mask.shape
    n_seq = global_norm or B
    loss, g_lp, g_a, branches = 0.0, torch.zeros(B, T, dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64), []
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t]]
        if not toks:
            continue
        mean_lr = sum(new[i, t].item() - old[i, t].item() for t in toks) / len(toks)
        s = math.exp(min(mean_lr, 10.0))
        clip_s = min(max(s, 1 - EPS_LOW), 1 + EPS_HIGH)
        for t in toks:
            a, wt = adv[i, t].item(), 1.0 if w is None else w[i, t].item()
            f = wt / (len(toks) * n_seq)
            unclipped, clipped = -a * s, -a * clip_s
            loss += f * max(unclipped, clipped)
            if clipped > unclipped:  # constant in θ
                branches.append("clipped")
                g_a[i, t] = -f * clip_s
            else:  # d s_it / d log π_θ(y_it) = s_i, unless log s_i sits on the clamp
                branches.append("unclipped" if mean_lr < 10 else "clamped")
                g_lp[i, t] = -f * a * s if mean_lr < 10 else 0.0
                g_a[i, t] = -f * s
    return loss, g_lp, g_a, branches


def grads_of(fn, **inputs):
    leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
    loss, metrics = fn(**leaves)
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return loss, metrics, dict(zip(leaves, grads))


def test_policy_losses_share_one_signature():
    import inspect
    names = [list(inspect.signature(f).parameters) for f in POLICY_LOSSES.values()]
    assert names[0] == ["old_log_prob", "log_prob", "advantages", "response_mask", "clip_ratio_low", "clip_ratio_high",
                        "clip_ratio_c", "loss_agg_mode", "global_norm", "horizon", "is_weights"]
    assert all(n == names[0] for n in names)
    assert POLICY_LOSSES["vanilla"] is compute_policy_loss


@pytest.mark.parametrize("global_norm", [None, 37.0])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("empty_row", [False, True])
def test_gspo_loss_metrics_and_gradients_equal_a_float64_loop(weighted, global_norm, empty_row):
    old, new, adv, w, mask = gspo_inputs(empty_row)
    w = w if weighted else None

    def fn(log_prob, advantages, old_log_prob):
        return compute_policy_loss_gspo(old_log_prob, log_prob, advantages, mask, EPS_LOW, EPS_HIGH, CLIP_C,
                                        "seq-mean-token-mean", global_norm=global_norm, is_weights=w)
    loss, metrics, grads = grads_of(fn, log_prob=new, advantages=adv, old_log_prob=old)
    want, g_lp, g_a, branches = gspo_reference(old, new, adv, mask, w, global_norm)
    assert {"clipped", "unclipped", "clamped"} <= set(branches)
    assert loss.item() == pytest.approx(want, rel=1e-12)
    torch.testing.assert_close(grads["log_prob"], g_lp, rtol=1e-12, atol=1e-300)
    torch.testing.assert_close(grads["advantages"], g_a, rtol=1e-12, atol=1e-300)
    assert grads["old_log_prob"] is None  # old_log_prob enters only through sg[s_i]
    real = [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    assert metrics["pg_clipfrac"].item() == pytest.approx(branches.count("clipped") / len(real), rel=1e-12)
    assert metrics["pg_clipfrac_lower"].item() == 0.0
    kl = -sum(new[i, t].item() - old[i, t].item() for i, t in real) / len(real)  # unclamped, as verl's
    assert metrics["ppo_kl"].item() == pytest.approx(kl, rel=1e-12)
    for v in metrics.values():
        assert v.dim() == 0 and not v.requires_grad


def test_gspo_token_gradient_is_the_sequence_objectives_gradient():
    """With one advantage per response (GRPO's), verl's token-level trick gives the gradient of
    the sequence objective mean_i max(−A_i s_i, −A_i clip(s_i)), s_i = exp(mean_t log ρ_it)."""
    old, new, adv, _, mask = gspo_inputs()
    adv = adv[:, :1].expand_as(adv).clone()
    keep = torch.tensor([0, 1, 2, 5, 6])  # the rows without the log s clamp
    old, new, adv, mask = old[keep], new[keep], adv[keep], mask[keep]
    lp = new.clone().requires_grad_(True)
    loss, _ = compute_policy_loss_gspo(old, lp, adv, mask, EPS_LOW, EPS_HIGH)
    (g,) = torch.autograd.grad(loss, lp)
    lp2 = new.clone().requires_grad_(True)
    n = mask.sum(-1).clamp(min=1)
    s = torch.exp(torch.where(mask, lp2 - old, 0.0).sum(-1) / n)
    a = adv[:, 0]
    seq = torch.maximum(-a * s, -a * s.clamp(1 - EPS_LOW, 1 + EPS_HIGH))
    (g_ref,) = torch.autograd.grad(torch.where(mask.any(-1), seq, 0.0).mean(), lp2)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-300)
    assert (g[mask] != 0).any()
    assert torch.allclose(loss, torch.where(mask.any(-1), seq, 0.0).mean().detach(), rtol=1e-12)


@pytest.mark.parametrize("mode", [m for m in LOSS_AGG_MODES if m != "seq-mean-token-mean"])
def test_gspo_refuses_other_aggregations(mode):
    old, new, adv, _, mask = gspo_inputs()
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        compute_policy_loss_gspo(old, new, adv, mask, EPS_LOW, EPS_HIGH, CLIP_C, mode)


@pytest.mark.parametrize("norms", NORMS)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_cispo_loss_metrics_and_gradients_equal_a_float64_loop(mode, weighted, norms):
    old, new, adv, w, mask = poison_inputs()  # ρ far outside the band both ways, an empty row, a hole
    w = w if weighted else None

    def fn(log_prob, advantages, old_log_prob):
        return compute_policy_loss_cispo(old_log_prob, log_prob, advantages, mask, EPS_LOW, EPS_HIGH, CLIP_C, mode,
                                         is_weights=w, **norms)
    loss, metrics, grads = grads_of(fn, log_prob=new, advantages=adv, old_log_prob=old)
    B, T = mask.shape
    n_tok = int(mask.sum())
    want, clipped, kl = 0.0, 0, 0.0
    g_lp, g_a = torch.zeros(B, T, dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        n_i = int(mask[i].sum())
        for t in range(T):
            if not mask[i, t]:
                continue
            lp, a = new[i, t].item(), adv[i, t].item()
            lr = min(max(lp - old[i, t].item(), -20.0), 20.0)
            rho = math.exp(lr)
            c = min(max(rho, 1 - EPS_LOW), 1 + EPS_HIGH)
            f = agg_weight(mode, n_i, n_tok, B, norms.get("horizon", T), norms.get("global_norm"))
            f *= 1.0 if w is None else w[i, t].item()
            want += f * (-c * a * lp)
            g_lp[i, t], g_a[i, t] = -f * c * a, -f * c * lp  # the clipped weight is a constant
            clipped += rho != c
            kl -= lr
    assert 0 < clipped < n_tok
    assert loss.item() == pytest.approx(want, rel=1e-12)
    torch.testing.assert_close(grads["log_prob"], g_lp, rtol=1e-12, atol=1e-300)
    torch.testing.assert_close(grads["advantages"], g_a, rtol=1e-12, atol=1e-300)
    assert grads["old_log_prob"] is None
    assert metrics["pg_clipfrac"].item() == pytest.approx(clipped / n_tok, rel=1e-12)
    assert metrics["pg_clipfrac_lower"].item() == 0.0
    assert metrics["ppo_kl"].item() == pytest.approx(kl / n_tok, rel=1e-12)


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("name,mode", [("gspo", "seq-mean-token-mean")] + [("cispo", m) for m in LOSS_AGG_MODES])
def test_gspo_and_cispo_ignore_non_finite_masked_inputs(name, mode, poison):
    """As for the vanilla loss: NaN/±inf under the mask in each input and in all of them, for
    bool/int/float masks, with and without is_weights and global_norm/horizon: loss, metrics and
    gradients equal those of finite numbers there, finite, 0 under the mask."""
    old, new, adv, w, mask = poison_inputs()
    for m in (mask, mask.bool(), mask.long()):
        for weighted, norms in itertools.product((False, True), NORMS):
            def fn(old_log_prob, log_prob, advantages, is_weights=None):
                loss, metrics = POLICY_LOSSES[name](old_log_prob, log_prob, advantages, m, EPS_LOW, EPS_HIGH, CLIP_C,
                                                    mode, is_weights=is_weights, **norms)
                # old_log_prob gets no gradient from these losses (it enters only detached): tie it
                # to the graph with an exact 0, so the helper can check that gradient too
                return loss + 0.0 * zero_masked(old_log_prob, m).sum(), metrics
            inputs = {"old_log_prob": old, "log_prob": new, "advantages": adv}
            if weighted:
                inputs["is_weights"] = w
            for targets in (None, *([k] for k in inputs)):
                grads = assert_mask_holds(fn, inputs, m, poison, targets)
            assert (grads["log_prob"][mask > 0] != 0).any() and (grads["advantages"][mask > 0] != 0).any()
            assert (grads["old_log_prob"] == 0).all()

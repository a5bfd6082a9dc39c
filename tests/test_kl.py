"""Tests for nanokl/kl.py: every estimator against an independent float64 formula, the
statistics of k1/k2/k3 by Monte Carlo against an exact KL, the straight-through forms, and the
exact `full` KL's value, gradient and precision (its micro-batched use: tests/test_workers.py).

How the tests prove it. Each kind equals an independent float64 per-element formula (python
`math`) on random inputs that include padding zeros and |Δ| up to 50, and its forward and
backward are finite. A Monte Carlo check draws tokens from a random categorical π with a known
exact KL: the sample means of k1 and k3 land within 4 standard errors of the exact sum, k3 is
never negative, and Var(k3) < Var(k1) when π ≈ π_ref; k2's exact bias matches ⅙E_π[Δ³] as the
divergence shrinks and its Monte Carlo mean sits many standard errors away from the KL when it
is large. `full` equals the explicit sum and torch.nn.functional.kl_div, its gradient with
respect to the policy logits is the analytic π(v)·(Δ(v) − KL), and bf16 logits are summed in
float32 (tests/test_workers.py checks the micro-batched `full`, value and gradient, against
kl_div). The "+" forms have the base value and k2's gradient with respect to both logprob and
ref_logprob. As a loss (agg_loss of kl_penalty, every sampled-token kind and loss_agg_mode),
NaN/±inf under the mask in logprob, ref_logprob or both leave the loss and both gradients those
of finite numbers there, finite and exactly 0 under the mask (tests/poison.py); unmasked, a
non-finite Δ keeps its non-finite value (k3: its clamp) and gets a zero gradient.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from nanokl.kl import KL_KINDS, kl_penalty
from nanokl.ppo import LOSS_AGG_MODES, agg_loss
from poison import POISONS, assert_mask_holds

BASE_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
PLUS_KINDS = ("kl+", "k1+", "abs+", "low_var_kl+", "k3+")


def naive_value(lp, ref, kind):
    """Per-element float64 value written from the formulas in Schulman's note."""
    d = lp - ref
    base = kind.rstrip("+")
    if base in ("kl", "k1"):
        return d
    if base == "abs":
        return abs(d)
    if base in ("mse", "k2"):
        return 0.5 * d * d
    x = min(max(ref - lp, -20.0), 20.0)  # log r, clamped as documented
    return min(max(math.exp(x) - x - 1.0, -10.0), 10.0)


def naive_grads(lp, ref, kind):
    """(d/d logprob, d/d ref_logprob) per element; '+' kinds take k2's derivative."""
    d = lp - ref
    base = kind.rstrip("+")
    if kind.endswith("+") or base in ("mse", "k2"):
        return d, -d
    if base in ("kl", "k1"):
        return 1.0, -1.0
    if base == "abs":
        s = (d > 0) - (d < 0)
        return float(s), float(-s)
    x = ref - lp
    if not -20.0 <= x <= 20.0:
        return 0.0, 0.0  # the input clamp is saturated
    v = math.exp(x) - x - 1.0
    if not -10.0 <= v <= 10.0:
        return 0.0, 0.0  # the output clamp is saturated
    dv_dx = math.exp(x) - 1.0
    return -dv_dx, dv_dx


def extreme_inputs(dtype=torch.float64):
    """[4, 16] log-probs: random values, right padding (zeros), |Δ| up to 50, and two beyond
    (|Δ| = 100, 1000) where an unclamped exp overflows in float32 / float64: without the
    clamp of log r to [−20, 20] the value would still clamp to 10 but the gradient of the
    overflowing exp would be 0·inf = NaN."""
    lp = -torch.rand(4, 16, dtype=torch.float64) * 6
    ref = -torch.rand(4, 16, dtype=torch.float64) * 6
    deltas = [50.0, -50.0, 30.0, -30.0, 19.9, -19.9, 3.0, -3.0, 1e-3, -1e-3, 100.0, -100.0, 1000.0, -1000.0]
    for j, d in enumerate(deltas):  # row 0 holds the extremes
        lp[0, j], ref[0, j] = (-1.0, -1.0 - d) if d > 0 else (-1.0 + d, -1.0)
    lp[1, 10:] = 0.0  # padding: both log-probs zero, Δ = 0
    ref[1, 10:] = 0.0
    lp[2, 5] = ref[2, 5]  # an exact tie inside a row
    return lp.to(dtype), ref.to(dtype)


@pytest.mark.parametrize("kind", BASE_KINDS + PLUS_KINDS)
def test_value_and_grad_match_naive_float64(kind):
    lp, ref = extreme_inputs()
    lp.requires_grad_(True)
    ref.requires_grad_(True)
    out = kl_penalty(lp, ref, kind)
    w = torch.rand_like(out)  # random weights make every per-element gradient visible
    (out * w).sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(lp.grad).all() and torch.isfinite(ref.grad).all()
    for i in range(lp.shape[0]):
        for j in range(lp.shape[1]):
            a, b = lp[i, j].item(), ref[i, j].item()
            assert out[i, j].item() == pytest.approx(naive_value(a, b, kind), rel=1e-12, abs=1e-12)
            g_lp, g_ref = naive_grads(a, b, kind)
            wij = w[i, j].item()
            assert lp.grad[i, j].item() == pytest.approx(wij * g_lp, rel=1e-9, abs=1e-12)
            assert ref.grad[i, j].item() == pytest.approx(wij * g_ref, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("kind", BASE_KINDS + PLUS_KINDS)
def test_float32_finite_and_accurate(kind):
    """In float32 every kind stays finite on |Δ| = 50, and matches float64 closely. For k3
    near Δ = 0 the expm1 form keeps the small values accurate (exp(x) − 1 − x would not)."""
    lp, ref = extreme_inputs(torch.float32)
    lp.requires_grad_(True)
    ref.requires_grad_(True)
    out = kl_penalty(lp, ref, kind)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(lp.grad).all() and torch.isfinite(ref.grad).all()
    exact = kl_penalty(lp.detach().double(), ref.detach().double(), kind)
    # float32 rounding of values up to 1250 (k2 at Δ=50) and 10 (k3 clamp)
    torch.testing.assert_close(out.double(), exact, rtol=2e-6, atol=1e-6)
    if kind.startswith(("k3", "low_var")):
        small = (lp - ref).detach().abs() < 1e-2
        assert small.any()
        rel_err = ((out.double() - exact).abs() / exact.clamp(min=1e-30))[small & (exact > 0)]
        assert rel_err.max() < 1e-2


def test_kl_kinds_and_unknown_kind():
    assert set(KL_KINDS) == set(BASE_KINDS + PLUS_KINDS + ("full",))
    lp, ref = torch.zeros(3), torch.zeros(3)
    with pytest.raises(ValueError) as err:
        kl_penalty(lp, ref, "k4")
    for name in KL_KINDS:
        assert name in str(err.value)
    with pytest.raises(ValueError):
        kl_penalty(lp, ref, "k2+")  # k2 already has k2's gradient; not a kind
    with pytest.raises(ValueError):
        kl_penalty(None, None, "full")  # needs logits


def test_full_equals_explicit_sum_and_kl_div():
    logits = torch.randn(2, 3, 7, dtype=torch.float64) * 2
    ref_logits = torch.randn(2, 3, 7, dtype=torch.float64) * 2
    out = kl_penalty(None, None, "full", logits=logits, ref_logits=ref_logits)
    assert out.shape == (2, 3)
    for i in range(2):
        for t in range(3):
            z, zr = logits[i, t].tolist(), ref_logits[i, t].tolist()
            lse = math.log(sum(math.exp(v) for v in z))
            lse_r = math.log(sum(math.exp(v) for v in zr))
            exact = sum(math.exp(a - lse) * ((a - lse) - (b - lse_r)) for a, b in zip(z, zr))
            assert out[i, t].item() == pytest.approx(exact, rel=1e-10)
    # kl_div(input, target) = Σ target·(log target − input): KL(π‖π_ref) with target = log π
    ref_kl = F.kl_div(F.log_softmax(ref_logits, -1), F.log_softmax(logits, -1),
                      reduction="none", log_target=True).sum(-1)
    torch.testing.assert_close(out, ref_kl, rtol=1e-10, atol=1e-12)


def test_full_gradient_is_analytic_and_runs_in_float32():
    """∂KL/∂z_v = π(v)·(Δ(v) − KL) with Δ = log π − log π_ref (from ∂log π(u)/∂z_v = δ_uv − π(v)):
    the exact gradient of the KL as a loss, through the policy's logits. bf16 logits (the LM head
    under autocast) are promoted: the sum runs in float32 and matches float64 closely."""
    logits = (torch.randn(3, 4, 11, dtype=torch.float64) * 2).requires_grad_(True)
    ref_logits = torch.randn(3, 4, 11, dtype=torch.float64) * 2
    out = kl_penalty(None, None, "full", logits=logits, ref_logits=ref_logits)
    w = torch.rand_like(out)
    (grad,) = torch.autograd.grad((out * w).sum(), logits)
    logp, ref_logp = F.log_softmax(logits.detach(), -1), F.log_softmax(ref_logits, -1)
    delta = logp - ref_logp
    expected = w[..., None] * logp.exp() * (delta - out.detach()[..., None])
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-13)

    low = kl_penalty(None, None, "full", logits=logits.detach().bfloat16(), ref_logits=ref_logits.bfloat16())
    assert low.dtype == torch.float32
    exact = kl_penalty(None, None, "full", logits=logits.detach().bfloat16().double(),
                       ref_logits=ref_logits.bfloat16().double())
    torch.testing.assert_close(low.double(), exact, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", PLUS_KINDS)
def test_straight_through_value_is_base_grad_is_k2(kind):
    lp, ref = extreme_inputs()
    lp.requires_grad_(True)
    ref.requires_grad_(True)
    out = kl_penalty(lp, ref, kind)
    assert torch.equal(out.detach(), kl_penalty(lp.detach(), ref.detach(), kind[:-1]))
    w = torch.rand_like(out)
    g_lp, g_ref = torch.autograd.grad((out * w).sum(), (lp, ref))
    k2 = kl_penalty(lp, ref, "k2")
    k2_lp, k2_ref = torch.autograd.grad((k2 * w).sum(), (lp, ref))
    torch.testing.assert_close(g_lp, k2_lp, rtol=0, atol=0)
    torch.testing.assert_close(g_ref, k2_ref, rtol=0, atol=0)
    delta = (lp - ref).detach()
    torch.testing.assert_close(g_lp, w * delta)  # d(½Δ²)/dlogp = Δ
    torch.testing.assert_close(g_ref, -w * delta)


# --------------------------------------------------------------------------------------
# Monte Carlo: the estimators' statistics against an exact KL over a small vocabulary.
# --------------------------------------------------------------------------------------

def _categorical_pair(scale, vocab=12, gen=None):
    z = torch.randn(vocab, dtype=torch.float64, generator=gen) * 1.5
    u = torch.randn(vocab, dtype=torch.float64, generator=gen)
    return F.log_softmax(z, -1), F.log_softmax(z + scale * u, -1)


def test_monte_carlo_k1_k3_unbiased_k3_nonnegative():
    """Sample N tokens from π: the sample means of k1 and k3 are within 4 standard errors of
    the exact KL = Σ_v π(v)(log π(v) − log π_ref(v)); k3 is ≥ 0 on every sample."""
    logp, ref_logp = _categorical_pair(scale=1.5)
    exact_kl = (logp.exp() * (logp - ref_logp)).sum().item()
    assert exact_kl > 0.3  # a large divergence, where k1 is noisy
    x = torch.multinomial(logp.exp(), 200_000, replacement=True)
    for kind in ("k1", "k3"):
        s = kl_penalty(logp[x], ref_logp[x], kind)
        se = s.std().item() / math.sqrt(s.numel())
        assert abs(s.mean().item() - exact_kl) < 4 * se, kind
    assert (kl_penalty(logp[x], ref_logp[x], "k3") >= 0).all()
    assert (kl_penalty(logp, ref_logp, "k3") >= 0).all()  # every vocabulary entry, not just samples


def test_k3_has_lower_variance_when_close():
    """When π ≈ π_ref, Var(k1) = O(ε²) but Var(k3) = O(ε⁴): checked exactly (sums over the
    vocabulary) and on the Monte Carlo samples."""
    logp, ref_logp = _categorical_pair(scale=0.1)
    p = logp.exp()
    k1 = kl_penalty(logp, ref_logp, "k1")
    k3 = kl_penalty(logp, ref_logp, "k3")
    var_k1 = (p * k1**2).sum() - (p * k1).sum() ** 2
    var_k3 = (p * k3**2).sum() - (p * k3).sum() ** 2
    assert var_k3 < 0.1 * var_k1
    x = torch.multinomial(p, 50_000, replacement=True)
    assert k3[x].var() < k1[x].var()


def test_k2_bias_is_third_order_and_large_when_far():
    """k2 = ½Δ² is the f-divergence with f(r) = ½(log r)², equal to KL only to second order.
    From Σ_v π_ref(v) = E_π[e^{−Δ}] = 1, expanding e^{−Δ} gives
        E_π[k2] − KL = ½E[Δ²] − E[Δ] = ⅙E_π[Δ³] + O(Δ⁴).
    Check 1 (exact sums): as the divergence ε shrinks, bias / (⅙E[Δ³]) → 1 with an error that
    halves each time ε halves (the O(Δ⁴) remainder), below 2% at ε = 0.01, while KL ~ ε²:
    the bias is exactly the predicted third-order term.
    Check 2 (Monte Carlo, large divergence): the k2 sample mean is within 4 SE of the exact
    E_π[½Δ²] but more than 20 SE away from the KL, so the bias is real and measurable."""
    ratios = []
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(12, dtype=torch.float64, generator=gen) * 1.5
    u = torch.randn(12, dtype=torch.float64, generator=gen)
    for eps in (0.16, 0.08, 0.04, 0.02, 0.01):
        logp, ref_logp = F.log_softmax(z, -1), F.log_softmax(z + eps * u, -1)
        p, d = logp.exp(), logp - ref_logp
        kl = (p * d).sum()
        bias = (p * 0.5 * d**2).sum() - kl
        ratios.append((bias / ((p * d**3).sum() / 6)).item())
    errs = [abs(r - 1) for r in ratios]
    assert all(1.6 < a / b < 2.5 for a, b in zip(errs, errs[1:])), ratios
    assert errs[-1] < 0.02, ratios

    logp, ref_logp = _categorical_pair(scale=1.5)
    p = logp.exp()
    exact_kl = (p * (logp - ref_logp)).sum().item()
    exact_k2 = (p * 0.5 * (logp - ref_logp) ** 2).sum().item()
    x = torch.multinomial(p, 200_000, replacement=True)
    s = kl_penalty(logp[x], ref_logp[x], "k2")
    se = s.std().item() / math.sqrt(s.numel())
    assert abs(s.mean().item() - exact_k2) < 4 * se
    assert abs(s.mean().item() - exact_kl) > 20 * se


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_kl_loss_gradient_ignores_non_finite_masked_log_probs(mode, poison):
    """The KL as a loss, agg_loss(kl_penalty(logprob, ref_logprob, kind), mask, mode), for every
    sampled-token kind, with NaN/±inf at masked entries of logprob, ref_logprob or both: the loss
    and both gradients equal those of finite numbers there, finite and exactly 0 under the mask.
    agg_loss sends a 0 back to a masked entry; k2 and abs give a non-finite Δ no gradient path,
    so that 0 never meets Δ = inf or sign(NaN); k1's derivative is ±1 and k3's clamps are
    selects, so neither multiplies by anything non-finite."""
    lp, ref = extreme_inputs()
    mask = torch.ones(4, 16, dtype=torch.float64)
    mask[1, 10:], mask[2, 3], mask[3] = 0.0, 0.0, 0.0
    inputs = {"logprob": lp, "ref_logprob": ref}
    for kind in BASE_KINDS + PLUS_KINDS:
        for m in (mask, mask.bool()):
            def fn(logprob, ref_logprob):
                return agg_loss(kl_penalty(logprob, ref_logprob, kind), m, mode)
            for targets in (None, ["logprob"], ["ref_logprob"]):
                grads = assert_mask_holds(fn, inputs, m, poison, targets)
            assert (grads["logprob"][mask > 0] != 0).any(), kind


def test_non_finite_delta_keeps_its_value_and_has_no_gradient():
    """Unmasked, a non-finite Δ still shows in the value (inf, or NaN for inf − inf) of every kind
    but k3 (which clamps it to 10), and gets a zero gradient; finite Δ are untouched."""
    inf, nan = math.inf, math.nan
    lp = torch.tensor([-inf, 0.0, -inf, nan, -1.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([0.0, -inf, -inf, 0.0, -2.0], dtype=torch.float64, requires_grad=True)
    for kind in BASE_KINDS + PLUS_KINDS:
        out = kl_penalty(lp, ref, kind)
        g_lp, g_ref = torch.autograd.grad(out.sum(), (lp, ref))
        assert torch.isfinite(g_lp).all() and torch.isfinite(g_ref).all(), kind
        assert g_lp[4] != 0, kind
        if kind not in ("k1", "kl"):  # k1's derivative is 1 whatever Δ is
            assert (g_lp[:4] == 0).all() and (g_ref[:4] == 0).all(), kind
        if not kind.startswith(("k3", "low_var")):
            assert not torch.isfinite(out[:4]).any(), kind

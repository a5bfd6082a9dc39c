"""Tests for nanokl/kl_ctrl.py: closed-form trajectories, error clipping, a closed loop that
settles on target, state round-trips, and config validation.

How the tests prove it. A sequence of updates equals the closed-form product β_0 Π (1 + clip(...)·n/H)
computed in the test, with the error visibly clipped at ±0.2; in a toy closed loop where the
measured KL is c/β, β converges until the KL is within 5% of target; a state_dict loaded into a
fresh controller produces the same future trajectory; bad configs raise ValueError.
"""

import json
from types import SimpleNamespace

import pytest

from nanokl.kl_ctrl import AdaptiveKLController, FixedKLController, make_kl_controller


def cfg(**kw):
    base = dict(type="adaptive", kl_coef=0.05, target_kl=0.1, horizon=1000)
    base.update(kw)
    return SimpleNamespace(**base)


def test_adaptive_matches_closed_form_with_clipping():
    """β_T = β_0 Π_t (1 + clip(kl_t/target − 1, ±0.2) · n_t/H), written out in the test."""
    kls = [0.5, 0.0, 0.11, 0.09, 10.0, 0.1, 0.3, 0.02, 0.12]
    ns = [64, 64, 32, 128, 64, 64, 16, 64, 256]
    ctrl = AdaptiveKLController(init_kl_coef=0.05, target_kl=0.1, horizon=1000)
    expected = 0.05
    for kl, n in zip(kls, ns):
        err = kl / 0.1 - 1
        if err > 0.2:
            err = 0.2
        elif err < -0.2:
            err = -0.2
        prev = ctrl.value
        ctrl.update(kl, n)
        expected *= 1 + err * n / 1000
        assert ctrl.value == pytest.approx(expected, rel=1e-14)
        if kl in (0.5, 10.0):  # clipped at +0.2 however large the KL
            assert ctrl.value / prev == pytest.approx(1 + 0.2 * n / 1000, rel=1e-14)
        if kl in (0.0, 0.02):  # clipped at −0.2
            assert ctrl.value / prev == pytest.approx(1 - 0.2 * n / 1000, rel=1e-14)
    assert ctrl.value != pytest.approx(0.05)


def test_verl_horizon_barely_moves_beta():
    """The docstring's arithmetic: horizon 10000, 64 responses a step, error at its clip:
    β changes by exactly 0.128% per step."""
    ctrl = AdaptiveKLController(0.05, 0.1, 10000)
    ctrl.update(100.0, 64)
    assert ctrl.value / 0.05 - 1 == pytest.approx(0.00128, rel=1e-9)


@pytest.mark.parametrize("beta0", [0.001, 1.0])
def test_closed_loop_settles_on_target(beta0):
    """Toy plant: the measured KL is c/β (more pull, less drift). The fixed point is β* =
    c/target; starting 20x away in either direction, β settles so KL is within 5% of target."""
    c, target = 0.005, 0.1
    ctrl = AdaptiveKLController(beta0, target, horizon=1000)
    kl0 = c / ctrl.value
    assert max(kl0 / target, target / kl0) > 10  # starts far from target
    for _ in range(400):
        ctrl.update(c / ctrl.value, n_steps=64)
    assert abs(c / ctrl.value - target) / target < 0.05
    assert ctrl.value == pytest.approx(c / target, rel=0.05)


def test_state_round_trip_continues_same_trajectory():
    a = make_kl_controller(cfg())
    for kl in (0.3, 0.05, 0.2):
        a.update(kl, 64)
    state = a.state_dict()
    assert all(type(v) is float for k, v in state.items() if k != "type") and state["type"] == "adaptive"
    state = json.loads(json.dumps(state))  # plain data: survives any serialization
    b = make_kl_controller(cfg())
    assert b.value != a.value
    b.load_state_dict(state)
    for kl in (0.4, 0.01, 0.1, 0.15):
        a.update(kl, 64)
        b.update(kl, 64)
        assert b.value == a.value


def test_fixed_controller_and_factory():
    f = make_kl_controller(cfg(type="fixed", kl_coef=0.02))
    assert isinstance(f, FixedKLController)
    f.update(5.0, 64)
    assert f.value == 0.02
    g = FixedKLController(1.0)
    g.load_state_dict(f.state_dict())
    assert g.value == 0.02
    a = make_kl_controller(cfg())
    assert isinstance(a, AdaptiveKLController) and a.value == 0.05


@pytest.mark.parametrize("bad", [
    dict(type="pid"), dict(target_kl=0.0), dict(target_kl=-1.0), dict(horizon=0),
    dict(kl_coef=0.0), dict(type="fixed", kl_coef=-0.1),
])
def test_bad_config_raises(bad):
    with pytest.raises(ValueError):
        make_kl_controller(cfg(**bad))


def test_refuses_sign_flip():
    """n/H ≥ 5 with error −0.2 would make the multiplier ≤ 0."""
    ctrl = AdaptiveKLController(0.05, 0.1, horizon=10)
    ctrl.update(0.0, 49)  # multiplier 1 − 0.2·4.9 = 0.02: allowed
    assert ctrl.value == pytest.approx(0.05 * 0.02)
    with pytest.raises(ValueError):
        ctrl.update(0.0, 50)


def test_target_schedule_gives_the_right_target_at_every_step():
    """[[0, 0.1], [0.5, 0.03]] over 10 steps (fraction = step / 10), written out by hand."""
    from nanokl.kl_ctrl import target_at
    schedule = [[0, 0.1], [0.5, 0.03]]
    step_wise = [target_at(schedule, s / 10, "step") for s in range(10)]
    assert step_wise == [0.1] * 5 + [0.03] * 5
    linear = [target_at([[0, 0.1], [0.5, 0.03], [1.0, 0.03]], s / 10, "linear") for s in range(11)]
    assert linear == pytest.approx([0.1, 0.086, 0.072, 0.058, 0.044, 0.03, 0.03, 0.03, 0.03, 0.03, 0.03], abs=1e-15)
    assert target_at(0.07, 0.9) == 0.07
    assert target_at([[0, 0.2], [0.25, 0.1], [0.75, 0.05]], 0.75) == 0.05  # a point starts its piece
    ctrl = make_kl_controller(cfg(target_kl=schedule, target_kl_interp="step"))
    seen = []
    for s in range(10):
        ctrl.follow(s / 10)
        seen.append(ctrl.target)
        ctrl.update(0.05, 64)
    assert seen == step_wise
    # the monitor's "target_kl x 0.7" scales the schedule; the scale survives a state round trip
    ctrl.scale = 0.7
    ctrl.follow(0.2)
    assert ctrl.target == pytest.approx(0.07)
    other = make_kl_controller(cfg(target_kl=schedule, target_kl_interp="step"))
    other.load_state_dict(json.loads(json.dumps(ctrl.state_dict())))
    other.follow(0.9)
    assert other.target == pytest.approx(0.7 * 0.03) and other.value == ctrl.value


def test_the_controller_steers_toward_the_scheduled_target():
    """Toy closed loop KL = c / beta: in each phase beta settles where c / beta is that phase's target."""
    c = 0.005
    ctrl = make_kl_controller(cfg(kl_coef=0.05, target_kl=[[0, 0.1], [0.5, 0.03]], horizon=640))
    last = {}
    for s in range(800):
        ctrl.follow(s / 800)
        ctrl.update(c / ctrl.value, 64)
        last[ctrl.target] = c / ctrl.value
    assert last[0.1] == pytest.approx(0.1, rel=0.05) and last[0.03] == pytest.approx(0.03, rel=0.05)

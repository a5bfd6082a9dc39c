"""Tests for nanokl/kl_ctrl.py: closed-form trajectories, error clipping, a closed loop that
settles on target, state round-trips, and config validation.

How the tests prove it. A sequence of updates equals the closed-form product β_0 Π (1 + clip(...)·n/H)
computed in the test, with the error visibly clipped at ±0.2; in a toy closed loop where the
measured KL is c/β, β converges until the KL is within 5% of target; a state_dict loaded into a
fresh controller produces the same future trajectory; bad configs raise ValueError. `hold` is checked
on a scripted stream with the step of each move (held while below target, Ziegler's rule from the first
KL at target or once `hold` updates are spent; hold 0 is Ziegler's bit for bit). The adaptive update
equals verl's three lines (np.clip, mult, value *= mult) written out in float64, bit for bit, over a
random KL stream.
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


# ---------------------------------------------------------------------------------------------
# The KL loss's coefficient (actor_rollout_ref.actor.kl_loss_ctrl), steered by harness/run.py
# ---------------------------------------------------------------------------------------------

ARTICLE = ["algorithm.kl_ctrl.type=adaptive", "actor_rollout_ref.actor.use_kl_loss=true",
           "algorithm.use_kl_in_reward=false"]  # the KL-tuning article's example: nothing for kl_ctrl to steer


def _loss_run(*overrides):
    from nanokl.harness.config.load import load_config
    from nanokl.kl_ctrl import make_kl_loss_controller
    cfg = load_config(None, list(overrides))
    return SimpleNamespace(cfg=cfg, kl_loss_ctrl=make_kl_loss_controller(cfg.actor_rollout_ref.actor))


def test_fixed_kl_loss_coefficient_is_verls():
    from train_ppo import steer_kl_loss
    run = _loss_run("actor_rollout_ref.actor.kl_loss_coef=0.02")
    metrics = {"actor/kl_loss": 5.0}
    steer_kl_loss(run, metrics)
    assert run.kl_loss_ctrl.type == "fixed" and run.kl_loss_ctrl.value == 0.02 and metrics == {"actor/kl_loss": 5.0}


def test_adaptive_kl_loss_coefficient_follows_the_update_rule_on_a_scripted_kl_stream():
    """ppo_step's steer_kl_loss on a scripted actor/kl_loss stream equals the float64 rule written out
    here: coef *= 1 + clip(kl / target - 1, +-0.2) * (train_batch_size * n) / horizon; a step without
    the metric (critic warm-up) or with a non-finite one (a skipped update) leaves it alone."""
    from train_ppo import steer_kl_loss
    run = _loss_run("actor_rollout_ref.actor.kl_loss_coef=0.01", "actor_rollout_ref.actor.kl_loss_ctrl.type=adaptive",
                    "actor_rollout_ref.actor.kl_loss_ctrl.target_kl=0.05",
                    "actor_rollout_ref.actor.kl_loss_ctrl.horizon=20000", "data.train_batch_size=64",
                    "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.rollout.n=4")
    stream = [0.2, 0.08, None, 0.05, 0.051, float("nan"), 0.0, 0.03, 0.5, 0.049]
    expected, n = 0.01, 64 * 4
    for kl in stream:
        metrics = {} if kl is None else {"actor/kl_loss": kl}
        steer_kl_loss(run, metrics)
        if kl is not None and kl == kl:
            err = min(max(kl / 0.05 - 1.0, -0.2), 0.2)
            expected = expected * (1.0 + err * n / 20000.0)
            assert metrics["actor/kl_loss_target"] == 0.05
        assert run.kl_loss_ctrl.value == expected  # the same float64 operations, the same bits
    assert run.kl_loss_ctrl.value != 0.01


def test_adaptive_kl_loss_coefficient_closes_the_loop_on_its_target():
    """Toy plant: the KL loss the policy ends up paying is c / coef (a heavier loss, a closer policy).
    From 30x off either way, the coefficient settles where the KL loss is within 5% of target_kl."""
    from train_ppo import steer_kl_loss
    c, target = 0.002, 0.05
    for coef0 in (0.04 / 30, 0.04 * 30):
        run = _loss_run(f"actor_rollout_ref.actor.kl_loss_coef={coef0}", "actor_rollout_ref.actor.kl_loss_ctrl.type=adaptive",
                        f"actor_rollout_ref.actor.kl_loss_ctrl.target_kl={target}",
                        "actor_rollout_ref.actor.kl_loss_ctrl.horizon=2000", "data.train_batch_size=64",
                        "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.rollout.n=4")
        for _ in range(600):
            steer_kl_loss(run, {"actor/kl_loss": c / run.kl_loss_ctrl.value})
        assert c / run.kl_loss_ctrl.value == pytest.approx(target, rel=0.05)


def test_a_controller_with_nothing_to_steer_warns_once(capsys):
    from nanokl.harness.config.load import load_config
    from nanokl.harness.config.notes import kl_term_notes, startup_notes

    def controller_lines(cfg):  # the KL term's own notes (no KL term: verl's defaults) are test_config_verl's
        return [n for n in startup_notes(cfg) if n not in kl_term_notes(cfg)]
    lines = controller_lines(load_config(None, ARTICLE))
    assert len(lines) == 1 and lines[0].startswith("warning: algorithm.kl_ctrl.type=adaptive steers beta")
    assert "actor_rollout_ref.actor.kl_loss_ctrl.type=adaptive" in lines[0]
    lines = controller_lines(load_config(None, ["actor_rollout_ref.actor.kl_loss_ctrl.type=adaptive"]))
    assert len(lines) == 1 and "use_kl_loss is false" in lines[0]
    for quiet in (["algorithm.kl_ctrl.type=adaptive", "algorithm.use_kl_in_reward=true"],
                  ["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_ctrl.type=adaptive"]):
        assert startup_notes(load_config(None, quiet)) == []  # a KL term, and its controller steers it
    bad = "actor_rollout_ref.actor.kl_loss_coef=0"
    with pytest.raises(ValueError, match="kl_loss_coef must be > 0 with kl_loss_ctrl.type=adaptive"):
        load_config(None, ["actor_rollout_ref.actor.kl_loss_ctrl.type=adaptive", bad])


def test_a_run_steers_the_kl_loss_coefficient_and_warns_once(sft_dir, tmp_path, capfd):
    """A 3-step run of the article's config with an adaptive KL-loss coefficient: the start-up
    warning appears once; each step's logged actor/kl_coef is the previous one moved by the rule
    from the previous step's logged actor/kl_loss."""
    from pathlib import Path

    import train_ppo
    from nanokl.harness.tracking import read_metrics
    root = Path(__file__).resolve().parents[1]
    train_ppo.main(["--config", str(root / "configs" / "arith_tiny.yaml"), *ARTICLE,
                    "data.num_train=64", "data.num_val=8", "data.train_batch_size=8", "data.max_response_length=16",
                    "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                    "actor_rollout_ref.actor.kl_loss_coef=0.05", "actor_rollout_ref.actor.kl_loss_ctrl.type=adaptive",
                    "actor_rollout_ref.actor.kl_loss_ctrl.target_kl=1e-6", "actor_rollout_ref.actor.kl_loss_ctrl.horizon=100",
                    "trainer.logger=jsonl", "trainer.test_freq=-1", "trainer.val_before_train=false",
                    "trainer.save_freq=-1", "trainer.total_training_steps=3", f"actor_rollout_ref.model.path={sft_dir}",
                    f"sft.output_dir={sft_dir}", f"trainer.default_local_dir={tmp_path}"])
    err = capfd.readouterr().err
    assert sum(line.startswith("warning: algorithm.kl_ctrl.type=adaptive") for line in err.splitlines()) == 1, err
    rows = [r for r in read_metrics(tmp_path) if "actor/kl_coef" in r]
    assert len(rows) == 3 and rows[0]["actor/kl_coef"] == pytest.approx(0.05, rel=1e-12)
    n = 8 * load_n(root)
    for prev, row in zip(rows, rows[1:]):
        err_t = min(max(prev["actor/kl_loss"] / 1e-6 - 1.0, -0.2), 0.2)
        assert row["actor/kl_coef"] == pytest.approx(prev["actor/kl_coef"] * (1 + err_t * n / 100), rel=1e-12)
        assert row["actor/kl_loss_target"] == 1e-6
    assert len({r["actor/kl_coef"] for r in rows}) == 3  # it moved every step (a fixed one would not)


def load_n(root):
    from nanokl.harness.config.load import load_config
    return load_config(root / "configs" / "arith_tiny.yaml").actor_rollout_ref.rollout.n


def test_hold_keeps_beta_until_the_kl_first_reaches_its_target():
    """algorithm.kl_ctrl.hold: a scripted stream with the step of each move. β stays put while the KL
    is below target and fewer than `hold` updates have been held; from the first KL at target (or
    once `hold` updates are spent) it is Ziegler's rule, and never holds again."""
    kls = [0.0, 0.01, 0.05, 0.099, 0.1, 0.0, 0.0, 0.2]
    ctrl = make_kl_controller(cfg(hold=100))
    betas = []
    for kl in kls:
        ctrl.update(kl, 64)
        betas.append(ctrl.value)
    assert betas[:4] == [0.05] * 4 and ctrl.held == 4  # steps 1-4: below target, held
    expected = 0.05
    for kl in kls[4:]:  # step 5 reaches the target (error 0: β unchanged), then every step moves
        expected *= 1 + max(min(kl / 0.1 - 1, 0.2), -0.2) * 64 / 1000
    assert betas[4] == 0.05 and betas[5] == pytest.approx(0.05 * (1 - 0.2 * 0.064), rel=1e-15)
    assert ctrl.value == pytest.approx(expected, rel=1e-15) and ctrl.reached

    capped = make_kl_controller(cfg(hold=2))  # the KL never comes: after 2 held updates β moves
    for kl in (0.0, 0.0, 0.0):
        capped.update(kl, 64)
    assert capped.value == pytest.approx(0.05 * (1 - 0.2 * 0.064), rel=1e-15) and capped.held == 2

    plain, zero = make_kl_controller(cfg()), make_kl_controller(cfg(hold=0))  # hold 0 is Ziegler's bit for bit
    for kl in kls:
        plain.update(kl, 64)
        zero.update(kl, 64)
        assert plain.value == zero.value


def test_hold_state_round_trips_through_a_checkpoint():
    a = make_kl_controller(cfg(hold=10))
    for kl in (0.0, 0.02, 0.03):
        a.update(kl, 64)
    state = json.loads(json.dumps(a.state_dict()))
    b = make_kl_controller(cfg(hold=10))
    b.load_state_dict(state)
    assert (b.held, b.reached, b.value) == (3, False, 0.05)
    for kl in (0.04, 0.12, 0.0):
        a.update(kl, 64)
        b.update(kl, 64)
        assert (b.value, b.held, b.reached) == (a.value, a.held, a.reached)
    assert b.reached and b.value != 0.05
    c = make_kl_controller(cfg(hold=10))  # a checkpoint of a run that never held resumes without holding
    c.load_state_dict(make_kl_controller(cfg()).state_dict())
    c.update(0.0, 64)
    assert c.reached and c.value == pytest.approx(0.05 * (1 - 0.2 * 0.064), rel=1e-15)


def test_a_negative_hold_fails_config_validation_naming_the_key():
    from nanokl.harness.config.yaml_io import ConfigError
    from nanokl.harness.config.load import load_config
    with pytest.raises(ConfigError, match=r"algorithm\.kl_ctrl\.hold"):
        load_config(None, ["algorithm.kl_ctrl.hold=-1"])


@pytest.mark.parametrize("hold", [100, 1])
def test_a_default_run_holds_beta_and_says_so(sft_dir, tmp_path, hold):
    """3 steps of the default config (hold 100): the KL starts far below the target (0.085), so β stays at 0.05 and
    actor/kl_ctrl_holding reads 1 each step; with hold 1 the second update already moves β by the rule."""
    from pathlib import Path

    import train_ppo
    from nanokl.harness.tracking import read_metrics
    root = Path(__file__).resolve().parents[1]
    train_ppo.main(["--config", str(root / "configs" / "arith_tiny.yaml"),
                    "data.num_train=64", "data.num_val=8", "data.train_batch_size=8", "data.max_response_length=16",
                    "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                    f"algorithm.kl_ctrl.hold={hold}", "trainer.kl_monitor.warmup_steps=0",  # only the hold quiets it
                    "trainer.logger=jsonl", "trainer.test_freq=-1",
                    "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.total_training_steps=3",
                    f"actor_rollout_ref.model.path={sft_dir}", f"sft.output_dir={sft_dir}",
                    f"trainer.default_local_dir={tmp_path}"])
    rows = [r for r in read_metrics(tmp_path) if "actor/reward_kl_penalty_coeff" in r]
    betas, kls = [r["actor/reward_kl_penalty_coeff"] for r in rows], [r["actor/reward_kl_penalty"] for r in rows]
    assert len(rows) == 3 and max(kls) < 0.085
    if hold == 100:
        assert betas == [0.05] * 3 and [r["actor/kl_ctrl_holding"] for r in rows] == [1.0] * 3
        assert [r["monitor/kl_band_fired"] for r in rows] == [0.0] * 3  # the low side waits while β holds
    else:  # step 1's update is held, step 2's moves: step 3 logs 0.05 * (1 + clip(e2) * 8/320)
        e2 = max(min(kls[1] / 0.085 - 1, 0.2), -0.2)
        assert betas[:2] == [0.05, 0.05] and betas[2] == pytest.approx(0.05 * (1 + e2 * 8 / 320), rel=1e-12)
        assert [r["actor/kl_ctrl_holding"] for r in rows] == [1.0, 0.0, 0.0]
        assert [r["monitor/kl_band_fired"] for r in rows] == [0.0, 1.0, 1.0]  # KL < kl_low 0.03: it warns


def test_adaptive_is_verls_three_lines_bit_for_bit():
    """verl's AdaptiveKLController.update written out in float64 (np.clip, then mult, then value *= mult)
    over a random KL stream with random batch sizes: the controller's β has the same bits at every step."""
    import random

    import numpy as np
    rng = random.Random(0)
    ctrl, value, target, horizon = AdaptiveKLController(0.05, 0.085, 320), 0.05, 0.085, 320
    for _ in range(2000):
        current_kl = rng.choice([0.0, rng.random() * 0.2, rng.lognormvariate(-2.5, 1.5)])
        n_steps = rng.choice([1, 8, 64, 128, 256])
        proportional_error = np.clip(current_kl / target - 1, -0.2, 0.2)
        mult = 1 + proportional_error * n_steps / horizon
        value *= mult
        ctrl.update(current_kl, n_steps)
        assert ctrl.value == value and type(ctrl.value) is float
    assert ctrl.value != 0.05

"""Tests for the integral term of nanokl/kl_ctrl.py (algorithm.kl_ctrl.type: pi).

How the tests prove it. The update rule is checked step by step against a naive float64 loop
written here from the docstring's two lines (error clip ±0.2, integrand capped at +1, integral
clamped to [0, limit]); ki = 0 reproduces Ziegler's rule bit for bit. The reason for the term is
checked on a simulated closed loop: a plant whose KL follows β with a lag while its pull away
from π_ref grows (a ramp, as in training). Over 20 seeds Ziegler's controller settles more than
8% above target in the second half (the standing error of a one-integrator loop, module
docstring (1)), the PI controller within ±3% (Monte Carlo: per-seed sd ~1%, so ±3% is many
standard errors from either outcome). The one-sided integral's anti-windup is checked on the
same loop's start-up, where a two-sided integral would wind down. State round-trips through
JSON; bad gains fail config validation naming the key; a 4-step run logs the rule's β.
"""

import json
import math
import random
from types import SimpleNamespace

import pytest

from nanokl.kl_ctrl import AdaptiveKLController, make_kl_controller


def cfg(**kw):
    base = dict(type="pi", kl_coef=0.05, target_kl=0.1, horizon=640, ki=0.3, integral_limit=1.0)
    base.update(kw)
    return SimpleNamespace(**base)


def reference_pi(beta, kls, n, horizon, target, ki, limit):
    """The rule, written out: β_{t+1} = β_t (1 + K (clip(e, ±0.2) + ki I_t)),
    I_t = clamp(I_{t-1} + K min(e, 1), 0, limit), K = n/H, e = KL/target − 1."""
    out, integral = [], 0.0
    for kl in kls:
        e = kl / target - 1.0
        k = n / horizon
        integral = integral + k * (e if e < 1.0 else 1.0)
        integral = 0.0 if integral < 0.0 else (limit if integral > limit else integral)
        p = -0.2 if e < -0.2 else (0.2 if e > 0.2 else e)
        beta = beta * (1.0 + k * (p + ki * integral))
        out.append((beta, integral))
    return out


def test_update_matches_the_rule_step_by_step():
    """A stream that visits every branch: below target (integral held at 0), spikes (P clipped at
    +0.2, integrand capped at +1), a run above target long enough to hit the limit, and back."""
    kls = [0.0, 0.05, 0.13, 0.5, 10.0, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.11, 0.02, 0.0, 0.09, 0.1]
    ctrl = make_kl_controller(cfg(horizon=320, integral_limit=0.5))
    expected = reference_pi(0.05, kls, 64, 320, 0.1, 0.3, 0.5)
    seen = set()
    for kl, (beta, integral) in zip(kls, expected):
        ctrl.update(kl, 64)
        assert ctrl.value == pytest.approx(beta, rel=1e-13) and ctrl.integral == pytest.approx(integral, abs=1e-15)
        seen.add("zero" if integral == 0.0 else "limit" if integral == 0.5 else "inside")
    assert seen == {"zero", "inside", "limit"}
    assert expected[1][1] == 0.0  # KL 0.0 and 0.05: below target, the one-sided integral stays at 0
    assert expected[4][1] - expected[3][1] == pytest.approx(0.2)  # KL 100x target moves I by K·1 only


def test_ki_zero_is_ziegler_bit_for_bit():
    rng = random.Random(0)
    kls = [rng.uniform(0.0, 0.3) for _ in range(200)]
    a = AdaptiveKLController(0.05, 0.1, 640)
    b = make_kl_controller(cfg(ki=0.0))
    for kl in kls:
        a.update(kl, 64)
        b.update(kl, 64)
        assert a.value == b.value
    assert b.state_dict()["type"] == "adaptive" and make_kl_controller(cfg()).state_dict()["type"] == "pi"


def test_state_round_trip_carries_the_integral():
    a = make_kl_controller(cfg())
    for kl in (0.2, 0.15, 0.12):
        a.update(kl, 64)
    assert a.integral > 0
    state = json.loads(json.dumps(a.state_dict()))  # what a checkpoint holds
    b = make_kl_controller(cfg())
    b.load_state_dict(state)
    assert (b.value, b.integral) == (a.value, a.integral)
    for kl in (0.05, 0.3, 0.1, 0.08):
        a.update(kl, 64)
        b.update(kl, 64)
        assert (b.value, b.integral) == (a.value, a.integral)
    c = make_kl_controller(cfg())  # a checkpoint from before the integral existed resumes with I = 0
    c.load_state_dict({k: v for k, v in state.items() if k != "integral"})
    assert c.integral == 0.0 and c.value == state["value"]


def test_still_refuses_a_sign_flip():
    """The integral only adds upward rate (I ≥ 0), so the multiplier's floor is Ziegler's 1 − 0.2·n/H."""
    ctrl = make_kl_controller(cfg(horizon=10))
    ctrl.update(0.0, 49)
    assert ctrl.value == pytest.approx(0.05 * (1 - 0.2 * 4.9)) and ctrl.integral == 0.0
    with pytest.raises(ValueError, match="non-positive"):
        ctrl.update(0.0, 50)


def drifting_plant(ctrl, seed, steps=300, target=0.07, lag=0.15, growth=0.01, cv=0.15):
    """log KL relaxes (rate `lag` a step) toward log(pull_t / β); the pull rises from 0 over the first
    ~15 steps (the policy starts at π_ref) and then grows `growth` a step (the policy keeps learning);
    the batch KL is that times gamma noise of mean 1 (right-skewed, coefficient of variation `cv`)."""
    rng, y, kls = random.Random(seed), math.log(1e-4), []
    shape = 1.0 / cv ** 2
    for t in range(steps):
        pull = 0.0035 * (1.0 - math.exp(-t / 15)) * math.exp(growth * t) + 1e-6
        y += lag * (math.log(pull / ctrl.value) - y)
        kl = math.exp(y) * rng.gammavariate(shape, 1.0 / shape)
        kls.append(kl)
        ctrl.update(kl, 64)
    return [kl / target - 1.0 for kl in kls]


def second_half_offsets(kind, seeds=range(20), **kw):
    out = []
    for s in seeds:
        ctrl = make_kl_controller(cfg(type=kind, target_kl=0.07, **kw))
        err = drifting_plant(ctrl, s)
        out.append(sum(err[150:]) / 150)
    return sum(out) / len(out), out


def test_closed_loop_ziegler_settles_above_target_and_pi_on_it():
    """The ramp leaves Ziegler's loop a standing error (docstring (1): mean(c) = g/K, plus the skew);
    the integral removes it."""
    ziegler, _ = second_half_offsets("adaptive")
    pi, per_seed = second_half_offsets("pi")
    assert ziegler > 0.08
    assert abs(pi) < 0.03
    assert max(abs(x) for x in per_seed) < 0.06  # every seed, not only the mean


def test_closed_loop_without_drift_costs_little():
    """No ramp: Ziegler is already on target (a one-integrator loop, constant setpoint) and the
    one-sided integral holds the KL at most a few percent below it."""
    offsets = {}
    for kind in ("adaptive", "pi"):
        runs = []
        for s in range(20):
            err = drifting_plant(make_kl_controller(cfg(type=kind, target_kl=0.07)), s, growth=0.0)
            runs.append(sum(err[150:]) / 150)
        offsets[kind] = sum(runs) / len(runs)
    assert abs(offsets["adaptive"]) < 0.02 and -0.03 < offsets["pi"] <= 0.0


def test_one_sided_integral_does_not_wind_up_at_start():
    """During start-up (KL ≈ 0, e ≈ −1) the integral stays at 0, so the first overshoot is no larger
    than Ziegler's; a two-sided integral (simulated by letting I go negative) overshoots more."""
    class TwoSided(AdaptiveKLController):
        def update(self, current_kl, n_steps):
            e = min(float(current_kl) / self.target - 1.0, 1.0)
            self.integral = max(self.integral + e * n_steps / self.horizon, -self.integral_limit)
            p = min(max(e, -0.2), 0.2)
            self.value *= 1.0 + n_steps / self.horizon * (p + self.ki * self.integral)

    def peak(make):
        return sum(max(drifting_plant(make(), s)[20:150]) for s in range(10)) / 10

    ziegler = peak(lambda: AdaptiveKLController(0.05, 0.07, 640))
    one_sided = peak(lambda: AdaptiveKLController(0.05, 0.07, 640, ki=0.3))
    two_sided = peak(lambda: TwoSided(0.05, 0.07, 640, ki=0.3))
    assert one_sided <= ziegler + 0.05 and two_sided > one_sided + 0.3


@pytest.mark.parametrize("bad,key", [("algorithm.kl_ctrl.ki=-0.1", "algorithm.kl_ctrl.ki"),
                                     ("algorithm.kl_ctrl.integral_limit=0", "algorithm.kl_ctrl.integral_limit"),
                                     ("algorithm.kl_ctrl.type=pid", "algorithm.kl_ctrl.type")])
def test_bad_gains_fail_config_validation_naming_the_key(bad, key):
    from nanokl.harness.config.yaml_io import ConfigError
    from nanokl.harness.config.load import load_config
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, ["algorithm.kl_ctrl.type=pi", bad])
    with pytest.raises(ValueError):
        AdaptiveKLController(0.05, 0.1, 640, ki=-1.0)


def test_config_builds_a_pi_controller():
    from nanokl.harness.config.load import load_config
    from nanokl.harness.config.notes import startup_notes
    c = load_config(None, ["algorithm.kl_ctrl.type=pi", "algorithm.kl_ctrl.ki=0.5", "algorithm.kl_ctrl.integral_limit=2"])
    ctrl = make_kl_controller(c.algorithm.kl_ctrl)
    assert (ctrl.type, ctrl.ki, ctrl.integral_limit) == ("adaptive", 0.5, 2.0)
    lines = startup_notes(load_config(None, ["algorithm.kl_ctrl.type=pi", "algorithm.use_kl_in_reward=false"]))
    assert any(line.startswith("warning: algorithm.kl_ctrl.type=pi steers beta") for line in lines)


def test_a_run_moves_beta_by_the_pi_rule(sft_dir, tmp_path):
    """4 steps of the default config with type pi: each logged β is the previous one moved by the
    rule from the previous step's logged KL (n = the step's responses)."""
    from pathlib import Path

    import train_ppo
    from nanokl.harness.tracking import read_metrics
    root = Path(__file__).resolve().parents[1]
    target, horizon = 1e-10, 40  # far below even the first step's KL (~1e-8): the integral moves every step
    train_ppo.main(["--config", str(root / "configs" / "arith_tiny.yaml"),
                    "data.num_train=64", "data.num_val=8", "data.train_batch_size=8", "data.max_response_length=16",
                    "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                    "algorithm.kl_ctrl.type=pi", f"algorithm.kl_ctrl.target_kl={target}",
                    f"algorithm.kl_ctrl.horizon={horizon}", "algorithm.kl_ctrl.integral_limit=0.15",
                    "algorithm.kl_ctrl.hold=0",  # the rule from step 1 (the default holds while KL < target)
                    "algorithm.kl_penalty=mse",  # k2 >= 0: k1's batch mean of a barely moved policy may be < 0
                    # GAE: its critic's baseline moves the policy on step 1, whose reward is all zero (no
                    # answer right, KL 0); REINFORCE++'s whitened returns are then 0 and nothing moves
                    "algorithm.adv_estimator=gae",
                    "trainer.logger=jsonl", "trainer.test_freq=-1", "trainer.val_before_train=false",
                    "trainer.kl_monitor.enable=false", "trainer.save_freq=-1", "trainer.total_training_steps=4",
                    f"actor_rollout_ref.model.path={sft_dir}", f"sft.output_dir={sft_dir}",
                    f"trainer.default_local_dir={tmp_path}"])
    rows = [r for r in read_metrics(tmp_path) if "actor/reward_kl_penalty_coeff" in r]
    betas = [r["actor/reward_kl_penalty_coeff"] for r in rows]
    expected = reference_pi(0.05, [r["actor/reward_kl_penalty"] for r in rows], 8, horizon, target, 0.3, 0.15)
    assert len(rows) == 4 and betas[0] == pytest.approx(0.05, rel=1e-12)
    for beta, (want, _) in zip(betas[1:], expected):
        assert beta == pytest.approx(want, rel=1e-12)
    # step 1's KL may be 0 (the policy is the reference: I stays 0); once it is above the target,
    # K·1 = 8/40 = 0.2 > 0.15: the integral hits its clamp inside the run
    assert expected[2][1] == 0.15

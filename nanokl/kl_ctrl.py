"""KL coefficient controllers: how hard to pull the policy back toward the reference.

The policy maximizes  score − β · KL  (per token): β trades reward against staying near π_ref.
`FixedKLController` keeps β. `AdaptiveKLController` steers β toward a target KL with the
proportional controller of Ziegler et al. 2019 ("Fine-Tuning Language Models from Human
Preferences", arXiv:1909.08593, §2.2), written as verl's `AdaptiveKLController.update`
(verl/trainer/ppo/core_algos.py) writes it, in three lines:

    proportional_error = clip(current_kl / target − 1, −0.2, 0.2)
    mult = 1 + proportional_error · n_steps / horizon
    value *= mult

Too much KL raises β, too little lowers it; the clip keeps one odd batch from moving β far, the
product keeps β positive and its changes relative. As in verl, current_kl is the per-token KL
averaged within each response, then over the batch (`apply_kl_penalty`), and n_steps counts the
step's *responses*, so `horizon` is in responses and β moves at most 0.2·n/H a step: verl's
horizon 10000 at 64 responses is 0.13% (a few-hundred-step run never notices), arith_tiny.yaml's
320 at 128 responses is 8%. At n/H ≥ 5 the multiplier could reach 0; `update` refuses that.

Why it settles above its target
-------------------------------
In u = log β the rule integrates the clipped error c_t:
u_t+1 = u_t + log(1 + K c_t) ≈ u_t + K c_t with K = n/H, so over N steps

    mean(c) ≈ (u_end − u_start) / (K · N)                                            (1)

The error averages zero only if β ends where it started. But as the policy learns it drifts from
π_ref and holding the KL takes an ever larger β, a ramp in u, which a one-integrator ("type 1")
loop follows with a standing error g/K for u rising g a step (Franklin, Powell & Emami-Naeini,
Feedback Control of Dynamic Systems, ch. 4): β tripling over 150 steps at K = 0.1 is +7%. Clipping
a right-skewed KL (spikes count only +0.2) biases it the same way. A larger K shrinks it.

nanokl's extensions, each a named piece beside verl's three lines
------------------------------------------------------------------
`_holding` (hold: N). At start-up π = π_ref and the KL is ~0 whatever β is, so the rule lowers β
at full speed while the plant cannot answer: integrator wind-up (Åström & Murray, Feedback
Systems, 2008, §10.4). The cure is conditional integration: β stays while the KL is below target,
until it first reaches it (`reached`) or N updates are `held`; from then on the rule, for good.
It leaves the ramp's error (1) alone; it lets a fast loop (large K) start without winding up.
hold = 0 is verl's.

`_update_pi` (type: pi, ki > 0). A second integrator follows a ramp with no standing error
(Åström & Murray ch. 10-11): the rate gets an integral term,

    I_t = clamp(I_t−1 + K · min(e_t, 1), 0, integral_limit),   mult = 1 + (c_t + ki · I_t) · K

I rests only where mean(min(e, 1)) = 0 and supplies β's climb itself. ki is small: for a KL
lagging β by ~1/a steps the phase margin is atan(1/ki) − atan(K/a), ~28° at ki = 0.3 and
K = a = 0.1, none at ki = 1. I ≥ 0 is anti-windup against the start-up's e ≈ −1; the clamp
bounds the extra rate and, applied after each addition, may always unwind.
When the ramp ends a second integrator overshoots, so the default is the rule plus the hold.
ki = 0 is verl's rule, bit for bit.

`target_at` / `follow` (a schedule). target_kl may be [[fraction of training, target], ...]
from 0, held piecewise ("step") or interpolated ("linear"); `follow(fraction)` sets the step's
target times `scale` (the KL monitor's "lower target_kl" remedy, nanokl/harness/monitor.py).
A loose target early and a tight one late is the KL-tuning article's advice, not a measurement.
A number is verl's fixed target.

The same classes hold the KL *loss*'s weight (`make_kl_loss_controller`: actor.kl_loss_coef,
fixed in verl; actor.kl_loss_ctrl steers it by the step's actor/kl_loss, harness/run.py). Both
coefficients are state: the KL monitor's rollback raises them and every checkpoint saves them
(`state_dict`), so a resumed run continues with the coefficients it had.

Runs: bench/RESULTS.md, the two sections headed "The KL on target". tests/test_kl_ctrl.py checks
the rule bit for bit against verl's three lines in float64, a closed loop settling on target, the
hold on a scripted stream and state round trips; tests/test_kl_ctrl_pi.py the integral on a
simulated ramp.
Differs from verl: see README, 'Where nanokl differs from verl'.
"""


def target_at(schedule, fraction: float, interp: str = "step") -> float:
    """The target KL at `fraction` (0..1) of training: `schedule` is a number, or [[f0=0, t0],
    [f1, t1], ...] with f ascending; "step" holds each t_i on [f_i, f_i+1), "linear" interpolates
    between the points (and holds the last one)."""
    if isinstance(schedule, (int, float)):
        return float(schedule)
    points = [(float(f), float(t)) for f, t in schedule]
    if interp == "step":
        return next(t for f, t in reversed(points) if fraction >= f)
    for (f0, t0), (f1, t1) in zip(points, points[1:]):
        if fraction < f1:
            return t0 + (t1 - t0) * (fraction - f0) / (f1 - f0)
    return points[-1][1]


class FixedKLController:
    """β stays at kl_coef; `update` is a no-op so the training loop needs no special case.
    Differs from verl: see README, 'Where nanokl differs from verl'."""
    type = "fixed"

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl, n_steps) -> None:
        pass

    def set_value(self, value: float) -> None:
        """β set from outside the rule (the KL monitor's remedies, nanokl/harness/remedies.py)."""
        self.value = float(value)

    def follow(self, fraction: float) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": float(self.value), "type": self.type}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler's rule (ki = 0), or with the integral term (ki > 0, type pi). `value` is β, `target`
    the KL it steers toward, `integral` the integral term's state. Type "adaptive" for both.
    Differs from verl: see README, 'Where nanokl differs from verl'."""
    type = "adaptive"

    def __init__(self, init_kl_coef: float, target_kl, horizon: float, interp: str = "step",
                 ki: float = 0.0, integral_limit: float = 1.0, hold: int = 0):
        if init_kl_coef <= 0:
            # A multiplicative update can never move β away from zero.
            raise ValueError(f"adaptive init_kl_coef must be > 0, got {init_kl_coef}")
        targets = [target_kl] if isinstance(target_kl, (int, float)) else [t for _, t in target_kl]
        if not targets or min(targets) <= 0:
            raise ValueError(f"adaptive target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"adaptive horizon must be > 0, got {horizon}")
        if ki < 0 or integral_limit <= 0:
            raise ValueError(f"pi needs ki >= 0 and integral_limit > 0, got ki={ki}, "
                             f"integral_limit={integral_limit}")
        self.ki, self.integral_limit, self.integral = float(ki), float(integral_limit), 0.0
        if hold < 0:
            raise ValueError(f"hold must be >= 0, got {hold}")
        self.hold, self.held, self.reached = int(hold), 0, hold == 0
        self.value = float(init_kl_coef)
        self.schedule, self.interp, self.scale = target_kl, interp, 1.0
        self.target = target_at(target_kl, 0.0, interp)
        self.horizon = float(horizon)

    def follow(self, fraction: float) -> None:
        """Set the target for the step at `fraction` (0..1) of training."""
        self.target = self.scale * target_at(self.schedule, fraction, self.interp)

    def set_value(self, value: float) -> None:
        """β set from outside the rule (the KL monitor's remedies, nanokl/harness/remedies.py); the
        rule moves it on from there."""
        self.value = float(value)

    def set_target(self, new: float, old: float) -> None:
        """The target moved from `old` to `new` from outside (a remedy): the schedule is scaled by
        new/old from now on, so that a schedule keeps its shape."""
        self.scale *= new / old
        self.target = new

    def update(self, current_kl, n_steps) -> None:
        """current_kl: batch mean of per-response mean token KL; n_steps: #responses."""
        current_kl, n = float(current_kl), float(n_steps)
        if self._holding(current_kl):
            return
        if self.ki:
            return self._update_pi(current_kl, n)
        # verl's AdaptiveKLController.update (np.clip as min/max):
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        mult = 1.0 + proportional_error * n / self.horizon
        self.value *= self._positive(mult, n)

    def _holding(self, current_kl: float) -> bool:
        """The start-up hold: True (β stays) while the KL has not yet reached its target and
        fewer than `hold` updates were held; once it is False it stays False."""
        if self.reached:
            return False
        if current_kl < self.target and self.held < self.hold:
            self.held += 1
            return True
        self.reached = True
        return False

    def _update_pi(self, current_kl: float, n: float) -> None:
        """verl's three lines with ki · I added to the clipped error (I: one-sided, clamped)."""
        raw = min(current_kl / self.target - 1.0, 1.0)
        self.integral = min(max(self.integral + raw * n / self.horizon, 0.0), self.integral_limit)
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        mult = 1.0 + (proportional_error + self.ki * self.integral) * n / self.horizon
        self.value *= self._positive(mult, n)

    def _positive(self, mult: float, n: float) -> float:
        if mult <= 0.0:
            raise ValueError(
                f"n_steps/horizon = {n:g}/{self.horizon} is too large: beta would become "
                f"non-positive (multiplier {mult:.3g}); use a horizon > n_steps / 5"
            )
        return mult

    def state_dict(self) -> dict:
        state = {"value": float(self.value), "type": "pi" if self.ki else self.type,
                 "scale": self.scale, "target": self.target, "integral": self.integral}
        return state | ({"held": self.held, "reached": self.reached} if self.hold else {})

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.scale = float(state.get("scale", 1.0))
        self.target = float(state.get("target", self.target))
        self.integral = float(state.get("integral", 0.0))
        self.held = int(state.get("held", 0))
        # no "reached": the run that saved it did not hold (hold 0, or before the key), so neither
        # does its resume
        self.reached = bool(state.get("reached", True))


def make_kl_controller(kl_ctrl_cfg):
    """Build a controller from a config with attributes type, kl_coef, target_kl, horizon
    (the names of verl's algorithm.kl_ctrl), and for type pi ki and integral_limit: verl's
    `get_kl_controller`, plus pi and hold."""
    if kl_ctrl_cfg.type == "fixed":
        return FixedKLController(kl_ctrl_cfg.kl_coef)
    if kl_ctrl_cfg.type in ("adaptive", "pi"):
        return AdaptiveKLController(kl_ctrl_cfg.kl_coef, kl_ctrl_cfg.target_kl, kl_ctrl_cfg.horizon,
                                    getattr(kl_ctrl_cfg, "target_kl_interp", "step"),
                                    ki=(getattr(kl_ctrl_cfg, "ki", 0.3) if kl_ctrl_cfg.type == "pi"
                                        else 0.0),
                                    integral_limit=getattr(kl_ctrl_cfg, "integral_limit", 1.0),
                                    hold=getattr(kl_ctrl_cfg, "hold", 0))
    raise ValueError(f"unknown kl_ctrl.type {kl_ctrl_cfg.type!r}; "
                     "valid types are 'fixed', 'adaptive', 'pi'")


def make_kl_loss_controller(actor_cfg):
    """The KL loss's coefficient (actor_rollout_ref.actor): kl_loss_coef fixed, or, with
    kl_loss_ctrl.type adaptive, steered from kl_loss_coef toward kl_loss_ctrl.target_kl."""
    c = actor_cfg.kl_loss_ctrl
    if c.type == "fixed":
        return FixedKLController(actor_cfg.kl_loss_coef)
    return AdaptiveKLController(actor_cfg.kl_loss_coef, c.target_kl, c.horizon, c.target_kl_interp)

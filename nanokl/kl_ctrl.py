"""KL coefficient controllers: how hard to pull the policy back toward the reference.

The idea
--------
The reward the policy optimizes is  score − β · KL-estimate  (per token). β trades reward
against staying close to π_ref. A fixed β is simple, but the right β depends on the task and
changes during training: early on any β looks small, later the policy would happily pay a
lot of KL for a little score. Ziegler et al. 2019 ("Fine-Tuning Language Models from Human
Preferences", arXiv:1909.08593, §2.2) instead pick a *target* KL and steer β toward it with a
proportional controller in log space:

    e_t   = clip(KL_t / KL_target − 1, −0.2, 0.2)
    β_t+1 = β_t · (1 + K_β · e_t)         with K_β = n_steps / horizon

Too much KL (e > 0) raises β, too little lowers it. Clipping the error at ±20% keeps one bad
batch from moving β a lot; the multiplicative form keeps β positive and makes its changes
relative. Holding e fixed, β grows like (1 + 0.2·n/H)^{steps} ≈ exp(0.2 · responses / H):
`horizon` is the number of samples over which β can change by a factor e^{±0.2}.

What KL the controller sees and what n_steps counts (verl's convention)
-----------------------------------------------------------------------
`current_kl` is the per-token KL estimate averaged over the response tokens of each
response and then averaged over the batch (verl's `apply_kl_penalty`: masked mean per
sequence, then mean). `n_steps` is the number of *responses* in the step (the batch size),
not 1. So `horizon` is counted in responses. With verl's default horizon=10000 and 64
responses a step, K_β = 0.0064 and β moves at most 0.2·0.0064 = 0.13% per step: a short CPU
run of a few hundred steps never notices the controller. A small run that wants its KL held
near target needs a horizon of the order of the number of responses it will see (e.g. a few
hundred to a few thousand), so that K_β·0.2 is a few percent per step.

Keep n_steps/horizon below 5: at the maximal error −0.2 the multiplier 1 + e·n/H would reach
zero and β would lose its sign; `update` refuses that rather than silently flipping it.

Why Ziegler's controller settles above its target
-------------------------------------------------
In u = log β the rule is already an integrator of the clipped error c_t = clip(e_t, ±0.2),
e_t = KL_t/KL_target − 1:  u_t+1 = u_t + log(1 + K c_t) ≈ u_t + K c_t  (K = n_steps/horizon).
Summed over N steps,

    mean(c) ≈ (u_end − u_start) / (K · N)                                            (1)

so the error averages to zero only where β ends where it started. On a plant that stands still
(a fixed relation between β and KL) it does: a loop with one integrator follows a constant
setpoint with no steady-state error. Training is not such a plant. As the policy learns, the
reward pulls it ever further from π_ref, and holding the KL takes a β that keeps rising: a ramp
in u. A loop with one integrator follows a ramp with a constant error (a "type 1" system;
Franklin, Powell & Emami-Naeini, Feedback Control of Dynamic Systems, ch. 4), here by (1)
mean(c) = g/K for u rising g per step: β tripling over 150 steps at K = 0.1 is a standing +7%.
Clipping adds a second, smaller bias in the same direction: the fixed point of (1) is E[c] = 0,
a location between the median and the mean of KL/target, and the batch KL is right-skewed
(e ≥ −1 but unbounded above; spikes count only +0.2), so its mean sits above that location.
(At horizon 640 the default run settled +13% above its target, median of 3 seeds; bench/RESULTS.md.)

The integral term (`type: pi`, beyond verl)
-------------------------------------------
The textbook cure for a ramp is a second integrator (Åström & Murray, Feedback Systems, 2008,
ch. 10-11: PI control, integrator windup, phase margin). Read Ziegler's rule as the *proportional* term of
β's rate, and give the rate an integral term that remembers the error:

    I_t   = clamp(I_t−1 + K · min(e_t, 1),  0, integral_limit)
    β_t+1 = β_t · (1 + K · (c_t + ki · I_t))

I stops moving only where mean(min(e, 1)) = 0: the mean KL itself on target (a batch above twice
the target counts as twice: one outlier moves I by at most K), whatever rate β must climb at; the
integral supplies that rate, K·ki·I per step, so c no longer has to. ki = 0 is Ziegler's rule,
bit for bit. Three choices (tests/test_kl_ctrl_pi.py checks the settling and the anti-windup
on a simulated closed loop):
  * ki small against the proportional term. With a plant whose KL follows β with a lag of about
    1/a steps, the loop's crossover is near K per step and the integral's zero at ki·K; the phase
    margin is atan(1/ki) − atan(K/a): ki = 0.3 keeps ~28° at a = 0.1 and ~47° at a = 0.2, while
    ki = 1 leaves none and the loop oscillates.
  * a one-sided integral, I ≥ 0: anti-windup (Åström & Murray §10.4). At start-up the policy is
    π_ref, KL ≈ 0 and e ≈ −1 for tens of steps; a two-sided integral would wind down to its limit
    and the KL would overshoot once it came. Both things the integral is for push β the same way
    (the drift away from π_ref raises β; with the mean on target the median of a right-skewed KL
    is below it, so mean(c) < 0 must be offset by ki·I > 0), so clamping at 0 costs little: on a
    plant with no drift, noise holds I slightly above 0 and the KL ~1% below target.
  * a clamp at integral_limit: the extra rate is at most K·ki·integral_limit a step (3% at the
    defaults). The clamp applies after each step's addition, so a saturated integral moves back
    as soon as the error changes sign: it may always unwind.
What it did on the default run (bench/RESULTS.md, seed 42): not better. Between steps 100 and 200
holding the KL took a β 27 times larger, a ramp of 3% a step (Ziegler's clip allows 2%), and the
integral held it (+5%); when the drift stopped, the β the integral had built up outlived it and
the second half averaged −31%, with lower accuracy. A ramp that ends is the case where a second
integrator overshoots; `pi` is there to measure and to build on, and the default is Ziegler's rule,
faster and held at start-up (below).

Holding β at start-up (`hold`, beyond verl)
-------------------------------------------
A run starts with π = π_ref, so for its first tens of steps the KL is near 0 whatever β is: the KL
climbs as fast as the policy learns, not as β allows. Ziegler's rule reads that as e = −1 and lowers
β at its fastest the whole time, a wind-up (Åström & Murray §10.4): the plant cannot respond and
the integrator (log β) runs on. At horizon 320 the default run's β fell from 0.05 to 0.006 by step
~55, where the KL first reached its target, and then had to climb 40-fold. `hold: N` is conditional
integration: β does not move while the KL is below its target, until the KL first reaches it (or N
updates have been held, so a run whose KL never comes still gets the rule); from then on the rule
is Ziegler's (or pi's), bit for bit, and it never holds again. hold = 0 is verl's behaviour.

Holding β alone does not move the second-half KL (horizon 640: +12% with the hold, seed 42, against
+13% without): the climb β makes there is the policy's own drift, the ramp of (1). The standing
error is g/K, so what cures it is a larger K, and what the hold buys is a faster loop without the
start-up's wind-up. The default run (horizon 320, hold 100: β may move 4% a step) holds its
second-half KL at +1.1% to +1.4% of target over 3 seeds, where horizon 640 without the hold read +13%
to +16% (bench/RESULTS.md, "The KL on target").

Two coefficients, one kind of object
------------------------------------
The same classes hold both KL weights of a run: β in the reward (algorithm.kl_ctrl: fixed,
adaptive or pi) and the weight of the KL *loss* (actor.kl_loss_coef; `make_kl_loss_controller`). Each is
state, not configuration: the KL monitor's rollback raises both (nanokl/harness/run.py), and
both are saved in every checkpoint with `state_dict()` and restored with `load_state_dict()`,
so a resumed run continues with the coefficients it had, not the ones the config started from.

The KL loss's coefficient may adapt too (beyond verl, which keeps kl_loss_coef fixed)
-------------------------------------------------------------------------------------
GRPO-style runs (algorithm.use_kl_in_reward false, actor.use_kl_loss true) pay their KL in the loss,
so the reward controller has nothing to steer. `actor_rollout_ref.actor.kl_loss_ctrl` gives the
loss's coefficient the same controller, its own section so that neither key changes meaning:

    actor_rollout_ref.actor:
      use_kl_loss: true
      kl_loss_coef: 0.01          # the controller's starting value (> 0: the update is multiplicative)
      kl_loss_ctrl: {type: adaptive, target_kl: 0.05, horizon: 2000}   # target_kl may be a schedule

After each step that updated the actor, the trainer (harness/run.py, `end_step`) feeds the
controller the step's KL loss itself: `actor/kl_loss`, the kl_loss_type estimate aggregated as
loss_agg_mode says (with token-mean, the per-token mean; the update's mini-batches averaged, all
ranks reduced), with n_steps = the step's responses, exactly the rule above with KL_t = that
number; the next step's loss uses the new coefficient. A config whose adaptive controller has
nothing to steer (algorithm.kl_ctrl adaptive with use_kl_in_reward false; kl_loss_ctrl adaptive
with use_kl_loss false) loads, and says so once at start-up (config_rules.startup_notes).

A target that changes: a schedule
---------------------------------
`target_kl` may also be a schedule, a list of [fraction of training, target] points starting at
fraction 0, read piecewise constant ("step": each target holds until the next point) or linearly
interpolated ("linear"). The KL-tuning article recommends a loose target early (0.1, "to
encourage learning": a small β lets the policy find what is rewarded) and a tight one later
(0.03, "to lock convergence": the late policy may only refine, not wander) — its claim, not a
measurement; bench/RESULTS.md shows what it did on the arithmetic task. The trainer calls
`follow(fraction)` before each step; `scale` multiplies the scheduled target (the KL monitor's
"lower target_kl" remedy changes it, nanokl/harness/monitor.py) and is saved with β.

Mirrors verl's `AdaptiveKLController`, `FixedKLController` and `get_kl_controller`
(verl/trainer/ppo/core_algos.py). Differs from verl: see README, 'Where nanokl differs from verl'.
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
    kind = "fixed"

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl, n_steps) -> None:
        pass

    def follow(self, fraction: float) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": float(self.value), "type": self.kind}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller of Ziegler et al. 2019 (ki = 0), or with the integral term (ki > 0,
    kl_ctrl.type pi); `value` is the current β, `target` the KL it steers toward (scale * the
    schedule's target at the fraction of training last followed), `integral` the integral term's
    state. Both kinds steer toward a target, so the trainer treats them alike (kind "adaptive").
    Differs from verl: see README, 'Where nanokl differs from verl'."""
    kind = "adaptive"

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
            raise ValueError(f"pi needs ki >= 0 and integral_limit > 0, got ki={ki}, integral_limit={integral_limit}")
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

    def update(self, current_kl, n_steps) -> None:
        """current_kl: batch mean of per-response mean token KL; n_steps: #responses."""
        if not self.reached:  # start-up: hold beta until the KL first reaches its target
            if float(current_kl) < self.target and self.held < self.hold:
                self.held += 1
                return
            self.reached = True
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        if self.ki:  # pi: the rate also carries the (one-sided, clamped) integral of the error
            raw = min(float(current_kl) / self.target - 1.0, 1.0)
            self.integral = min(max(self.integral + raw * float(n_steps) / self.horizon, 0.0), self.integral_limit)
            err = err + self.ki * self.integral
        mult = 1.0 + err * float(n_steps) / self.horizon
        if mult <= 0.0:
            raise ValueError(
                f"n_steps/horizon = {n_steps}/{self.horizon} is too large: beta would become "
                f"non-positive (multiplier {mult:.3g}); use a horizon > n_steps / 5"
            )
        self.value *= mult

    def state_dict(self) -> dict:
        state = {"value": float(self.value), "type": "pi" if self.ki else self.kind, "scale": self.scale,
                 "target": self.target, "integral": self.integral}
        return state | ({"held": self.held, "reached": self.reached} if self.hold else {})

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.scale = float(state.get("scale", 1.0))
        self.target = float(state.get("target", self.target))
        self.integral = float(state.get("integral", 0.0))
        self.held = int(state.get("held", 0))
        # no "reached": the run that saved it did not hold (hold 0, or before the key), so neither does its resume
        self.reached = bool(state.get("reached", True))


def make_kl_controller(kl_ctrl_cfg):
    """Build a controller from a config with attributes type, kl_coef, target_kl, horizon
    (the names of verl's algorithm.kl_ctrl), and for type pi ki and integral_limit."""
    kind = kl_ctrl_cfg.type
    if kind == "fixed":
        return FixedKLController(kl_ctrl_cfg.kl_coef)
    if kind in ("adaptive", "pi"):
        return AdaptiveKLController(kl_ctrl_cfg.kl_coef, kl_ctrl_cfg.target_kl, kl_ctrl_cfg.horizon,
                                    getattr(kl_ctrl_cfg, "target_kl_interp", "step"),
                                    ki=getattr(kl_ctrl_cfg, "ki", 0.3) if kind == "pi" else 0.0,
                                    integral_limit=getattr(kl_ctrl_cfg, "integral_limit", 1.0),
                                    hold=getattr(kl_ctrl_cfg, "hold", 0))
    raise ValueError(f"unknown kl_ctrl.type {kind!r}; valid types are 'fixed', 'adaptive', 'pi'")


def make_kl_loss_controller(actor_cfg):
    """The KL loss's coefficient (actor_rollout_ref.actor): kl_loss_coef fixed, or, with
    kl_loss_ctrl.type adaptive, steered from kl_loss_coef toward kl_loss_ctrl.target_kl."""
    c = actor_cfg.kl_loss_ctrl
    if c.type == "fixed":
        return FixedKLController(actor_cfg.kl_loss_coef)
    return AdaptiveKLController(actor_cfg.kl_loss_coef, c.target_kl, c.horizon, c.target_kl_interp)

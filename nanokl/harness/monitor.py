"""The KL health monitor: is this run's KL where it should be, and should we act?

The idea
--------
The KL penalty keeps PPO honest: r = score - beta * KL(pi || pi_ref) lets the policy improve only
as far as the reference (and, with a learned reward, the region the reward model was trained on)
stays believable (Ziegler et al. 2019; Ouyang et al. 2022; Gao et al. 2023 on reward
over-optimisation). The adaptive controller (nanokl/kl_ctrl.py) steers the *mean* KL; the failures
a mean hides, and the ones a controller cannot fix, show in other numbers of the step. The
monitoring checklist of a practitioners' guide to tuning verl's KL thresholds (its numbers are
rules of thumb, not measurements) (KL mean
0.02-0.08, KL variance < 0.05, policy entropy > 0.2, reward variance < 2.0; early stop when KL >
0.2 five times in a row; roll back to the last checkpoint) becomes five checks on every step:

  check       fires when (cfg = trainer.kl_monitor)               metric it reads
  kl_band     KL < kl_low or KL > kl_high                         KL_KEYS: actor/reward_kl_penalty
                                                                  (KL in the reward), else actor/kl_loss
  kl_var      KL variance >= kl_var_max                           actor/reward_kl_var
  entropy     entropy <= entropy_min                              actor/entropy
  reward_var  reward variance >= reward_var_max                   critic/score/var
  collapse    KL > collapse_kl while entropy < collapse_entropy   both of the above
  critic      explained variance < critic_ev_min (0; the article   critic/vf_explained_var
              says 0.8, for dense rewards: config.py says why)
  kl_critical KL >= kl_critical (0.3), one step is enough           (the KL above)
  kl_stop     KL > kl_stop on kl_stop_patience consecutive        (the KL above)
              steps (fires at the patience-th, and every step
              after while the streak lasts)
  length_drift, degenerate, garbled, ratio_band: reward hacking (response length, repetition, the
              policy ratio), nanokl/harness/hacking.py

The metrics, as the trainer must log them (verl's names where verl has one):
  actor/reward_kl_penalty  mean over the step's responses of each response's per-token mean KL
                           (logged by train_ppo when algorithm.use_kl_in_reward)
  actor/kl_loss            the KL of the loss term (before kl_loss_coef), when the KL is in the
                           loss instead (actor.use_kl_loss)
  actor/reward_kl_var      population variance over the step's responses of that per-response KL
  actor/entropy            mean per-token entropy of the policy on the step's responses
  critic/score/var         population variance over the step's responses of the sequence score
A key that is absent skips its check for that step (a KL-free run has no KL to judge); values may
be floats or 0-d tensors.

What they mean. KL below the band: the policy is not moving (beta too high), expected in the first
steps since KL starts at 0. Above it: the policy drifts faster than the controller reacts. A high
KL *variance* says a few responses carry the KL: the policy found something specific (often an
exploit) rather than shifting as a whole. Entropy near 0 is mode collapse: one answer, no more
exploration. A reward variance far above the reference's (a normalised reward model gives 1 on
reference samples, nanokl/supervised/reward_model.py) is the signature of reward hacking. KL above kl_stop
for several steps in a row is a run the controller has lost.

Warning is not acting. The article warns outside 0.02-0.08 but acts only at KL > 0.15 (kl_weight
+50%) and KL < 0.01 (lower target_kl). So kl_band has two act thresholds, kl_high_act (0.15) and
kl_low_act (0.01): outside [kl_low, kl_high] the band warns; its adjust or rollback fires only beyond
the act threshold of that side, and between the edge and it the event is a warning that says so. A
config that wants a band acting at its edges sets kl_high_act = kl_high and kl_low_act = kl_low.

Quiet start. The KL starts at 0 and the critic untrained, by design, so the band's low side and the
critic check stay silent on steps 1..warmup (their fired metric reads 0 and no violation is
counted). warmup_steps(cfg) gives trainer.kl_monitor.warmup_steps, or when null the steps an
adaptive beta needs to double or halve at its fastest. The low side also waits while an adaptive
controller with `kl_ctrl.hold` still holds beta for the KL to first reach its target
(`actor/kl_ctrl_holding` reads 1): the KL is on its way up by design, for at most `hold` steps.
The high side and kl_stop never wait: a real early drift is still seen.

Each check has an action (`<check>_action`): "warn" (log it), "adjust" (turn a knob, below), "stop"
(save and end the run cleanly) or "rollback" (reload the last healthy checkpoint, multiply beta by
rollback_beta_factor, continue; trainer.kl_monitor.rollback_recipe picks other recipes, run.py).
Defaults: every check warns (the checklist is on for every run, changing no result); a config or the
command makes it act. After max_rollbacks rollbacks a further rollback
becomes a stop, so a run cannot loop forever.

Adjust: the article's remedies. The same article's table has a third column, what to do when a
check fails; `adjust` applies it. Each check has a rule `<check>_adjust` (kl_band has one per side,
kl_high_adjust and kl_low_adjust): a knob, and a factor to multiply it by or a value to set it to.
The defaults are the article's prescriptions:

  KL above the band          kl_weight x 1.5                (beta in the reward and/or the KL loss's weight)
  KL below it, score rising  target_kl x 0.7              (the adaptive controller's target; a KL below
                                                           the band while the score still rises: the
                                                           policy learns without needing the room)
  KL variance high           kl_type -> low_var_kl+       (the KL estimator in use: actor.kl_loss_type
                                                           with a KL loss, else algorithm.kl_penalty)
  entropy low                entropy_coeff -> 0.01        (the entropy bonus)
  collapse                   kl_weight x 1.2
  (ours) reward variance high  kl_weight x 1.5; critic weak  critic_lr x 2; kl_stop, kl_critical
                             kl_weight x 2
Escalation (trainer.kl_monitor.escalation, default "reference"): when the KL is above kl_high_act and
kl_high_adjust's knob sits at its limit (at it, not merely cooling down), the adjust turns
kl_high_escalate instead, actor_lr x 0.5 (never below 1e-6, at most every 5 steps, as beta), and under
"reference" also reloads the reference weights into the actor with its Adam moments dropped (the
offline article's remedy for KL > 0.15: lr to 1e-6 and reload SFT; remedies.reload_reference). "lr"
cuts the lr alone: measured, that does not cure a drift, since a policy already far away stays there
when it moves more slowly (README). "none": the warning of old.
Rules: a knob moves at most once per `cooldown` steps (the change must show in the next steps'
metrics before it is judged again) and a factor never takes it past `limit`; when neither lets it
move, or the knob does not exist in this run (target_kl under a fixed controller), the event is a
warning that says why. `check(step, metrics, knobs)` takes the knobs' current values and returns
each change in its Event; the trainer applies them (run.py). Changes are logged as
monitor/adjust/<knob> (the new value; 1 for a new kl_type) and kept in the state_dict.

Semantics, precisely. Thresholds are strict where the checklist says "<" or ">": KL exactly at
kl_low or kl_high is in the band, KL exactly at kl_stop does not count, entropy must stay *above*
entropy_min, the variances *below* their maxima. A NaN fails every check it enters (each test is
written as "not healthy", which NaN is not), so a NaN KL counts toward stopping. The kl_stop streak
counts consecutive steps that measured a KL: a step without one leaves it as it is; a step at or
below kl_stop sets it to 0.

Using it (train_ppo.py, when trainer.kl_monitor.enable):

    monitor = KLMonitor(cfg.trainer.kl_monitor)          # restore: monitor.load_state_dict(...)
    ...each step, after the metrics are complete:
    events = monitor.check(step, metrics)                # [Event(check, action, message)]
    metrics.update(monitor.metrics()); metrics["monitor/health"] = monitor.health
    for e in events: print(e.message)                    # or only when monitor.health != "warn"
    if monitor.health == "stop": save the checkpoint, end the run
    save checkpoints, remembering which were saved while monitor.rollback_safe
    if monitor.health == "rollback": reload the newest such checkpoint (weights, optimizer; NOT the
        monitor's own state), set beta (and kl_loss_coef when the KL is in the loss) to
        max(beta now, beta then, rollback_min_beta) * rollback_beta_factor, then
        monitor.rolled_back(); if there is no such checkpoint, stop.
KL below the band never triggers a rollback (raising beta would lower it further): with
kl_band_action = rollback that side only warns.

`health` is the one word for the console line: "ok" (nothing fired), else the gravest action
fired this step, "warn" < "rollback" < "stop". `metrics()` gives floats: monitor/healthy (1 when
nothing fired), monitor/<check>_fired (0/1 for each check that ran this step), monitor/
kl_band_violations (steps so far outside the band), monitor/kl_over_stop_streak, monitor/rollbacks,
monitor/escalations, monitor/length_rise (hacking.py), and monitor/action/<check> for each check that
fired: GRAVITY of its action (1 warn, 2 adjust, 3 rollback, 4 stop).
`state_dict()` / `load_state_dict()` carry all of it through a checkpoint, so a resumed run fires
exactly where an uninterrupted one would.

tests/test_monitor.py feeds scripted metric streams and checks, against steps written by hand,
that each check fires at exactly the step it should and not before, every action and escalation,
skipping of missing keys, NaN, and resume from a state_dict mid-stream.
"""

import math
from typing import NamedTuple

from nanokl.harness import hacking
from nanokl.harness.config.nanokl_keys import CHECKS

KL_KEYS = ("actor/reward_kl_penalty", "actor/kl_loss")  # the first present is the step's KL
KL_VAR_KEY = "actor/reward_kl_var"
ENTROPY_KEY = "actor/entropy"
REWARD_VAR_KEY = "critic/score/var"
EV_KEY = "critic/vf_explained_var"
SCORE_KEY = "critic/score/mean"

GRAVITY = {"warn": 1, "adjust": 2, "rollback": 3, "stop": 4}  # health word = the gravest action fired


class Event(NamedTuple):
    check: str  # one of CHECKS
    action: str  # "warn" | "adjust" | "stop" | "rollback" (a rollback past max_rollbacks arrives as "stop")
    message: str  # one line for the log
    change: tuple | None = None  # adjust: (knob, old value, new value)
    reload: bool = False  # an escalation with escalation=reference: reload the reference weights into the actor


def warmup_steps(cfg) -> int:
    """The quiet start of a full config (trainer.kl_monitor.warmup_steps, or when null): the steps an
    adaptive beta needs to double or halve at its fastest, each step moving it by at most
    1 + 0.2 N / horizon (nanokl/kl_ctrl.py), N the responses of a step: ceil(ln 2 / ln(1 + 0.2 N / horizon)),
    10 for arith_tiny (N = 128, horizon 320). Before that the controller has not had the time to act, so a
    KL below the band is its starting point, not its failure. A fixed controller never acts; it gets the
    same number from its (unused) horizon: the KL climbs from 0 at the pace the learning rate sets, which
    no key measures, and the KL-above side and kl_stop never wait, so a real early drift is still seen."""
    km = cfg.trainer.kl_monitor
    if km.warmup_steps is not None:
        return km.warmup_steps
    n = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    return math.ceil(math.log(2) / math.log1p(0.2 * n / cfg.algorithm.kl_ctrl.horizon))


def _read(metrics, key):
    """The metric as a float, or None when absent (a 0-d tensor or numpy scalar works too)."""
    v = metrics.get(key)
    return None if v is None else float(v)


class KLMonitor:
    def __init__(self, cfg, warmup: int | None = None):
        self.cfg = cfg  # a config.KLMonitorConfig
        # quiet start: the trainer passes warmup_steps(its config); alone, cfg.warmup_steps (null: none)
        self.warmup = warmup if warmup is not None else cfg.warmup_steps or 0
        self.kl_over_stop_streak = 0  # consecutive measured steps with KL > kl_stop
        self.kl_band_violations = 0  # steps so far with KL outside [kl_low, kl_high]
        self.rollbacks = 0  # rollbacks done (rolled_back calls)
        self.health = "ok"  # this step's word for the console
        self.fired = {}  # this step: check -> 1.0 fired / 0.0 passed, for the checks that ran
        self.last_adjusted = {}  # knob -> the step of its last change (cooldowns)
        self.adjusted = {}  # knob -> its value after the last change (restored on resume)
        self.changes = {}  # this step: knob -> new value
        self.scores = []  # the last 2 * score_window step scores ("is the score rising?")
        self.stop_armed = False  # the fixed_kl rollback recipe: kl_stop stops from now on
        self.actions = {}  # this step: check -> the action it took (monitor/action/<check>)
        self.escalations = 0  # kl_high escalations done (actor_lr cuts, with a reload under "reference")
        self.lengths, self.truths, self.vals = [], [], []  # hacking.py's windows: lengths, rule scores, val acc
        self.reps = []  # and the repetition (garbled)
        self.rise = None  # this step's relative length rise (monitor/length_rise), None until 2 windows

    def rising(self) -> bool:
        """The mean score of the last score_window steps is above that of the score_window before."""
        w = self.cfg.score_window
        return len(self.scores) == 2 * w and sum(self.scores[w:]) > sum(self.scores[:w])

    def _plan(self, rule, knobs: dict, step: int):
        """(knob, old, new) for `rule` now, or (None, why not)."""
        knob, cur = rule.knob, knobs.get(rule.knob)
        if cur is None:
            return None, f"; no {knob} to adjust in this run"
        last = self.last_adjusted.get(knob)
        if last is not None and step - last < rule.cooldown:
            return None, f"; {knob} cooling down until step {last + rule.cooldown}"
        if rule.factor is not None:
            new = cur * rule.factor
            if rule.limit is not None:
                new = min(new, rule.limit) if rule.factor > 1 else max(new, rule.limit)
                new = cur if self._at_limit(rule, knobs) else new  # already past it: leave it
        else:
            new = rule.value
        if new == cur:
            return None, f"; {knob} stays at {cur:g}" if isinstance(cur, float) else f"; {knob} is already {cur}"
        self.last_adjusted[knob], self.adjusted[knob] = step, new
        knobs[knob] = new  # a second rule on the same knob this step starts from here
        return (knob, cur, new), f" -> {knob} {cur:g} -> {new:g}" if isinstance(new, float) else f" -> {knob} {cur} -> {new}"

    @staticmethod
    def _at_limit(rule, knobs) -> bool:
        """A factor rule whose knob is at (or past) its limit: it cannot move, cooldown or not."""
        cur = knobs.get(rule.knob)
        return None not in (cur, rule.factor, rule.limit) and (cur - rule.limit) * (rule.factor - 1) >= 0

    def check(self, step: int, metrics: dict, knobs: dict | None = None) -> list[Event]:
        """Run every check whose metric is present; return the events that fired, in CHECKS order.
        `knobs`: the current value of each knob an adjust may turn (absent: none applies)."""
        c = self.cfg
        failed = {}  # check -> message
        self.fired, self.changes, knobs = {}, {}, dict(knobs or {})
        score = _read(metrics, SCORE_KEY)
        if score is not None:
            self.scores = (self.scores + [score])[-2 * c.score_window:]
        kl_key = next((k for k in KL_KEYS if k in metrics), None)
        kl = _read(metrics, kl_key) if kl_key else None
        side = None
        quiet = step <= self.warmup  # the quiet start: the low side and the critic wait
        holding = bool(_read(metrics, "actor/kl_ctrl_holding"))  # beta still waits for the KL (kl_ctrl.hold)
        if kl is not None:
            if not c.kl_low <= kl <= c.kl_high and not ((quiet or holding) and kl < c.kl_low):
                self.kl_band_violations += 1
                side = "kl_low" if kl < c.kl_low else "kl_high"
                failed["kl_band"] = f"KL {kl:.4g} outside the healthy band [{c.kl_low}, {c.kl_high}] ({kl_key})"
            self.fired["kl_band"] = 0.0
        for name, key, healthy, what in (
                ("kl_var", KL_VAR_KEY, lambda v: v < c.kl_var_max, f"KL variance {{:.4g}} >= {c.kl_var_max}"),
                ("entropy", ENTROPY_KEY, lambda v: v > c.entropy_min, f"entropy {{:.4g}} <= {c.entropy_min}"),
                ("reward_var", REWARD_VAR_KEY, lambda v: v < c.reward_var_max,
                 f"reward variance {{:.4g}} >= {c.reward_var_max}")):
            v = _read(metrics, key)
            if v is not None:
                self.fired[name] = 0.0
                if not healthy(v):  # NaN is not healthy
                    failed[name] = what.format(v) + f" ({key})"
        entropy = _read(metrics, ENTROPY_KEY)
        if kl is not None and entropy is not None:
            self.fired["collapse"] = 0.0
            if not (kl <= c.collapse_kl or entropy >= c.collapse_entropy):
                failed["collapse"] = (f"KL {kl:.4g} > {c.collapse_kl} while entropy {entropy:.4g} < "
                                      f"{c.collapse_entropy} (mode collapse)")
        ev = _read(metrics, EV_KEY)
        if ev is not None:
            self.fired["critic"] = 0.0
            if not ev >= c.critic_ev_min and not quiet:
                failed["critic"] = f"critic explained variance {ev:.4g} < {c.critic_ev_min} ({EV_KEY})"
        failed.update(hacking.check(self, step, metrics))
        if kl is not None:
            self.fired["kl_critical"] = 0.0
            if not kl < c.kl_critical:  # NaN fires too
                failed["kl_critical"] = (f"KL {kl:.4g} >= {c.kl_critical}, where the KL-tuning guide sees "
                                         f"out-of-memory and NaN losses ({kl_key})")
            self.kl_over_stop_streak = 0 if kl <= c.kl_stop else self.kl_over_stop_streak + 1  # NaN counts
            self.fired["kl_stop"] = 0.0
            if self.kl_over_stop_streak >= c.kl_stop_patience:
                failed["kl_stop"] = (f"KL {kl:.4g} > {c.kl_stop} for {self.kl_over_stop_streak} consecutive steps "
                                     f"(patience {c.kl_stop_patience})")

        events, self.actions = [], {}
        # kl_band acts (adjust, rollback) only beyond its act thresholds; NaN acts
        beyond = side == "kl_high" and not kl <= c.kl_high_act or side == "kl_low" and kl < c.kl_low_act
        for name in CHECKS:
            if name not in failed:
                continue
            self.fired[name] = 1.0
            action, note, change, reload = getattr(c, f"{name}_action"), "", None, False
            if name == "kl_band" and action in ("adjust", "rollback") and not beyond:
                act = c.kl_high_act if side == "kl_high" else c.kl_low_act
                action, note = "warn", f"; {action} acts only {'above' if side == 'kl_high' else 'below'} {act}"
            if name == "kl_stop" and self.stop_armed:
                action, note = "stop", "; armed by the fixed_kl rollback"
            if name == "kl_band" and action == "rollback" and kl < c.kl_low:
                # a rollback raises beta, which would push a KL that is already too low further down
                action, note = "warn", "; below the band a rollback would push the wrong way"
            elif action == "rollback" and self.rollbacks >= c.max_rollbacks:
                action, note = "stop", f"; {self.rollbacks} rollbacks done (max_rollbacks), stopping instead"
            elif action == "adjust":
                rule = getattr(c, f"{side if name == 'kl_band' else name}_adjust")
                if side == "kl_low" and name == "kl_band" and not self.rising():
                    note = "; the score is not rising: nothing to adjust"
                else:
                    change, note = self._plan(rule, knobs, step)
                    if change is None and side == "kl_high" and name == "kl_band" and c.escalation != "none" \
                            and self._at_limit(rule, knobs):  # beta can do no more: the step size is the cause
                        change, more = self._plan(c.kl_high_escalate, knobs, step)
                        reload = change is not None and c.escalation == "reference"
                        note += more + ("; reloaded the reference weights" if reload else "")
                        self.escalations += change is not None
                if change is None:
                    action = "warn"
                else:
                    self.changes[change[0]] = change[2]
            self.actions[name] = action
            events.append(Event(name, action, f"kl_monitor step {step}: {action}: {name}: {failed[name]}{note}",
                                change, reload))
        self.health = max((e.action for e in events), key=GRAVITY.get, default="ok")
        return events

    @property
    def rollback_safe(self) -> bool:
        """May a rollback return to a checkpoint of this step? Only if no check whose action is
        rollback or stop fired, and no KL > kl_stop streak is under way (a streak short of the
        patience has fired nothing yet, but those weights are already drifting away)."""
        return self.health in ("ok", "warn", "adjust") and self.kl_over_stop_streak == 0

    def metrics(self) -> dict[str, float]:
        """monitor/* floats of the latest check (see the module docstring)."""
        return {"monitor/healthy": float(self.health == "ok"),
                **{f"monitor/{name}_fired": v for name, v in self.fired.items()},
                "monitor/kl_band_violations": float(self.kl_band_violations),
                "monitor/kl_over_stop_streak": float(self.kl_over_stop_streak),
                "monitor/rollbacks": float(self.rollbacks),
                "monitor/escalations": float(self.escalations),
                **({} if self.rise is None else {"monitor/length_rise": self.rise}),
                **{f"monitor/action/{name}": float(GRAVITY[a]) for name, a in self.actions.items()},
                **{f"monitor/adjust/{k}": v if isinstance(v, float) else 1.0 for k, v in self.changes.items()}}

    def rolled_back(self):
        """The trainer has reloaded a healthy checkpoint: count it and start the streak again."""
        self.rollbacks += 1
        self.kl_over_stop_streak = 0

    def state_dict(self) -> dict:
        return {"kl_over_stop_streak": self.kl_over_stop_streak, "kl_band_violations": self.kl_band_violations,
                "rollbacks": self.rollbacks, "health": self.health,
                "fired": dict(self.fired), "last_adjusted": dict(self.last_adjusted), "adjusted": dict(self.adjusted),
                "changes": dict(self.changes), "scores": list(self.scores), "stop_armed": self.stop_armed,
                "actions": dict(self.actions), "escalations": self.escalations, "lengths": list(self.lengths),
                "truths": list(self.truths), "vals": list(self.vals), "rise": self.rise, "reps": list(self.reps)}

    def load_state_dict(self, state: dict):
        self.kl_over_stop_streak = int(state["kl_over_stop_streak"])
        self.kl_band_violations = int(state["kl_band_violations"])
        self.rollbacks = int(state["rollbacks"])
        self.health, self.fired = state["health"], {k: float(v) for k, v in state["fired"].items()}
        # (checkpoints from before adjust had none of these)
        self.last_adjusted = {k: int(v) for k, v in state.get("last_adjusted", {}).items()}
        self.adjusted, self.changes = dict(state.get("adjusted", {})), dict(state.get("changes", {}))
        self.scores = [float(v) for v in state.get("scores", [])]
        self.stop_armed = bool(state.get("stop_armed", False))
        # (checkpoints from before the hacking checks and escalation had none of these)
        self.actions, self.escalations = dict(state.get("actions", {})), int(state.get("escalations", 0))
        self.lengths, self.truths, self.vals = ([float(v) for v in state.get(k, [])]
                                                for k in ("lengths", "truths", "vals"))
        self.rise = state.get("rise")
        self.reps = [float(v) for v in state.get("reps", [])]  # (checkpoints from before garbled had none)

"""nanokl.harness.monitor: each check fires at exactly the step it should, against hand-written streams.

Every expected value below is written out by hand from the thresholds, not computed by the code
under test: the steps at which each check fires, the health word and action of each step, the
streak counts, and the metrics after each step.
"""

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from nanokl.harness.config.load import load_config
from nanokl.harness.config.nanokl_keys import KLMonitorConfig
from nanokl.harness.monitor import CHECKS, Event, KLMonitor

KL, KL_LOSS, KL_VAR, ENT, RVAR = ("actor/reward_kl_penalty", "actor/kl_loss", "actor/reward_kl_var",
                                  "actor/entropy", "critic/score/var")
HEALTHY = {KL: 0.05, KL_VAR: 0.01, ENT: 1.0, RVAR: 0.5}


def cfg(**kw):
    """The tests below were written for a band that acts at its edges (the behaviour before separate act
    thresholds, kept by setting them to the edges) and without escalation; tests/test_hacking.py tests
    the article's act thresholds, the escalation and the quiet start. They were also written for the early
    stop acting (kl_stop_action "stop", its default before the monitor went on by default, warn only), and
    before kl_critical (KL >= 0.3 in one step), which their streams reach: it is off (inf) unless a test sets
    it (test_kl_critical_*)."""
    kw.setdefault("kl_critical", math.inf)
    kw.setdefault("kl_stop_action", "stop")
    kw.setdefault("kl_high_act", kw.get("kl_high", 0.08))
    kw.setdefault("kl_low_act", kw.get("kl_low", 0.02))
    kw.setdefault("escalation", "none")
    return dataclasses.replace(KLMonitorConfig(enable=True), **kw)


def run(monitor, stream, first_step=1):
    """Feed metric dicts as steps first_step, first_step+1, ...; per step: (sorted fired (check, action)), health."""
    out = []
    for step, m in enumerate(stream, first_step):
        events = monitor.check(step, m)
        assert all(isinstance(e, Event) and e.message.startswith(f"kl_monitor step {step}: ") for e in events)
        out.append((sorted((e.check, e.action) for e in events), monitor.health))
    return out


def fire_steps(monitor, stream, check):
    """The steps (1-based) at which `check` fired."""
    return [step for step, (fired, _) in enumerate(run(monitor, stream), 1) if any(c == check for c, _ in fired)]


def test_defaults_are_the_checklist_numbers():
    c = KLMonitorConfig()
    assert (c.enable, c.kl_low, c.kl_high, c.kl_var_max, c.entropy_min, c.reward_var_max, c.kl_stop,
            c.kl_stop_patience) == (True, 0.02, 0.08, 0.05, 0.2, 2.0, 0.2, 5)  # on by default (issue 41)
    assert (c.kl_band_action, c.kl_var_action, c.entropy_action, c.reward_var_action, c.kl_stop_action) == \
        ("warn", "warn", "warn", "warn", "warn")  # warn only: acting is opt-in (kl_stop_action=stop)
    assert (c.rollback_beta_factor, c.max_rollbacks, c.rollback_min_beta) == (2.0, 3, 0.01)
    assert {f"{name}_action" for name in CHECKS} <= {f.name for f in dataclasses.fields(KLMonitorConfig)}


def test_kl_stop_fires_at_the_fifth_consecutive_step_and_not_before():
    kls = [0.3, 0.3, 0.3, 0.3, 0.05, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.05]
    #      1    2    3    4    5     6    7    8    9    10   11   12    (step)
    mon = KLMonitor(cfg())
    assert fire_steps(mon, [{KL: k} for k in kls], "kl_stop") == [10, 11]
    streaks = []
    mon = KLMonitor(cfg())
    for step, k in enumerate(kls, 1):
        mon.check(step, {KL: k})
        streaks.append(mon.metrics()["monitor/kl_over_stop_streak"])
    assert streaks == [1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0]
    words = [health for _, health in run(KLMonitor(cfg()), [{KL: k} for k in kls])]
    # 0.3 is also above the band (a warning) on every step it appears; the stop is graver
    assert words == ["warn"] * 4 + ["ok"] + ["warn"] * 4 + ["stop"] * 2 + ["ok"]


def test_kl_stop_reads_its_threshold_strictly_and_its_patience():
    mon = KLMonitor(cfg(kl_stop=0.1, kl_stop_patience=3, kl_low=0.0, kl_high=1.0))
    kls = [0.1, 0.1000001, 0.5, 0.1, 0.2, 0.2, 0.2, 0.2]  # exactly kl_stop does not count
    assert fire_steps(mon, [{KL: k} for k in kls], "kl_stop") == [7, 8]


@pytest.mark.parametrize("check, key, stream, expected", [
    # the band is closed: 0.02 and 0.08 are inside
    ("kl_band", KL, [0.0, 0.0199, 0.02, 0.05, 0.08, 0.0801, 0.06, 0.019], [1, 2, 6, 8]),
    # the variances must stay strictly below their maxima
    ("kl_var", KL_VAR, [0.0, 0.04, 0.0499, 0.05, 0.2, 0.01], [4, 5]),
    ("reward_var", RVAR, [1.0, 1.99, 2.0, 5.0, 1.0, 2.5], [3, 4, 6]),
    # entropy must stay strictly above entropy_min
    ("entropy", ENT, [1.0, 0.8, 0.5, 0.2001, 0.2, 0.1, 0.3], [5, 6]),
])
def test_each_level_check_fires_exactly_where_its_metric_crosses(check, key, stream, expected):
    mon = KLMonitor(cfg())
    steps = fire_steps(mon, [{**HEALTHY, key: v} for v in stream], check)
    assert steps == expected
    # and nothing else fired on a stream that is healthy everywhere else
    mon = KLMonitor(cfg())
    for step, (fired, health) in enumerate(run(mon, [{**HEALTHY, key: v} for v in stream]), 1):
        assert fired == ([(check, "warn")] if step in expected else []) and health == ("warn" if fired else "ok")


def test_a_healthy_stream_fires_nothing():
    mon = KLMonitor(cfg())
    assert run(mon, [HEALTHY] * 20) == [([], "ok")] * 20
    assert mon.metrics() == {"monitor/healthy": 1.0, "monitor/kl_band_fired": 0.0, "monitor/kl_var_fired": 0.0,
                             "monitor/entropy_fired": 0.0, "monitor/reward_var_fired": 0.0,
                             "monitor/collapse_fired": 0.0, "monitor/kl_critical_fired": 0.0,
                             "monitor/kl_stop_fired": 0.0, "monitor/kl_band_violations": 0.0,
                             "monitor/kl_over_stop_streak": 0.0, "monitor/rollbacks": 0.0,
                             "monitor/escalations": 0.0}
    assert mon.rollback_safe


def test_each_check_carries_its_own_action_and_health_is_the_gravest():
    mon = KLMonitor(cfg(kl_band_action="warn", kl_var_action="rollback", entropy_action="stop",
                        reward_var_action="rollback", kl_stop_action="warn", kl_stop_patience=1))
    stream = [{**HEALTHY, KL_VAR: 0.1},                           # 1 kl_var -> rollback
              {**HEALTHY, KL: 0.1},                               # 2 kl_band -> warn
              {**HEALTHY, RVAR: 3.0, KL: 0.1},                    # 3 band warn + reward_var rollback
              {**HEALTHY, ENT: 0.0, KL_VAR: 0.1},                 # 4 entropy stop + kl_var rollback
              {**HEALTHY, KL: 0.3},                               # 5 band warn + kl_stop warn
              HEALTHY]                                            # 6 nothing
    assert run(mon, stream) == [
        ([("kl_var", "rollback")], "rollback"),
        ([("kl_band", "warn")], "warn"),
        ([("kl_band", "warn"), ("reward_var", "rollback")], "rollback"),
        ([("entropy", "stop"), ("kl_var", "rollback")], "stop"),
        ([("kl_band", "warn"), ("kl_stop", "warn")], "warn"),
        ([], "ok")]


def test_events_come_in_check_order_with_a_message_naming_metric_and_threshold():
    mon = KLMonitor(cfg(kl_stop_patience=1))
    events = mon.check(7, {KL: 0.5, KL_VAR: 0.1, ENT: 0.1, RVAR: 3.0})
    assert [e.check for e in events] == ["kl_band", "kl_var", "entropy", "reward_var", "kl_stop"]
    assert [e.action for e in events] == ["warn"] * 4 + ["stop"]
    assert "0.5" in events[0].message and "[0.02, 0.08]" in events[0].message and KL in events[0].message
    assert "0.1" in events[1].message and "0.05" in events[1].message and KL_VAR in events[1].message
    assert ENT in events[2].message and RVAR in events[3].message
    assert events[4].message == ("kl_monitor step 7: stop: kl_stop: KL 0.5 > 0.2 for 1 consecutive steps "
                                 "(patience 1)")


def test_rollback_resets_the_streak_and_escalates_to_stop_after_max_rollbacks():
    mon = KLMonitor(cfg(kl_stop_action="rollback", kl_stop_patience=2, max_rollbacks=1, kl_low=0.0, kl_high=1.0))
    assert run(mon, [{KL: 0.05}]) == [([], "ok")] and mon.rollback_safe
    assert run(mon, [{KL: 0.3}], 2) == [([], "ok")] and not mon.rollback_safe  # nothing fired, but a streak is on
    assert run(mon, [{KL: 0.3}], 3) == [([("kl_stop", "rollback")], "rollback")] and not mon.rollback_safe
    mon.rolled_back()  # the trainer reloaded the step-1 checkpoint and raised beta
    assert mon.metrics()["monitor/rollbacks"] == 1.0 and mon.kl_over_stop_streak == 0
    # the streak starts again: the next fire is two steps later, and a second rollback is over the limit
    got = run(mon, [{KL: 0.3}, {KL: 0.3}], first_step=3)
    assert got == [([], "ok"), ([("kl_stop", "stop")], "stop")]
    assert "max_rollbacks" in mon.check(5, {KL: 0.3})[0].message


def test_max_rollbacks_zero_means_never_roll_back():
    mon = KLMonitor(cfg(entropy_action="rollback", max_rollbacks=0))
    assert run(mon, [{ENT: 0.1}]) == [([("entropy", "stop")], "stop")]


def test_band_violations_count_and_rollback_safety():
    mon = KLMonitor(cfg())
    run(mon, [{KL: 0.0}, {KL: 0.05}, {KL: 0.01}, {KL: 0.09}])
    assert mon.metrics()["monitor/kl_band_violations"] == 3.0
    assert mon.health == "warn" and mon.rollback_safe  # a warning alone does not make weights unsafe
    run(mon, [{KL: 0.05}, {KL: 0.5}], 5)
    assert mon.metrics()["monitor/kl_band_violations"] == 4.0
    assert not mon.rollback_safe  # KL above kl_stop: the streak has begun
    assert KLMonitor(cfg()).rollback_safe  # nothing checked yet: the starting point is safe


def test_kl_comes_from_the_reward_penalty_else_the_kl_loss():
    c = cfg(kl_stop_patience=1)
    assert run(KLMonitor(c), [{KL_LOSS: 0.5}]) == [([("kl_band", "warn"), ("kl_stop", "stop")], "stop")]
    # with both present the in-reward KL (the one the controller holds) is judged
    assert run(KLMonitor(c), [{KL: 0.05, KL_LOSS: 0.5}]) == [([], "ok")]


def test_missing_metrics_skip_their_checks_and_leave_the_streak():
    mon = KLMonitor(cfg())
    run(mon, [{KL: 0.3}, {KL: 0.3}])
    assert mon.check(3, {ENT: 1.0}) == []  # a step without a KL measurement
    assert mon.metrics() == {"monitor/healthy": 1.0, "monitor/entropy_fired": 0.0,
                             "monitor/kl_band_violations": 2.0, "monitor/kl_over_stop_streak": 2.0,
                             "monitor/rollbacks": 0.0, "monitor/escalations": 0.0}
    assert mon.check(4, {}) == [] and mon.health == "ok"
    run(mon, [{KL: 0.3}, {KL: 0.3}], first_step=5)
    assert mon.kl_over_stop_streak == 4
    assert [e.check for e in mon.check(7, {KL: 0.3})] == ["kl_band", "kl_stop"]  # the 5th measured step


def test_nan_fails_every_check_it_enters_and_counts_toward_stopping():
    mon = KLMonitor(cfg(kl_stop_patience=2))
    nan = math.nan
    assert run(mon, [{KL: nan, KL_VAR: nan, ENT: nan, RVAR: nan}]) == \
        [([("collapse", "warn"), ("entropy", "warn"), ("kl_band", "warn"), ("kl_critical", "warn"), ("kl_var", "warn"),
           ("reward_var", "warn")], "warn")]  # kl_critical too, though cfg() sets its level to inf
    assert mon.kl_over_stop_streak == 1
    assert run(mon, [{KL: nan}], first_step=2) == [([("kl_band", "warn"), ("kl_critical", "warn"), ("kl_stop", "stop")],
                                                    "stop")]


def test_tensor_metrics_are_read():
    mon = KLMonitor(cfg())
    assert [e.check for e in mon.check(1, {KL: torch.tensor(0.5), ENT: torch.tensor(0.1, dtype=torch.float64)})] == \
        ["kl_band", "entropy"]


def test_state_round_trip_resumes_exactly():
    c = load_config(None, ["trainer.kl_monitor.enable=true", "trainer.kl_monitor.kl_stop_action=rollback",
                           "trainer.kl_monitor.kl_stop_patience=3",
                           "trainer.kl_monitor.kl_critical=0.5"]).trainer.kl_monitor  # the stream's 0.3 is kl_stop's
    stream = [{**HEALTHY, KL: k, ENT: e} for k, e in
              [(0.05, 1.0), (0.3, 1.0), (0.3, 0.1), (0.05, 1.0), (0.3, 1.0), (0.3, 1.0), (0.3, 1.0), (0.3, 0.5)]]
    straight = KLMonitor(c)
    whole = [(run(straight, [m], step)[0], straight.metrics()) for step, m in enumerate(stream, 1)]
    # by hand: the kl_stop streak per step is 0,1,2,0,1,2,3,4 -> kl_stop fires at steps 7 and 8
    assert [w[0] for w in whole] == [
        ([], "ok"), ([("kl_band", "warn")], "warn"), ([("entropy", "warn"), ("kl_band", "warn")], "warn"),
        ([], "ok"), ([("kl_band", "warn")], "warn"), ([("kl_band", "warn")], "warn"),
        ([("kl_band", "warn"), ("kl_stop", "rollback")], "rollback"),
        ([("kl_band", "warn"), ("kl_stop", "rollback")], "rollback")]
    first = KLMonitor(c)
    for step, m in enumerate(stream[:5], 1):
        first.check(step, m)
    state = first.state_dict()
    resumed = KLMonitor(c)
    resumed.load_state_dict(dict(state))
    assert resumed.metrics() == whole[4][1] and resumed.health == whole[4][0][1]
    rest = [(run(resumed, [m], step)[0], resumed.metrics()) for step, m in enumerate(stream[5:], 6)]
    assert rest == whole[5:]
    assert resumed.state_dict() == straight.state_dict()
    assert not straight.rollback_safe and not resumed.rollback_safe


def test_kl_below_the_band_warns_instead_of_rolling_back():
    mon = KLMonitor(cfg(kl_band_action="rollback"))
    assert run(mon, [{KL: 0.0}, {KL: 0.05}, {KL: 0.09}]) == [
        ([("kl_band", "warn")], "warn"), ([], "ok"), ([("kl_band", "rollback")], "rollback")]


# ---------------------------------------------------------------------------------------------
# adjust: the remedies, with cooldowns and limits; each change written out by hand

from nanokl.harness.config.nanokl_keys import AdjustRule  # noqa: E402

SCORE, EV = "critic/score/mean", "critic/vf_explained_var"


def drive(monitor, stream, knobs, first_step=1):
    """Feed steps like the trainer: check with the current knobs, then apply the changes.
    Returns per step the (knob, old, new) changes and the actions of the events."""
    out = []
    for step, m in enumerate(stream, first_step):
        events = monitor.check(step, m, knobs)
        for e in events:
            if e.change:
                knobs[e.change[0]] = e.change[2]
        out.append(([e.change for e in events if e.change], sorted((e.check, e.action) for e in events)))
    return out


def test_kl_high_multiplies_kl_weight_once_per_cooldown_up_to_its_limit():
    mon = KLMonitor(cfg(kl_band_action="adjust", kl_high_adjust=AdjustRule("kl_weight", factor=1.5, limit=0.2,
                                                                            cooldown=3)))
    knobs = {"kl_weight": 0.05}
    got = drive(mon, [{KL: 0.12}] * 14, knobs)
    changes = {step: c[0] for step, (c, _) in enumerate(got, 1) if c}
    assert changes == {1: ("kl_weight", 0.05, 0.05 * 1.5), 4: ("kl_weight", 0.05 * 1.5, 0.05 * 1.5 * 1.5),
                       7: ("kl_weight", 0.05 * 1.5 * 1.5, 0.05 * 1.5 ** 3), 10: ("kl_weight", 0.05 * 1.5 ** 3, 0.2)}
    assert knobs["kl_weight"] == 0.2  # 0.253 capped at the limit; step 13 finds it there and only warns
    assert [actions for _, actions in got] == [[("kl_band", "adjust" if s in changes else "warn")] for s in range(1, 15)]
    assert mon.state_dict()["adjusted"] == {"kl_weight": 0.2} and mon.last_adjusted == {"kl_weight": 10}
    mon.check(15, {KL: 0.12}, {"kl_weight": 0.2})
    assert "kl_weight stays at 0.2" in mon.check(16, {KL: 0.12}, {"kl_weight": 0.2})[0].message


def test_kl_low_lowers_target_kl_only_while_the_score_rises():
    mon = KLMonitor(cfg(kl_band_action="adjust", score_window=2,
                        kl_low_adjust=AdjustRule("target_kl", factor=0.7, limit=0.02, cooldown=2)))
    scores = [0.1, 0.1, 0.1, 0.1, 0.2, 0.3, 0.3, 0.3, 0.3, 0.5, 0.6]
    #         1    2    3    4    5    6    7    8    9    10   11
    # rising (mean of the last 2 > mean of the 2 before) at steps 5, 6, 7, 10, 11; never before 4 scores
    knobs = {"target_kl": 0.05}
    got = drive(mon, [{KL: 0.01, SCORE: s} for s in scores], knobs)
    changes = {step: c[0] for step, (c, _) in enumerate(got, 1) if c}
    # 5: 0.05 -> 0.035; 6: cooling down; 7: 0.035 -> 0.0245; 10: 0.0245 * 0.7 = 0.01715 -> the limit 0.02;
    # 11: cooling down
    assert changes == {5: ("target_kl", 0.05, 0.05 * 0.7), 7: ("target_kl", 0.05 * 0.7, 0.05 * 0.7 * 0.7),
                       10: ("target_kl", 0.05 * 0.7 * 0.7, 0.02)}
    assert mon.rising() is True
    events = KLMonitor(cfg(kl_band_action="adjust")).check(1, {KL: 0.01, SCORE: 0.1}, {"target_kl": 0.05})
    assert events[0].action == "warn" and "score is not rising" in events[0].message


def test_kl_var_switches_the_kl_type_once_and_entropy_sets_the_bonus():
    mon = KLMonitor(cfg(kl_var_action="adjust", entropy_action="adjust"))
    knobs = {"kl_type": "kl", "entropy_coeff": 0.0}
    stream = [{**HEALTHY, KL_VAR: 0.2}, HEALTHY, {**HEALTHY, KL_VAR: 0.3, ENT: 0.1}, {**HEALTHY, KL_VAR: 0.3}]
    got = drive(mon, stream, knobs)
    assert [c for c, _ in got] == [[("kl_type", "kl", "low_var_kl+")], [], [("entropy_coeff", 0.0, 0.01)], []]
    assert got[2][1] == [("entropy", "adjust"), ("kl_var", "warn")]  # already low_var_kl+: nothing to switch
    assert knobs == {"kl_type": "low_var_kl+", "entropy_coeff": 0.01}
    mon.check(13, {**HEALTHY, ENT: 0.05}, {"kl_type": "low_var_kl+", "entropy_coeff": 0.0})  # cooldown 10 over
    assert mon.metrics()["monitor/adjust/entropy_coeff"] == 0.01  # logged on the step of the change


def test_collapse_and_critic_checks_fire_where_their_metrics_cross():
    stream = [(0.1, 0.05), (0.16, 0.2), (0.16, 0.099), (0.15, 0.01), (0.3, 0.1), (0.3, 0.0)]
    #          1            2            3              4             5            6
    # collapse: KL > 0.15 and entropy < 0.1 -> steps 3 and 6 (0.15 is not above, 0.1 is not below)
    mon = KLMonitor(cfg(kl_high=1.0, kl_stop=5.0))
    assert fire_steps(mon, [{KL: k, ENT: e} for k, e in stream], "collapse") == [3, 6]
    # critic: explained variance below critic_ev_min (strictly; default 0), NaN fails
    assert KLMonitorConfig().critic_ev_min == 0.0 and KLMonitorConfig().critic_action == "warn"
    mon = KLMonitor(cfg(critic_ev_min=0.2))
    assert fire_steps(mon, [{EV: v} for v in [0.5, 0.2, 0.1999, -1.0, math.nan, 0.9]], "critic") == [3, 4, 5]
    assert fire_steps(KLMonitor(cfg()), [{EV: v} for v in [0.05, 0.0, -0.001]], "critic") == [3]


def test_collapse_adjust_and_kl_high_adjust_share_kl_weight_and_its_cooldown():
    mon = KLMonitor(cfg(kl_band_action="adjust", collapse_action="adjust", kl_stop=5.0))
    knobs = {"kl_weight": 0.1}
    got = drive(mon, [{KL: 0.3, ENT: 0.05}] * 6, knobs)
    # step 1: kl_band first (CHECKS order): 0.1 * 1.5; collapse finds kl_weight cooling down (cooldown 5)
    assert got[0] == ([("kl_weight", 0.1, 0.1 * 1.5)], [("collapse", "warn"), ("entropy", "warn"), ("kl_band", "adjust")])
    assert got[5][0] == [("kl_weight", 0.1 * 1.5, 0.1 * 1.5 * 1.5)]  # step 6: the cooldown of 5 is over
    assert [c for c, _ in got[1:5]] == [[]] * 4


def test_a_knob_the_run_lacks_is_a_warning_that_says_so():
    mon = KLMonitor(cfg(kl_band_action="adjust", score_window=1))
    mon.check(1, {KL: 0.01, SCORE: 0.1}, {})
    e = mon.check(2, {KL: 0.01, SCORE: 0.2}, {"kl_weight": 0.05})  # rising, but a fixed controller has no target
    assert e[0].action == "warn" and "no target_kl to adjust" in e[0].message


def test_adjustments_survive_a_resume_mid_cooldown():
    def fresh():
        return KLMonitor(cfg(kl_band_action="adjust", kl_high_adjust=AdjustRule("kl_weight", factor=2.0, cooldown=4)))
    stream = [{KL: k} for k in (0.1, 0.1, 0.1, 0.05, 0.1, 0.1, 0.1, 0.1)]
    straight = drive(fresh(), stream, {"kl_weight": 0.01})
    first = fresh()
    knobs = {"kl_weight": 0.01}
    head = drive(first, stream[:2], knobs)
    second = fresh()
    second.load_state_dict(first.state_dict())  # a checkpoint after step 2, in the middle of the cooldown
    assert head + drive(second, stream[2:], knobs, first_step=3) == straight
    assert [step for step, (c, _) in enumerate(straight, 1) if c] == [1, 5]


def test_fixed_kl_arms_the_stop():
    mon = KLMonitor(cfg(kl_stop_action="warn", kl_stop_patience=1, kl_high=1.0))
    assert mon.check(1, {KL: 0.5})[0].action == "warn"
    mon.stop_armed = True
    assert mon.check(2, {KL: 0.5})[0].action == "stop" and mon.health == "stop"


def test_kl_critical_fires_on_the_first_step_at_or_above_0_3_and_never_below():
    """The guide's OOM/NaN level: no patience, >= (0.3 itself fires), NaN fires, 0.2999 does not; its
    action is its own (stop in the conservative preset), and the default is a warning."""
    stream = [{**HEALTHY, KL: v} for v in (0.05, 0.2999, 0.3, 0.1, 0.45, math.nan)]
    assert fire_steps(KLMonitor(cfg(kl_critical=0.3)), stream, "kl_critical") == [3, 5, 6]
    assert KLMonitorConfig().kl_critical == 0.3 and KLMonitorConfig().kl_critical_action == "warn"
    mon = KLMonitor(cfg(kl_critical=0.3, kl_critical_action="stop", kl_stop_action="warn"))
    out = run(mon, stream[:3])
    assert out[2] == ([("kl_band", "warn"), ("kl_critical", "stop")], "stop")  # kl_stop's streak is 2: not yet
    assert mon.metrics()["monitor/kl_critical_fired"] == 1.0 and mon.metrics()["monitor/action/kl_critical"] == 4.0
    mon = KLMonitor(cfg(kl_critical=0.3))
    events = mon.check(1, {**HEALTHY, KL: 0.31})
    assert [e.check for e in events] == ["kl_band", "kl_critical"] and "0.31 >= 0.3" in events[1].message
    mon.check(2, {KL_VAR: 0.01})  # no KL this step: the check does not run
    assert "monitor/kl_critical_fired" not in mon.metrics()


def test_kl_critical_in_the_preset_that_acts():
    from nanokl.harness.config.load import load_config
    root = Path(__file__).resolve().parents[1]
    km = load_config(root / "configs" / "presets" / "conservative.yaml").trainer.kl_monitor
    assert (km.kl_critical, km.kl_critical_action) == (0.3, "stop")

"""The KL monitor's act thresholds, escalation, quiet start and reward-hacking checks (monitor.py,
hacking.py), against streams whose firing steps and values are written out by hand; the two new
metrics against naive loops; and a short real run with a planted exploit (a reward that pays for length).
"""

import dataclasses
import math

import pytest
import torch

from nanokl.harness.config.load import load_config
from nanokl.harness.config.nanokl_keys import KLMonitorConfig
from nanokl.harness.hacking import ratio_out_band
from nanokl.harness.metrics import repetition
from nanokl.harness.monitor import GRAVITY, KLMonitor, warmup_steps

KL, EV, SCORE, RULE, LEN = ("actor/reward_kl_penalty", "critic/vf_explained_var", "critic/score/mean",
                            "critic/rule_score/mean", "response_length/mean")
REP, CLIP, RATIO, HOLD = "response_repetition/mean", "response_length/clip_ratio", "actor/ratio_out_band", \
    "actor/kl_ctrl_holding"
KNOBS = {"kl_weight": 0.05, "target_kl": 0.05, "actor_lr": 2e-5}


def cfg(**kw):
    kw.setdefault("kl_critical", math.inf)  # written before kl_critical (test_monitor.py tests it); streams reach 0.3
    return dataclasses.replace(KLMonitorConfig(enable=True), **kw)


def events(mon, stream, knobs=None):
    """{step: [(check, action, change, reload)]} of the steps where something fired (steps from 1)."""
    out = {}
    for step, m in enumerate(stream, 1):
        fired = [(e.check, e.action, e.change, e.reload) for e in mon.check(step, m, dict(knobs or {}))]
        if fired:
            out[step] = fired
    return out


# ---- separate act thresholds: the band warns at its edges, acts only beyond 0.15 / 0.01 ----------

def test_the_defaults_are_the_articles_numbers():
    c = KLMonitorConfig()
    assert (c.kl_low, c.kl_high, c.kl_high_act, c.kl_low_act) == (0.02, 0.08, 0.15, 0.01)
    assert (c.kl_high_adjust.knob, c.kl_high_adjust.factor, c.kl_low_adjust.knob) == ("kl_weight", 1.5, "target_kl")
    assert (c.escalation, c.kl_high_escalate.knob, c.kl_high_escalate.factor, c.kl_high_escalate.limit,
            c.kl_high_escalate.cooldown) == ("reference", "actor_lr", 0.5, 1e-6, 5)
    for preset, acts in (("aggressive", (0.15, 0.01)), ("conservative", (0.1, 0.005))):  # conservative: measured
        m = load_config(f"configs/presets/{preset}.yaml").trainer.kl_monitor
        assert (m.kl_high_act, m.kl_low_act) == acts


def test_kl_high_warns_between_the_edge_and_0_15_and_adjusts_beyond():
    mon = KLMonitor(cfg(kl_band_action="adjust"))
    # step: 1 in band, 2 just above the edge, 3 exactly the act threshold (not beyond), 4 beyond, 5 beyond (cooling)
    got = events(mon, [{KL: 0.08}, {KL: 0.0801}, {KL: 0.15}, {KL: 0.1501}, {KL: 0.3}], KNOBS)
    assert got == {2: [("kl_band", "warn", None, False)], 3: [("kl_band", "warn", None, False)],
                   4: [("kl_band", "adjust", ("kl_weight", 0.05, 0.05 * 1.5), False)],
                   5: [("kl_band", "warn", None, False)]}


def test_kl_low_adjusts_only_below_0_01_and_only_while_the_score_rises():
    mon = KLMonitor(cfg(kl_band_action="adjust", score_window=1))
    stream = [{KL: 0.05, SCORE: 0.1}, {KL: 0.015, SCORE: 0.2}, {KL: 0.01, SCORE: 0.3}, {KL: 0.0099, SCORE: 0.4},
              {KL: 0.005, SCORE: 0.3}]
    got = events(mon, stream, KNOBS)
    assert got == {2: [("kl_band", "warn", None, False)], 3: [("kl_band", "warn", None, False)],
                   4: [("kl_band", "adjust", ("target_kl", 0.05, 0.05 * 0.7), False)],
                   5: [("kl_band", "warn", None, False)]}  # score fell: nothing to adjust


def test_a_rollback_too_waits_for_the_act_threshold():
    mon = KLMonitor(cfg(kl_band_action="rollback"))
    assert [e.action for e in mon.check(1, {KL: 0.12})] == ["warn"]
    assert [e.action for e in mon.check(2, {KL: 0.16})] == ["rollback"]


# ---- escalation: beta at its limit and KL still beyond 0.15 -> cut the actor's lr (and reload) ---

def test_escalation_cuts_the_lr_once_beta_is_at_its_limit_and_reloads_the_reference():
    mon = KLMonitor(cfg(kl_band_action="adjust"))
    knobs = {"kl_weight": 0.8, "actor_lr": 4e-6}
    got = {}
    for step in range(1, 13):
        evs = mon.check(step, {KL: 0.2}, dict(knobs))
        for e in evs:
            if e.change:
                knobs[e.change[0]] = e.change[2]
        got[step] = [(e.action, e.change, e.reload) for e in evs if e.check == "kl_band"][0]
    # step 1: beta 0.8 -> 1.0 (capped at its limit); from step 2 beta is at its limit (and cooling): escalate at 2
    # (lr 4e-6 -> 2e-6, reload), the lr cools down for 5 steps; step 7: 2e-6 -> 1e-6 (its limit); step 12: the lr
    # is at its limit: a warning
    assert got[1] == ("adjust", ("kl_weight", 0.8, 1.0), False)
    assert got[2] == ("adjust", ("actor_lr", 4e-6, 2e-6), True)
    assert all(got[s] == ("warn", None, False) for s in range(3, 7))
    assert got[7] == ("adjust", ("actor_lr", 2e-6, 1e-6), True)
    assert all(got[s] == ("warn", None, False) for s in range(8, 13))
    assert mon.escalations == 2 and mon.metrics()["monitor/escalations"] == 2.0


def test_no_escalation_while_beta_merely_cools_down_nor_between_the_edge_and_0_15():
    mon = KLMonitor(cfg(kl_band_action="adjust"))
    assert [e.change for e in mon.check(1, {KL: 0.2}, {"kl_weight": 0.1, "actor_lr": 1e-5})] == \
        [("kl_weight", 0.1, 0.1 * 1.5)]
    assert [e.change for e in mon.check(2, {KL: 0.2}, {"kl_weight": 0.15, "actor_lr": 1e-5})] == [None]  # cooling
    assert [e.change for e in mon.check(3, {KL: 0.12}, {"kl_weight": 1.0, "actor_lr": 1e-5})] == [None]  # below act


@pytest.mark.parametrize("escalation, change, reload", [("lr", ("actor_lr", 1e-5, 5e-6), False),
                                                         ("reference", ("actor_lr", 1e-5, 5e-6), True),
                                                         ("none", None, False)])
def test_escalation_modes(escalation, change, reload):
    mon = KLMonitor(cfg(kl_band_action="adjust", escalation=escalation))
    (e,) = mon.check(1, {KL: 0.5}, {"kl_weight": 1.0, "actor_lr": 1e-5})
    assert (e.change, e.reload, e.action) == (change, reload, "adjust" if change else "warn")


# ---- quiet start -----------------------------------------------------------------------------

def test_warmup_is_the_steps_beta_needs_to_double():
    tiny = load_config("configs/arith_tiny.yaml")
    # by hand: 128 responses a step, horizon 320 -> beta moves by at most 8% a step; 1.08^9 = 1.99900 < 2,
    # 1.08^10 = 2.15892 >= 2 -> 10 steps. At 64 a step (4%): 1.04^17 = 1.9479 < 2, 1.04^18 = 2.0258 -> 18;
    # at 640 (2%): 1.02^35 = 1.99989 < 2, 1.02^36 = 2.03989 -> 36; at 64 (20%): 1.2^3 = 1.728, 1.2^4 = 2.0736 -> 4
    assert warmup_steps(tiny) == 10
    half = ["data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=32"]
    assert warmup_steps(load_config("configs/arith_tiny.yaml", half)) == 18
    assert warmup_steps(load_config("configs/arith_tiny.yaml", [*half, "algorithm.kl_ctrl.horizon=640"])) == 36
    assert warmup_steps(load_config("configs/arith_tiny.yaml", ["trainer.kl_monitor.warmup_steps=5"])) == 5
    assert warmup_steps(load_config("configs/arith_tiny.yaml", [*half, "algorithm.kl_ctrl.horizon=64"])) == 4


def test_the_low_side_and_the_critic_wait_the_high_side_and_kl_stop_do_not():
    mon = KLMonitor(cfg(kl_stop_patience=2, kl_stop_action="stop"), warmup=3)
    stream = [{KL: 0.001, EV: -0.5}, {KL: 0.5, EV: -0.5}, {KL: 0.5, EV: -0.5}, {KL: 0.001, EV: -0.5}]
    got = events(mon, stream)
    assert got == {2: [("kl_band", "warn", None, False)],
                   3: [("kl_band", "warn", None, False), ("kl_stop", "stop", None, False)],
                   4: [("kl_band", "warn", None, False), ("critic", "warn", None, False)]}
    assert mon.kl_band_violations == 3  # steps 2, 3, 4: the quiet step 1 is no violation


def test_the_low_side_also_waits_while_beta_holds_for_the_kl():
    """kl_ctrl.hold: the trainer logs actor/kl_ctrl_holding 1 while beta waits for the KL to first reach
    its target; the low side is quiet on those steps, past the warm-up too, and speaks once it reads 0."""
    mon = KLMonitor(cfg(), warmup=1)
    stream = [{KL: 0.001, HOLD: 1.0}, {KL: 0.001, HOLD: 1.0}, {KL: 0.5, HOLD: 1.0}, {KL: 0.001, HOLD: 0.0},
              {KL: 0.001}]
    assert events(mon, stream) == {3: [("kl_band", "warn", None, False)], 4: [("kl_band", "warn", None, False)],
                                   5: [("kl_band", "warn", None, False)]}


# ---- reward hacking --------------------------------------------------------------------------

def drift_stream(lengths, scores, rules):
    return [{LEN: l, SCORE: s, RULE: r} for l, s, r in zip(lengths, scores, rules)]


def test_length_drift_fires_beyond_its_rise_while_the_score_rises_and_the_rule_does_not():
    c = cfg(length_drift_min=0.25, score_window=2, length_drift_action="adjust")
    # windows of 2: steps 1-2 vs 3-4. Length 16 -> 20 is a rise of exactly 0.25: no fire; 20.0001: fires
    flat, up = [0.5] * 4, [0.1, 0.1, 0.9, 0.9]
    assert events(KLMonitor(c), drift_stream([16, 16, 20, 20], up, flat), KNOBS) == {}
    got = events(KLMonitor(c), drift_stream([16, 16, 20.0001, 20.0001], up, flat), KNOBS)
    assert got == {4: [("length_drift", "adjust", ("kl_weight", 0.05, 0.05 * 1.5), False)]}
    mon = KLMonitor(c)
    events(mon, drift_stream([16, 16, 20.0001, 20.0001], up, flat), KNOBS)
    assert mon.metrics()["monitor/length_rise"] == pytest.approx(4.0001 / 16)
    assert mon.metrics()["monitor/action/length_drift"] == GRAVITY["adjust"]
    # the rule score rises too (the length is earned), or the score does not rise: nothing
    assert events(KLMonitor(c), drift_stream([16, 16, 24, 24], up, [0.1, 0.1, 0.2, 0.2])) == {}
    assert events(KLMonitor(c), drift_stream([16, 16, 24, 24], [0.5] * 4, flat)) == {}


def test_length_drift_reads_the_held_out_accuracy_without_a_rule_score():
    c = cfg(length_drift_min=0.25, score_window=2)
    val = "val-core/arith/acc/mean@1"
    stream = [{LEN: 16, SCORE: 0.1, val: 0.6}, {LEN: 16, SCORE: 0.1}, {LEN: 24, SCORE: 0.9},
              {LEN: 24, SCORE: 0.9, val: 0.6}]
    assert events(KLMonitor(c), stream) == {4: [("length_drift", "warn", None, False)]}
    stream[3][val] = 0.61  # the held-out accuracy rose: the length is earned
    assert events(KLMonitor(c), stream) == {}
    mon = KLMonitor(c)
    events(mon, [{LEN: 16, SCORE: 0.1}, {LEN: 16, SCORE: 0.1}, {LEN: 24, SCORE: 0.9}, {LEN: 24, SCORE: 0.9}])
    assert "monitor/length_drift_fired" not in mon.metrics()  # no truth at all: the check does not run


@pytest.mark.parametrize("key, values, threshold, expected", [
    (REP, [0.0, 0.4999, 0.5, 0.5001, 0.9, 0.2], {}, [4, 5]),
    (CLIP, [0.0, 0.5, 0.5001, 1.0, 0.1], {}, [3, 4]),
    (REP, [0.1, 0.3, 0.31], {"repetition_max": 0.3}, [3]),
])
def test_degenerate_fires_strictly_above_its_thresholds(key, values, threshold, expected):
    mon = KLMonitor(cfg(**threshold))
    assert list(events(mon, [{key: v} for v in values])) == expected


def test_ratio_band_fires_strictly_above_its_share_and_halves_the_lr():
    mon = KLMonitor(cfg(ratio_band_action="adjust"))
    got = events(mon, [{RATIO: 0.1}, {RATIO: 0.2}, {RATIO: 0.2001}, {RATIO: 0.5}], KNOBS)
    assert got == {3: [("ratio_band", "adjust", ("actor_lr", 2e-5, 1e-5), False)],
                   4: [("ratio_band", "warn", None, False)]}  # cooling down
    assert mon.metrics()["monitor/action/ratio_band"] == GRAVITY["warn"]


def test_degenerate_adjust_and_rollback_and_nan():
    mon = KLMonitor(cfg(degenerate_action="adjust"))
    assert events(mon, [{REP: 0.6}], KNOBS) == {1: [("degenerate", "adjust", ("kl_weight", 0.05, 0.05 * 1.5), False)]}
    mon = KLMonitor(cfg(degenerate_action="rollback"))
    assert events(mon, [{CLIP: 0.9}]) == {1: [("degenerate", "rollback", None, False)]}
    assert events(KLMonitor(cfg()), [{RATIO: math.nan}]) == {1: [("ratio_band", "warn", None, False)]}


def test_state_round_trip_with_windows_escalations_and_actions():
    c = cfg(kl_band_action="adjust", length_drift_min=0.25, score_window=2, degenerate_action="adjust")
    stream = [{KL: 0.2, LEN: 16, SCORE: 0.1, RULE: 0.5}, {KL: 0.2, LEN: 16, SCORE: 0.1, RULE: 0.5},
              {KL: 0.2, LEN: 24, SCORE: 0.9, RULE: 0.5, REP: 0.6}, {KL: 0.2, LEN: 24, SCORE: 0.9, RULE: 0.5},
              {KL: 0.2, LEN: 24, SCORE: 0.9, RULE: 0.5, REP: 0.7}, {KL: 0.01, LEN: 30, SCORE: 0.9, RULE: 0.5}]

    def feed(mon, steps, knobs):
        out = []
        for step in steps:
            evs = mon.check(step, stream[step - 1], knobs)
            for e in evs:
                if e.change:
                    knobs[e.change[0]] = e.change[2]
            out.append(([(e.check, e.action, e.change, e.reload) for e in evs], mon.metrics()))
        return out

    straight_knobs = {"kl_weight": 1.0, "actor_lr": 1e-5}
    straight = KLMonitor(c, warmup=2)
    whole = feed(straight, range(1, 7), straight_knobs)
    first_knobs = {"kl_weight": 1.0, "actor_lr": 1e-5}
    first = KLMonitor(c, warmup=2)
    feed(first, range(1, 4), first_knobs)
    resumed = KLMonitor(c, warmup=2)
    resumed.load_state_dict(first.state_dict())
    assert feed(resumed, range(4, 7), first_knobs) == whole[3:]
    assert resumed.state_dict() == straight.state_dict()
    assert whole[0][0] == [("kl_band", "adjust", ("actor_lr", 1e-5, 5e-6), True)]  # beta at its limit: escalate
    assert whole[3][0] == [("kl_band", "warn", None, False), ("length_drift", "warn", None, False)]


# ---- the metrics, against naive loops ----------------------------------------------------------

def test_repetition_is_the_share_of_repeated_3grams():
    responses = torch.tensor([[7, 7, 7, 7, 7, 0], [1, 2, 3, 1, 2, 3], [5, 6, 0, 0, 0, 0], [1, 2, 3, 4, 9, 9]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1] * 6, [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
    # by hand: 3 grams, 1 distinct -> 2/3; (1,2,3),(2,3,1),(3,1,2),(1,2,3) -> 1/4; < 3 tokens -> 0;
    # (1,2,3),(2,3,4) (the padded 9s do not count) -> 0
    assert repetition(responses, mask).tolist() == pytest.approx([2 / 3, 1 / 4, 0.0, 0.0])


def test_ratio_out_band_against_a_float64_loop():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(6, 9, generator=g) - 2
    new = old + 0.3 * torch.randn(6, 9, generator=g)
    mask = (torch.rand(6, 9, generator=g) > 0.3).float()
    new[mask == 0] = -math.inf  # padding may hold anything
    n = inside = 0
    for i in range(6):
        for t in range(9):
            if mask[i, t]:
                n += 1
                r = math.exp(float(new[i, t].double()) - float(old[i, t].double()))
                inside += 0.8 <= r <= 1.2
    assert ratio_out_band(old, new, mask).item() == pytest.approx(1 - inside / n, abs=1e-7)


# ---- a planted exploit in a short real run -------------------------------------------------------

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def eos_sft(tmp_path_factory):
    """A one-layer warm start trained long enough to end most answers with EOS (conftest's sft_dir, 40
    steps, runs to the length limit on 7 responses in 8: nothing left to exploit), ~30 s of CPU."""
    from nanokl.supervised.sft import train_sft
    out = tmp_path_factory.mktemp("eos_sft")
    train_sft(load_config(ROOT / "configs" / "arith_tiny.yaml",
                          ["sft.steps=150", "sft.batch_size=16", "sft.num_examples=512", "data.num_val=16",
                           "sft.hidden_size=32", "sft.intermediate_size=64", "sft.num_hidden_layers=1",
                           f"sft.output_dir={out}"]), progress=False)
    return out


def test_a_reward_that_pays_for_length_trips_the_degenerate_check_and_its_adjust_acts(eos_sft, tmp_path):
    """tests/planted_reward.py pays a point per 10 characters: the policy learns to stop ending its answers
    and runs into the length limit. The degenerate check (length_limit_max 0.5) fires at the first step
    whose logged clip ratio exceeds 0.5, its adjust raises beta x1.5 there, and the next step runs with it."""
    import train_ppo
    from nanokl.harness.tracking import read_metrics
    train_ppo.main(["--config", str(ROOT / "configs" / "arith_tiny.yaml"), "data.num_train=64", "data.num_val=16",
                    "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.logger=[jsonl]",
                    "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1",
                    "algorithm.kl_ctrl.type=fixed", "algorithm.kl_ctrl.kl_coef=0.05", "trainer.device=cpu",
                    "actor_rollout_ref.actor.optim.lr=0.01", "trainer.total_training_steps=6",
                    f"custom_reward_function.path={ROOT / 'tests' / 'planted_reward.py'}",
                    "custom_reward_function.name=pays_for_length", "trainer.kl_monitor.enable=true",
                    "trainer.kl_monitor.degenerate_action=adjust", f"actor_rollout_ref.model.path={eos_sft}",
                    f"trainer.default_local_dir={tmp_path}"])
    rows = {r["training/global_step"]: r for r in read_metrics(tmp_path) if "critic/score/mean" in r}
    clip = {s: r["response_length/clip_ratio"] for s, r in rows.items()}
    first = min(s for s, c in clip.items() if c > 0.5)  # by the logged metric, not by the monitor
    assert 1 < first < 6, clip  # learned during the run, not there from the start
    assert rows[first]["critic/score/mean"] > rows[1]["critic/score/mean"]  # the exploit pays
    for s in range(1, first):
        assert rows[s]["monitor/degenerate_fired"] == 0.0 and "monitor/action/degenerate" not in rows[s]
    assert rows[first]["monitor/degenerate_fired"] == 1.0
    assert rows[first]["monitor/action/degenerate"] == 2.0  # adjust
    assert rows[first]["monitor/adjust/kl_weight"] == 0.05 * 1.5
    assert rows[first + 1]["actor/reward_kl_penalty_coeff"] == 0.05 * 1.5  # the next step runs with it
    assert all(rows[s]["actor/reward_kl_penalty_coeff"] == 0.05 for s in range(1, first + 1))


def test_an_escalation_event_cuts_the_lr_and_reloads_the_reference_into_the_actor():
    from types import SimpleNamespace

    from nanokl.harness import remedies
    from nanokl.harness.monitor import Event
    torch.manual_seed(0)
    actor, ref = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-3)
    actor(torch.ones(1, 3)).sum().backward()
    opt.step()  # Adam now holds moments of the drifted weights
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
    cfg = SimpleNamespace(actor_rollout_ref=SimpleNamespace(actor=None), algorithm=None)
    run = SimpleNamespace(cfg=cfg, actor=actor, ref=ref, actor_opt=opt, actor_sched=sched, rollout_copy=False)
    remedies.apply(run, [Event("kl_band", "adjust", "", ("actor_lr", 1e-3, 5e-4), reload=True)])
    assert all(torch.equal(a, r) for a, r in zip(actor.state_dict().values(), ref.state_dict().values()))
    assert len(opt.state) == 0 and opt.param_groups[0]["lr"] == 5e-4


def test_garbled_fires_when_the_repetition_rises_past_its_step_while_the_score_rises():
    """Windows of 2 (steps 1-2 against 3-4): repetition 0.1 -> 0.2 is a rise of exactly 0.1: quiet; 0.2001:
    fires at step 4 (strict), and at step 5 (3-4 vs 4-5... windows slide); a flat score or a falling
    repetition: quiet; its adjust raises kl_weight as degenerate's does."""
    c = cfg(score_window=2, garbled_action="adjust")
    up = [0.1, 0.1, 0.9, 0.9]

    def stream(reps, scores):
        return [{REP: r, SCORE: s} for r, s in zip(reps, scores)]
    assert events(KLMonitor(c), stream([0.1, 0.1, 0.2, 0.2], up), KNOBS) == {}
    got = events(KLMonitor(c), stream([0.1, 0.1, 0.2001, 0.2001], up), KNOBS)
    assert got == {4: [("garbled", "adjust", ("kl_weight", 0.05, 0.05 * 1.5), False)]}
    assert events(KLMonitor(c), stream([0.1, 0.1, 0.4, 0.4], [0.5] * 4)) == {}  # the score does not rise
    assert events(KLMonitor(c), stream([0.4, 0.4, 0.1, 0.1], up)) == {}  # repetition falls
    mon = KLMonitor(cfg(score_window=2))
    events(mon, stream([0.1, 0.1, 0.1], up))
    assert "monitor/garbled_fired" not in mon.metrics()  # fewer than two windows: the check does not run
    events(mon, stream([0.1], [0.9]), )
    assert mon.metrics()["monitor/garbled_fired"] == 0.0
    state = mon.state_dict()
    again = KLMonitor(cfg(score_window=2))
    again.load_state_dict(state)
    assert again.reps == mon.reps == [0.1, 0.1, 0.1, 0.1]

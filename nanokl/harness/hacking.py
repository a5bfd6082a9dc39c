"""Reward-hacking checks of the KL monitor: is the policy earning its score, or gaming the scorer?

The idea
--------
A policy optimised against a proxy reward finds what the proxy pays for that the task does not:
the reward rises while the true quality stalls or falls (Gao et al. 2023, "Scaling laws for
reward model overoptimization"; Skalse et al. 2022 define it). The KL-tuning article's failure
case is "reward > 5 but the output is gibberish", typically on long contexts; the offline-RLHF
article keeps the policy ratio within [0.8, 1.2]. The KL mean cannot see either: a hack may cost
little KL per token. So three checks read the step's text statistics instead (each logged every
step by nanokl/harness/metrics.py and nanokl/ppo.py):

  check         fires when (cfg = trainer.kl_monitor)                       metric it reads
  length_drift  the mean response length rose by more than length_drift_min  response_length/mean,
                (relative, the mean of the last score_window steps over the   critic/score/mean, and
                score_window before) while the score rose and the truth did   the truth: critic/rule_score/
                not (truth: the rule's score of the same responses when a     mean, else the last two
                reward model scores; else the last two held-out accuracies)   val-core/*/acc/mean@1
  degenerate    repetition > repetition_max (mean over responses of each      response_repetition/mean,
                response's share of repeated 3-grams), or the share of        response_length/clip_ratio
                responses that hit the length limit > length_limit_max
  garbled       the repetition rose by more than garbled_rise_min (absolute,    response_repetition/mean,
                window over window, as length_drift) while the score rose:    critic/score/mean
                the guide's "reward high but the text garbled", seen as it
                starts rather than at degenerate's absolute level
  ratio_band    the share of tokens whose π/π_old leaves [0.8, 1.2] (the      actor/ratio_out_band
                update moved far past a PPO step) > ratio_out_band_max

Length is the classic hack of a learned reward (longer answers look better to the RM; Singhal et
al. 2023, "A long way to go"); repetition and runaway length are the gibberish; a ratio far from 1
on many tokens says one update went further than the clip was meant to allow. length_drift needs
a truth the policy cannot game: with a rule reward and no held-out accuracy it does not run. Thresholds
are strict (">"), NaN fails, an absent metric skips its check, as in monitor.py.

Remedies (each check has `<check>_action` and `<check>_adjust` like the others, monitor.py):
length_drift and degenerate raise kl_weight x1.5 (hold the policy near the reference, whose text was
fine), ratio_band halves the actor's learning rate (the step size is the cause). Rollback returns
to the last healthy checkpoint, where the text was still sound.

The defaults were set above what the default run (configs/arith_tiny.yaml) ever shows; README's
monitor section gives the measured ranges. tests/test_hacking.py: scripted streams at each
threshold's edge, and a short real run with a planted exploit.
"""

import math

from nanokl.masked import masked_mean, zero_masked

LENGTH_KEY = "response_length/mean"
RULE_KEY = "critic/rule_score/mean"
VAL_SUFFIX = "/acc/mean@1"  # val-core/<source>/acc/mean@1: the held-out accuracy
REPETITION_KEY = "response_repetition/mean"
CLIP_KEY = "response_length/clip_ratio"
RATIO_KEY = "actor/ratio_out_band"
RATIO_BAND = (0.8, 1.2)  # the offline-RLHF article's band for π/π_old


def ratio_out_band(old_log_prob, log_prob, response_mask, band=RATIO_BAND):
    """The share of valid tokens whose ratio π_θ/π_old = exp(logp − old_logp) lies outside `band` (the
    offline-RLHF article keeps it within [0.8, 1.2]; a large share says the update moved far past what
    one PPO step should, the clip notwithstanding). Compared in log space, so a padded inf never meets
    the mask."""
    log_ratio = zero_masked(log_prob, response_mask) - zero_masked(old_log_prob, response_mask)
    lo, hi = math.log(band[0]), math.log(band[1])
    return masked_mean(((log_ratio < lo) | (log_ratio > hi)).float(), response_mask)


def watch_ratio(mb, log_prob) -> dict:
    """What the policy update records for the ratio_band check on each micro-batch (workers.update_actor's
    `watch`): actor/ratio_out_band, token-weighted over the mini-batch as the update's other fractions."""
    return {RATIO_KEY: ratio_out_band(mb["old_log_probs"], log_prob, mb["response_mask"])}


def _mean(xs):
    return sum(xs) / len(xs)


def _read(metrics, key):
    v = metrics.get(key)
    return None if v is None else float(v)


def length_rise(lengths, w):
    """Relative rise of the mean length, last w steps over the w before (None until 2w steps)."""
    if len(lengths) < 2 * w:
        return None
    before = _mean(lengths[:w])
    return _mean(lengths[w:]) / before - 1 if before > 0 else math.inf


def check(mon, step, metrics) -> dict:
    """Update the monitor's windows from this step's metrics and return {check: message} of those
    that failed; marks each check that ran in mon.fired (0.0)."""
    c, w, failed = mon.cfg, mon.cfg.score_window, {}
    length = _read(metrics, LENGTH_KEY)
    if length is not None:
        mon.lengths = (mon.lengths + [length])[-2 * w:]
    rule = _read(metrics, RULE_KEY)
    if rule is not None:
        mon.truths = (mon.truths + [rule])[-2 * w:]
    val = next((float(v) for k, v in metrics.items() if k.startswith("val-core/") and k.endswith(VAL_SUFFIX)), None)
    if val is not None:
        mon.vals = (mon.vals + [val])[-2:]
    rise = length_rise(mon.lengths, w) if length is not None else None
    mon.rise = rise
    if mon.truths:  # the rule's score of the same responses (a reward model scores)
        truth_flat = len(mon.truths) == 2 * w and not sum(mon.truths[w:]) > sum(mon.truths[:w])
    else:  # else the held-out accuracy, the last two validations
        truth_flat = len(mon.vals) == 2 and not mon.vals[1] > mon.vals[0]
    if rise is not None and (mon.truths or len(mon.vals) == 2):
        mon.fired["length_drift"] = 0.0
        if not rise <= c.length_drift_min and mon.rising() and truth_flat:
            failed["length_drift"] = (f"mean response length up {rise:.1%} (> {c.length_drift_min:.0%}) over "
                                      f"{w} steps while the score rises and the "
                                      f"{'rule score' if mon.truths else 'held-out accuracy'} does not")
    rep, clip = _read(metrics, REPETITION_KEY), _read(metrics, CLIP_KEY)
    if rep is not None or clip is not None:
        mon.fired["degenerate"] = 0.0
        why = []
        if rep is not None and not rep <= c.repetition_max:
            why.append(f"repeated 3-grams {rep:.3g} > {c.repetition_max} ({REPETITION_KEY})")
        if clip is not None and not clip <= c.length_limit_max:
            why.append(f"{clip:.3g} of responses hit the length limit > {c.length_limit_max} ({CLIP_KEY})")
        if why:
            failed["degenerate"] = "; ".join(why)
    if rep is not None:
        mon.reps = (mon.reps + [rep])[-2 * w:]
        if len(mon.reps) == 2 * w:
            mon.fired["garbled"] = 0.0
            up = _mean(mon.reps[w:]) - _mean(mon.reps[:w])
            if not up <= c.garbled_rise_min and mon.rising():
                failed["garbled"] = (f"repeated 3-grams up {up:.3g} (> {c.garbled_rise_min}) over {w} steps while "
                                     f"the score rises ({REPETITION_KEY})")
    ratio = _read(metrics, RATIO_KEY)
    if ratio is not None:
        mon.fired["ratio_band"] = 0.0
        if not ratio <= c.ratio_out_band_max:
            failed["ratio_band"] = f"{ratio:.3g} of tokens have pi/pi_old outside [0.8, 1.2] > " \
                                   f"{c.ratio_out_band_max} ({RATIO_KEY})"
    return failed

"""The run reports itself: one short summary of metrics.jsonl, printed at the end and kept as summary.json.

    python -m nanokl.harness.summary runs/arith_tiny/ppo        # recompute it for any run, later

A KL-regularised run is read by a few numbers: did the held-out accuracy rise, did the KL sit where
the controller was told to hold it, how far did beta travel to hold it there, what did the KL
monitor see, and does the KL the policy spends buy accuracy (the KL-tuning article's validation
note: "KL correlates positively with accuracy"). At the end of a run (and when it stops: the KL
monitor, the reference check, three NaN steps, a preemption) run.finish writes them, computed from
metrics.jsonl alone (nanokl/harness/tracking.py), so this module can recompute them for any run:

  accuracy     each held-out accuracy `val-core/<source>/acc/mean@n`: the first validation, the
               best (the earliest step of the highest value), the last
  kl           the step's KL (monitor.KL_KEYS: actor/reward_kl_penalty, else actor/kl_loss), mean
               over the second half of the training steps that logged a finite one (the last
               ceil(n/2) of n), against the mean of the logged target over the same steps
               (actor/target_kl for the reward's adaptive controller, actor/kl_loss_target for the
               loss's: both move with a schedule or an adjust); no target when none was logged
  beta         the KL coefficient (actor/reward_kl_penalty_coeff, else the KL loss's actor/kl_coef):
               start, min, max, end, each with its step (min and max: the first step that reached it)
  monitor      the KL monitor's events counted by (check, action), from `monitor/action/<check>`
               (1 warn, 2 adjust, 3 rollback, 4 stop); a step that logged `monitor/<check>_fired`
               = 1 without it counts under action "unknown"
  ref_checks   the reference checks run and failed (monitor/ref_consistent, harness/ref_check.py)
  correlation  Pearson's r between each validation's accuracy and the mean KL of the training
               steps since the previous validation (a validation with no training step before it,
               such as step 0's, has no pair); n pairs; None when n < 3 or either side is constant
               (r is then undefined, not 0)

A NaN in metrics.jsonl is written as the string "nan" (tracking._plain), so it counts as absent here.
tests/test_summary.py recomputes every figure of a real run's summary.json from metrics.jsonl with
its own loops, and checks the edge cases (no validation, one, a constant KL) on synthetic rows.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import yaml

from nanokl.harness.config.yaml_io import UserError, run_cli
from nanokl.harness.tracking import read_metrics

STEP = "training/global_step"
KL_TARGETS = {"actor/reward_kl_penalty": "actor/target_kl", "actor/kl_loss": "actor/kl_loss_target"}
BETA_KEYS = ("actor/reward_kl_penalty_coeff", "actor/kl_coef")
ACTIONS = {1: "warn", 2: "adjust", 3: "rollback", 4: "stop"}  # monitor/action/<check> values


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def series(rows, key) -> list[tuple[int, float]]:
    """(step, value) of every row with a finite number under `key`, in step order."""
    return [(r[STEP], float(r[key])) for r in rows if _num(r.get(key))]


def pearson(xs, ys) -> float | None:
    """Pearson's r of two equal-length sequences; None with fewer than 3 pairs or a constant side."""
    n = len(xs)
    if n < 3:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / math.sqrt(sxx * syy)


def _kl_key(rows):
    return next((k for k in KL_TARGETS if any(_num(r.get(k)) for r in rows)), None)


def _events(rows) -> dict:
    counts = {}
    for r in rows:
        checks = {k[len("monitor/action/"):] for k in r if k.startswith("monitor/action/")}
        checks |= {k[len("monitor/"):-len("_fired")] for k in r if k.startswith("monitor/") and k.endswith("_fired")}
        for check in sorted(checks):
            code = r.get(f"monitor/action/{check}")
            if _num(code) and code > 0:
                action = ACTIONS.get(int(code), "unknown")
            elif code is None and r.get(f"monitor/{check}_fired") == 1:
                action = "unknown"
            else:
                continue
            counts.setdefault(check, {}).setdefault(action, 0)
            counts[check][action] += 1
    return counts


def summarize(rows, cfg=None, run_dir=None, ended=None) -> dict:
    """The summary of a run's metrics.jsonl rows (tracking.read_metrics: one merged row per step)."""
    cfg = cfg or {}
    rows = sorted(rows, key=lambda r: r[STEP])
    out = {"run_dir": str(run_dir) if run_dir is not None else None, "ended": ended,
           "last_step": rows[-1][STEP] if rows else None,
           "planned_steps": cfg.get("trainer", {}).get("total_training_steps")}
    acc_keys = sorted({k for r in rows for k in r if k.startswith("val-core/") and "/acc/mean@" in k})
    out["accuracy"] = {}
    for key in acc_keys:
        s = series(rows, key)
        if s:
            best = max(s, key=lambda p: p[1])  # max keeps the first of equal values: the earliest step
            out["accuracy"][key] = {"first": list(s[0]), "best": list(best), "last": list(s[-1]), "n": len(s)}
    kl_key = _kl_key(rows)
    kl = series(rows, kl_key) if kl_key else []
    out["kl"] = None
    if kl:
        half = kl[len(kl) // 2:]
        steps = {s for s, _ in half}
        targets = [v for s, v in series(rows, KL_TARGETS[kl_key]) if s in steps]
        mean = sum(v for _, v in half) / len(half)
        target = sum(targets) / len(targets) if targets else None
        out["kl"] = {"key": kl_key, "from_step": half[0][0], "to_step": half[-1][0], "n": len(half), "mean": mean,
                     "target_key": KL_TARGETS[kl_key] if targets else None, "target_mean": target,
                     "ratio": mean / target if target else None}
    beta_key = next((k for k in BETA_KEYS if series(rows, k)), None)
    out["beta"] = None
    if beta_key:
        b = series(rows, beta_key)
        out["beta"] = {"key": beta_key, "start": list(b[0]), "min": list(min(b, key=lambda p: p[1])),
                       "max": list(max(b, key=lambda p: p[1])), "end": list(b[-1])}
    out["monitor_events"] = _events(rows)
    checks = [v for _, v in series(rows, "monitor/ref_consistent")]
    out["ref_checks"] = {"run": len(checks), "failed": sum(1 for v in checks if v != 1.0)}
    out["kl_accuracy"] = {}
    for key in acc_keys:
        pairs, prev = [], None
        for step, acc in series(rows, key):
            since = [v for s, v in kl if (prev is None or s > prev) and s <= step]
            if since:
                pairs.append([step, sum(since) / len(since), acc])
            prev = step
        out["kl_accuracy"][key] = {"pearson": pearson([p[1] for p in pairs], [p[2] for p in pairs]),
                                   "n": len(pairs), "pairs": pairs}
    return out


def format_text(s) -> str:
    """The summary as a few lines for the console."""
    d = s["run_dir"] or "."
    planned = f" of {s['planned_steps']}" if s["planned_steps"] else ""
    lines = [f"run summary: {s['ended'] or 'ended'} (last logged step {s['last_step']}{planned})"]
    for key, a in s["accuracy"].items():
        lines.append(f"  held-out accuracy ({key}): {a['first'][1]:.3f} (step {a['first'][0]}) -> best "
                     f"{a['best'][1]:.3f} (step {a['best'][0]}) -> last {a['last'][1]:.3f} (step {a['last'][0]})")
    if not s["accuracy"]:
        lines.append("  held-out accuracy: no validation logged")
    k = s["kl"]
    if k:
        vs = (f" vs target {k['target_mean']:.4g} (x{k['ratio']:.2f}, {k['target_key']})" if k["target_mean"]
              else " (no target logged)")
        lines.append(f"  KL ({k['key']}), steps {k['from_step']}-{k['to_step']}: mean {k['mean']:.4g}{vs}")
    b = s["beta"]
    if b:
        lines.append(f"  beta ({b['key']}): {b['start'][1]:.4g} (step {b['start'][0]}) -> min {b['min'][1]:.4g} "
                     f"(step {b['min'][0]}), max {b['max'][1]:.4g} (step {b['max'][0]}) -> {b['end'][1]:.4g} "
                     f"(step {b['end'][0]})")
    ev = ", ".join(f"{c}{'' if a == 'unknown' else ' ' + a} x{n}" for c, acts in s["monitor_events"].items()
                   for a, n in acts.items())
    lines.append(f"  monitor events: {ev or 'none'}")
    if s["ref_checks"]["run"]:
        lines.append(f"  reference checks: {s['ref_checks']['run']} run, {s['ref_checks']['failed']} failed")
    for key, c in s["kl_accuracy"].items():
        why = f"undefined ({c['n']} pairs, 3 needed)" if c["n"] < 3 else "undefined (a constant side)"
        r = why if c["pearson"] is None else f"{c['pearson']:+.2f} over {c['n']} validations"
        lines.append(f"  KL-accuracy correlation ({key}): r = {r} (each validation's accuracy against the mean "
                     f"KL of the steps since the previous one)")
    lines.append(f"  metrics: {Path(d) / 'metrics.jsonl'}; this summary: {Path(d) / 'summary.json'}; "
                 f"plot: python -m nanokl.harness.plot {d}")
    return "\n".join(lines)


def report(run_dir, cfg=None, ended=None) -> dict:
    """Summarize the run in `run_dir` from its metrics.jsonl, write summary.json beside it, print the text."""
    run_dir = Path(run_dir)
    s = summarize(read_metrics(run_dir), cfg, run_dir, ended)
    (run_dir / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    print(format_text(s), file=sys.stderr)
    return s


def main(argv=None):
    ap = argparse.ArgumentParser(description="Summarize a run from its metrics.jsonl (writes RUN_DIR/summary.json).")
    ap.add_argument("run_dir")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise UserError(f"{run_dir}: no metrics.jsonl (is it a train_ppo.py run directory?)")
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
    old = run_dir / "summary.json"  # how the run ended is not in metrics.jsonl: keep what the run said
    ended = json.loads(old.read_text()).get("ended") if old.is_file() else None
    report(run_dir, cfg, ended)


if __name__ == "__main__":
    run_cli(main)

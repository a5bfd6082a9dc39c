"""Plot a run: is the KL where the controller puts it, and is the policy learning?

    python -m nanokl.harness.plot runs/arith_tiny/ppo            # writes runs/arith_tiny/ppo/training.png

Seven panels over PPO steps, read from the run's metrics.jsonl (nanokl/harness/tracking.py):
  1. the per-token KL in the reward (`actor/reward_kl_penalty`) against `target_kl`, with the
     KL monitor's healthy band shaded when the run's config has one (trainer.kl_monitor);
  2. the KL coefficient beta the adaptive controller chose (`actor/reward_kl_penalty_coeff`);
  3. the training score (`critic/score/mean`);
  4. the policy's mean token entropy (`actor/entropy`);
  5. mean response length (`response_length/mean`);
  6. the clip fraction (`actor/pg_clipfrac`) and the share of tokens whose ratio left [0.8, 1.2]
     (`actor/ratio_out_band`);
  7. held-out accuracy (`val-core/*/acc/mean@1`), greedy, at every validation.
Every KL-monitor event (`monitor/action/<check>`: `monitor_events`) is a vertical line on every
panel, orange for a warning, red for an action, and named on the KL panel: a health report to look
at rather than read. `--mark STEP:LABEL` draws a step of your own on every panel, black and dashed
(bench/failure_zoo.py marks each zoo run's damage step this way).
Needs matplotlib (`pip install -e ".[plot]"`).
"""

import argparse
import sys
from pathlib import Path

import yaml

from nanokl.harness.config.yaml_io import UserError, run_cli
from nanokl.harness.monitor import GRAVITY
from nanokl.harness.tracking import read_metrics


def curve(rows, key):
    """(steps, values) of one metric over the rows that have a number for it."""
    pts = [(r["training/global_step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def monitor_events(rows):
    """[(step, check, action)] of every check the KL monitor fired, in step order (the action read back
    from the gravity it logs, monitor.GRAVITY)."""
    action = {g: a for a, g in GRAVITY.items()}
    return [(r["training/global_step"], k.removeprefix("monitor/action/"), action.get(int(v), str(v)))
            for r in rows for k, v in r.items() if k.startswith("monitor/action/")]


def plot_run(run_dir, out=None, marks=None) -> Path:
    """The health report of one run as a PNG; marks: {step: label} drawn on every panel."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("nanokl.harness.plot needs matplotlib: pip install -e '.[plot]'") from None
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise UserError(f"{run_dir}: no metrics.jsonl (is it a train_ppo.py run directory?)")
    rows = read_metrics(run_dir)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
    kl_ctrl = cfg.get("algorithm", {}).get("kl_ctrl", {})
    monitor = cfg.get("trainer", {}).get("kl_monitor", {})

    fig, axes = plt.subplots(7, 1, figsize=(8, 16), sharex=True)
    ax = axes[0]
    x, y = curve(rows, "actor/reward_kl_penalty")
    ax.plot(x, y, label="KL (per token, in reward)")
    x2, y2 = curve(rows, "actor/kl_loss")
    if y2:
        ax.plot(x2, y2, label="KL loss", alpha=0.7)
    if kl_ctrl.get("type") == "adaptive":
        ax.axhline(kl_ctrl["target_kl"], color="k", ls="--", lw=1, label=f"target_kl {kl_ctrl['target_kl']}")
    if monitor.get("enable") and "kl_low" in monitor and "kl_high" in monitor:
        lo, hi = monitor["kl_low"], monitor["kl_high"]
        ax.axhspan(lo, hi, color="g", alpha=0.1, label="healthy band")
    ax.set_ylabel("KL")
    ax.legend(loc="upper left", fontsize=8)
    panels = [("actor/reward_kl_penalty_coeff", "beta (KL coef)"), ("critic/score/mean", "train score"),
              ("actor/entropy", "entropy")]
    for ax, (key, label) in zip(axes[1:4], panels):
        ax.plot(*curve(rows, key), label=label)
        ax.set_ylabel(label)
    x, y = curve(rows, "critic/rule_score/mean")
    if y:  # a learned reward: the rule's verdict on the same rollouts, where reward hacking shows
        axes[2].plot(x, y, label="rule score (same rollouts)")
        axes[2].legend(loc="lower right", fontsize=8)
    axes[4].plot(*curve(rows, "response_length/mean"))
    axes[4].set_ylabel("response length")
    axes[5].plot(*curve(rows, "actor/pg_clipfrac"), label="clip fraction")
    axes[5].plot(*curve(rows, "actor/ratio_out_band"), label="ratio outside [0.8, 1.2]")
    axes[5].legend(loc="upper left", fontsize=8)
    axes[5].set_ylabel("share of tokens")
    events = monitor_events(rows)
    for step, check, action in events:
        for a in axes:
            a.axvline(step, color="orange" if action == "warn" else "red", lw=0.6, alpha=0.6)
    for step, check in sorted({(s, c) for s, c, _ in events}):  # named once per (step, check)
        axes[0].annotate(check, (step, 1), xycoords=("data", "axes fraction"), rotation=90, fontsize=6,
                         va="top")
    for step, label in (marks or {}).items():
        for a in axes:
            a.axvline(step, color="k", ls="--", lw=1)
        axes[0].annotate(label, (step, 0.5), xycoords=("data", "axes fraction"), rotation=90, fontsize=7)
    ax = axes[6]
    for key in sorted({k for r in rows for k in r if k.startswith("val-core/") and k.endswith("acc/mean@1")}):
        ax.plot(*curve(rows, key), marker="o", label=key.split("/")[1])
    ax.legend(loc="lower right", fontsize=8)
    ax.set_ylabel("held-out acc (greedy)")
    ax.set_xlabel("PPO step")
    fig.suptitle(cfg.get("trainer", {}).get("experiment_name") or run_dir.name)
    fig.tight_layout()
    out = Path(out) if out else run_dir / "training.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}", file=sys.stderr)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description="Plot KL vs target, beta, score, entropy and accuracy of a run.")
    ap.add_argument("run_dir")
    ap.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/training.png)")
    ap.add_argument("--mark", action="append", default=[], metavar="STEP:LABEL",
                    help="a step to mark on every panel (repeatable), e.g. --mark 55:damage")
    args = ap.parse_args(argv)
    marks = {}
    for m in args.mark:
        step, _, label = m.partition(":")
        if not step.strip().isdigit():
            raise UserError(f"--mark {m}: expected STEP:LABEL with STEP a whole number")
        marks[int(step)] = label or "mark"
    plot_run(args.run_dir, args.out, marks)


if __name__ == "__main__":
    run_cli(main)

"""A run made to drift, watched by the KL monitor twice: once warning, once adjusting.

    python bench/monitor_drift.py                 # the two runs (~2 x 3 min on 2 CPU cores), table, plot
    python bench/monitor_drift.py --report        # table and plot from runs/monitor_drift/ again

The drift: arith_tiny.yaml with a fixed beta (no controller to hold the KL) and an actor learning
rate 10x the default's. Both runs are the same command but for trainer.kl_monitor.kl_band_action:
`warn` only says that the KL left the band [kl_low, kl_high]; `adjust` applies the KL-tuning
article's remedy for a high KL with the default rule, kl_weight x 1.5 (at most every 5 steps, never
above 1.0). A third run, `adjust_lr`, adjusts the knob that causes the drift instead:
kl_high_adjust = {knob: actor_lr, factor: 0.5, limit: 1e-5}. The table
gives, for each run, the first step the KL left the band upward, the step it was back inside
(adjust) and what fraction of the steps after that stayed inside; the plot, the KL of both runs
against the band, and beta.

    python bench/monitor_drift.py --escalation    # issue 27's drift: 25x the lr, fixed beta, 60 steps

The escalation table: arith_tiny.yaml with the actor lr 25x (5e-4) and a fixed beta, kl_band_action
adjust, under each trainer.kl_monitor.escalation (none: beta x1.5 only; lr: then actor_lr x0.5; reference:
then actor_lr x0.5 with the reference weights reloaded, the default), and `warn` for the drift itself:
the step of each action and the KL of the last 10 steps against arith_tiny's band.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "monitor_drift"
RUNS = {"warn": ["trainer.kl_monitor.kl_band_action=warn"],
        "adjust": ["trainer.kl_monitor.kl_band_action=adjust"],
        "adjust_lr": ["trainer.kl_monitor.kl_band_action=adjust",
                      "trainer.kl_monitor.kl_high_adjust={knob: actor_lr, factor: 0.5, limit: 1.0e-5}"]}
DRIFT = ["algorithm.kl_ctrl.type=fixed", "algorithm.kl_ctrl.kl_weight=0.05", "actor_rollout_ref.actor.optim.lr=2e-4",
         "trainer.total_training_steps=150", "trainer.test_freq=-1", "trainer.val_before_train=false",
         "trainer.save_freq=-1", "trainer.kl_monitor.enable=true", "trainer.logger=[jsonl]",
         # as measured (bench/RESULTS.md): temperature 1 and the band around 0.05, arith_tiny's before the race
         "actor_rollout_ref.rollout.temperature=1.0", "trainer.kl_monitor.kl_low=0.02", "trainer.kl_monitor.kl_high=0.08",
         "trainer.kl_monitor.entropy_min=0.05",
         # as recorded: the band acts at its edges (not at the article's 0.15 / 0.01), no escalation, no quiet start
         "trainer.kl_monitor.kl_high_act=0.08", "trainer.kl_monitor.kl_low_act=0.02",
         "trainer.kl_monitor.escalation=none", "trainer.kl_monitor.warmup_steps=0"]


ESCALATE = ["actor_rollout_ref.actor.optim.lr=5e-4", "algorithm.kl_ctrl.type=fixed", "trainer.total_training_steps=60",
            "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.logger=[jsonl]"]
ESCALATIONS = {"warn": ["trainer.kl_monitor.kl_band_action=warn"],
               **{f"escalation_{e}": ["trainer.kl_monitor.kl_band_action=adjust",
                                      f"trainer.kl_monitor.escalation={e}"] for e in ("none", "lr", "reference")}}


def rows(name):
    return [json.loads(line) for line in open(OUT / name / "metrics.jsonl") if line.strip()]


def escalation_table(low, high):
    print(f"| run | kl_weight x1.5 at steps | actor_lr cut at steps | mean KL, last 10 steps | "
          f"of them in [{low}, {high}] |")
    print("|---|---|---|---|---|")
    for name in ESCALATIONS:
        if not (OUT / name / "metrics.jsonl").is_file():
            continue
        rs = [r for r in rows(name) if "actor/reward_kl_penalty" in r]
        at = {k: [r["training/global_step"] for r in rs if f"monitor/adjust/{k}" in r] for k in ("kl_weight", "actor_lr")}
        last = [r["actor/reward_kl_penalty"] for r in rs[-10:]]
        print(f"| {name} | {at['kl_weight'] or '-'} | {at['actor_lr'] or '-'} | {sum(last) / len(last):.4f} | "
              f"{sum(low <= k <= high for k in last)}/{len(last)} |")


def moving_mean(values, n=10):
    return [sum(values[max(0, i - n + 1):i + 1]) / len(values[max(0, i - n + 1):i + 1]) for i in range(len(values))]


def summary(rs, low, high):
    kl = [(r["training/global_step"], r["actor/reward_kl_penalty"]) for r in rs if "actor/reward_kl_penalty" in r]
    left = next((s for s, k in kl if k > high), None)
    back = next((s for s, k in kl if left is not None and s > left and low <= k <= high
                 and all(low <= k2 <= high for s2, k2 in kl if s2 > s)), None)  # inside from here to the end
    after = [k for s, k in kl if left is not None and s > left]
    inside = sum(low <= k <= high for k in after) / max(1, len(after))
    half = [k for s, k in kl if s > len(kl) // 2]
    adjusts = sum(1 for r in rs if any(k.startswith("monitor/adjust/") for k in r))
    beta = [r["actor/reward_kl_penalty_coeff"] for r in rs if "actor/reward_kl_penalty_coeff" in r]
    ma = moving_mean([k for _, k in kl])
    back10 = next((kl[i][0] for i in range(9, len(kl)) if all(low <= m <= high for m in ma[i:])), None)
    return {"left": left, "back": back, "back10": back10, "inside_after": inside, "kl_2nd_half": sum(half) / len(half),
            "adjusts": adjusts, "beta_end": beta[-1]}


def plot(low, high, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=[2, 1])
    ax.axhspan(low, high, color="green", alpha=0.12, label=f"healthy band [{low}, {high}]")
    for name, color in (("warn", "tab:red"), ("adjust", "tab:blue"), ("adjust_lr", "tab:green")):
        rs = rows(name)
        steps = [r["training/global_step"] for r in rs if "actor/reward_kl_penalty" in r]
        label = {"warn": "warn", "adjust": "adjust: kl_weight x1.5", "adjust_lr": "adjust: actor_lr x0.5"}[name]
        ax.plot(steps, [r["actor/reward_kl_penalty"] for r in rs if "actor/reward_kl_penalty" in r], color=color,
                label=label, lw=1)
        bx.plot(steps, [r["actor/reward_kl_penalty_coeff"] for r in rs if "actor/reward_kl_penalty_coeff" in r],
                color=color)
        marks = [r["training/global_step"] for r in rs if "monitor/adjust/kl_weight" in r]
        bx.plot(marks, [r["monitor/adjust/kl_weight"] for r in rs if "monitor/adjust/kl_weight" in r], "o", color=color,
                ms=4)
    ax.set_ylabel("KL per token")
    ax.set_title("actor lr 2e-4 (10x), fixed beta 0.05: the monitor warns, or adjusts a knob")
    ax.legend()
    bx.set_ylabel("beta (dots: adjustments)")
    bx.set_xlabel("PPO step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", action="store_true", help="re-print and re-plot the runs already in runs/monitor_drift")
    p.add_argument("--plot", default=str(ROOT / "bench" / "monitor_drift.png"))
    p.add_argument("--only", choices=list(RUNS) + list(ESCALATIONS),
                   help="run only this one (the others from runs/monitor_drift)")
    p.add_argument("--escalation", action="store_true", help="the 25x-lr drift under each escalation (table only)")
    args = p.parse_args()
    if args.escalation:
        from nanokl.harness.config.load import load_config
        if not args.report:
            for name in [args.only] if args.only else list(ESCALATIONS):
                subprocess.run([sys.executable, str(ROOT / "train_ppo.py"), *ESCALATE, *ESCALATIONS[name],
                                f"trainer.default_local_dir={OUT / name}", "trainer.resume_mode=disable"],
                               check=True, cwd=ROOT)
        mon = load_config(ROOT / "configs" / "arith_tiny.yaml").trainer.kl_monitor
        escalation_table(mon.kl_low, mon.kl_high)
        return
    if not args.report:
        for name in [args.only] if args.only else list(RUNS):
            cmd = [sys.executable, str(ROOT / "train_ppo.py"), *DRIFT, *RUNS[name],
                   f"trainer.default_local_dir={OUT / name}", "trainer.resume_mode=disable"]
            print(" ".join(cmd[1:]), file=sys.stderr)
            subprocess.run(cmd, check=True, cwd=ROOT)
    from nanokl.harness.config.load import load_config
    mon = load_config(ROOT / "configs" / "arith_tiny.yaml").trainer.kl_monitor
    print(f"| run | first step above {mon.kl_high} | every later step in the band from | 10-step mean KL "
          f"in the band from | share of later steps in the band | mean KL, steps 76-150 | adjustments | "
          f"beta at the end |")
    print("|---|---|---|---|---|---|---|---|")
    for name in RUNS:
        s = summary(rows(name), mon.kl_low, mon.kl_high)
        print(f"| {name} | {s['left']} | {s['back'] if s['back'] is not None else 'never'} | "
              f"{s['back10'] if s['back10'] is not None else 'never'} | "
              f"{s['inside_after']:.2f} | {s['kl_2nd_half']:.4f} | {s['adjusts']} | {s['beta_end']:.4g} |")
    plot(mon.kl_low, mon.kl_high, args.plot)
    print(f"plot: {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()

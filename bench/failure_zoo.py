"""The KL checklist as a detector: inject failures into the CPU demo, measure when it alarms and when the
damage comes, and what acting saves.

    python bench/failure_zoo.py                    # the zoo and the healthy runs (2 at a time), table, plot
    python bench/failure_zoo.py --report           # table and plot from runs/failure_zoo/ again
    python bench/failure_zoo.py --steps 300 --only lr25,temp03
    python bench/failure_zoo.py --only healthy_offline --workers 1   # healthy runs: each config's own length

Each failure is a plain override of configs/arith_tiny.yaml, a reward function in bench/zoo_rewards.py, or
(wrongref) the wrapper bench/zoo_wrongref.py, which gives the reference another model's weights (the same
warm start cut at WRONGREF_SFT_STEPS steps, trained here once). Each is run twice: `warn` (the checklist as shipped: every check warns) and `act` (ACT: the remedies the KL-tuning
guide prescribes, as configs/presets/conservative.yaml sets them, kl_critical stopping). Healthy runs are
shipped configs at several seeds, each at its config's own length unless --healthy-steps says otherwise:
every check that fires there is a false alarm.

The damage step is defined before any run and is the same for all: the first step where
  - held-out accuracy (val-core/arith/acc/mean@1, every TEST_FREQ steps) is 0.10 or more below its best so far,
  - the KL (actor/reward_kl_penalty, else actor/kl_loss) exceeds 0.3,
  - mean response length exceeds twice its first step's, or
  - the policy's entropy falls below a third of its first step's.
The first alarm is the first step at which any check of the monitor fired (monitor/action/<check> logged);
lead = damage - alarm (positive: the checklist spoke first). A run without damage in its length says so.
Each warn run's health report (nanokl/harness/plot.py) is written to its folder with the damage step marked.
Split: thresholds may be tuned on the healthy runs and FIRST_HALF only; the rest is reported untouched.
"""

import argparse
import json
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "failure_zoo"
TEST_FREQ = 5
ACC, KLS = "val-core/arith/acc/mean@1", ("actor/reward_kl_penalty", "actor/kl_loss")
REWARDS = str(ROOT / "bench" / "zoo_rewards.py")
_M = "trainer.kl_monitor."


def reward(name):
    return [f"custom_reward_function.path={REWARDS}", f"custom_reward_function.name={name}"]


FAILURES = {  # name: (what, overrides)
    "lr10": ("actor lr x10, fixed beta", ["actor_rollout_ref.actor.optim.lr=2e-4", "algorithm.kl_ctrl.type=fixed"]),
    "lr25": ("actor lr x25, fixed beta", ["actor_rollout_ref.actor.optim.lr=5e-4", "algorithm.kl_ctrl.type=fixed"]),
    "beta0": ("beta fixed at 0", ["algorithm.kl_ctrl.type=fixed", "algorithm.kl_ctrl.kl_coef=0.0"]),
    "length": ("reward pays length", reward("length_reward")),
    "repeat": ("reward pays repetition", reward("repetition_reward")),
    "temp03": ("sampling temperature 0.3", ["actor_rollout_ref.rollout.temperature=0.3"]),
    "noise40": ("40% of scores flipped", reward("noisy_reward")),
    "critic50": ("GAE, critic lr x50", ["algorithm.adv_estimator=gae", "critic.optim.lr=1.5e-2"]),
    "stale": ("ppo_epochs 8, mini-batches of 8", ["actor_rollout_ref.actor.ppo_epochs=8",
                                                  "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                                                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"]),
    "wrongref": ("reference is another model", []),
}
WRONGREF_SFT_STEPS = 150  # the default warm start is 600 steps: the same recipe, stopped at a quarter
WRONGREF = OUT / f"sft_{WRONGREF_SFT_STEPS}"
FIRST_HALF = ("lr10", "lr25", "beta0", "length", "repeat")
ACT = [f"{_M}{c}_action=adjust" for c in ("kl_band", "kl_var", "entropy", "collapse", "reward_var", "critic",
                                          "length_drift", "degenerate", "ratio_band")] + \
      [f"{_M}kl_stop_action=rollback", f"{_M}kl_critical_action=stop"]
HEALTHY = {"default": "configs/arith_tiny.yaml", "grpo": "configs/grpo_arith.yaml", "dapo": "configs/dapo_arith.yaml",
           "offline": "configs/offline_ppo.yaml"}
HEALTHY_RUN = tuple(HEALTHY)  # run when --only names none
SEEDS = (42, 43, 44)


def command(cfg, run_dir, steps, extra, program=("train_ppo.py",)):
    length = [f"trainer.total_training_steps={steps}"] if steps else []
    return [sys.executable, str(ROOT / program[0]), *program[1:], "--config", str(ROOT / cfg), *extra, *length,
            f"trainer.test_freq={TEST_FREQ}", "data.num_val=64",
            "trainer.save_freq=10", "trainer.logger=[jsonl]", "trainer.resume_mode=disable",
            f"trainer.default_local_dir={run_dir}"]


def jobs(steps, healthy_steps, only):
    out = {}
    for name, (_, extra) in FAILURES.items():
        if only and name not in only:
            continue
        program = ("bench/zoo_wrongref.py", str(WRONGREF)) if name == "wrongref" else ("train_ppo.py",)
        for mode, act in (("warn", []), ("act", ACT)):
            out[f"{name}_{mode}"] = command("configs/arith_tiny.yaml", OUT / f"{name}_{mode}", steps, extra + act,
                                            program)
    for name, cfg in HEALTHY.items():
        for seed in SEEDS:
            if f"healthy_{name}" in only or not only and name in HEALTHY_RUN:
                out[f"healthy_{name}_{seed}"] = command(cfg, OUT / f"healthy_{name}_{seed}", healthy_steps,
                                                        [f"trainer.seed={seed}", f"data.seed={seed}"])
    return out


def make_wrongref():
    """The other model wrongref's reference loads: the default warm start, stopped early (same tokenizer)."""
    if not (WRONGREF / "model.safetensors").is_file():
        subprocess.check_call([sys.executable, "-m", "nanokl.supervised.sft", f"sft.steps={WRONGREF_SFT_STEPS}",
                               f"sft.output_dir={WRONGREF}"], cwd=ROOT)
    if (WRONGREF / "tokenizer.json").read_bytes() != (ROOT / "runs/arith_tiny/sft/tokenizer.json").read_bytes():
        sys.exit(f"{WRONGREF}: another tokenizer than runs/arith_tiny/sft's; delete it and run again")


def run_all(todo, workers):
    OUT.mkdir(parents=True, exist_ok=True)
    if any(name.startswith("wrongref") for name in todo):
        make_wrongref()

    def one(item):
        name, cmd = item
        if (OUT / name / "summary.json").is_file():  # finished in an earlier sitting (the summary is written last)
            print(f"{name}: done before, kept", flush=True)
            return
        with open(OUT / f"{name}.log", "w") as log:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                 env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
        print(f"{name}: exit {rc}", flush=True)
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, todo.items()))


def rows(name):
    path = OUT / name / "metrics.jsonl"
    return [json.loads(line) for line in open(path) if line.strip()] if path.exists() else []


def kl_of(r):
    return next((r[k] for k in KLS if k in r), None)


def damage(rs):
    """(step, why) of the first damage, or (None, None)."""
    steps = [r for r in rs if r.get("training/global_step", 0) >= 1 and "actor/entropy" in r]
    if not steps:
        return None, None
    len0, ent0, best = steps[0]["response_length/mean"], steps[0]["actor/entropy"], None
    for r in rs:
        s = r["training/global_step"]
        acc = r.get(ACC)
        if acc is not None:
            if best is not None and acc <= best - 0.10 + 1e-9:
                return s, f"acc {acc:.2f} (best {best:.2f})"
            best = acc if best is None else max(best, acc)
        if s < 1 or "actor/entropy" not in r:
            continue
        kl = kl_of(r)
        if kl is not None and not kl <= 0.3:
            return s, f"KL {kl:.3f}"
        if r["response_length/mean"] > 2 * len0:
            return s, f"length {r['response_length/mean']:.1f} (start {len0:.1f})"
        if not r["actor/entropy"] >= ent0 / 3:
            return s, f"entropy {r['actor/entropy']:.3f} (start {ent0:.3f})"
    return None, None


def alarms(rs):
    """[(step, check)] of every check that fired."""
    return [(r["training/global_step"], k.removeprefix("monitor/action/")) for r in rs
            for k in r if k.startswith("monitor/action/")]


def final_acc(rs):
    accs = [r[ACC] for r in rs if ACC in r]
    return accs[-1] if accs else math.nan


def report():
    print("| failure | half | damage step (why) | first alarm (check) | lead | checks that fired | final acc warn | "
          "final acc act | act - warn |")
    print("|---|---|---|---|---|---|---|---|---|")
    leads, caught, damaged, n = [], 0, 0, 0
    for name, (what, _) in FAILURES.items():
        warn, act = rows(f"{name}_warn"), rows(f"{name}_act")
        if not warn:
            continue
        n += 1
        dmg, why = damage(warn)
        al = alarms(warn)
        first = al[0] if al else None
        fired = sorted({c for _, c in al})
        lead = None if first is None or dmg is None else dmg - first[0]
        damaged += dmg is not None
        caught += dmg is not None and first is not None and first[0] <= dmg
        if lead is not None:
            leads.append(lead)
        if dmg:
            health_report(f"{name}_warn", {dmg: "damage"})
        fa, aa = final_acc(warn), final_acc(act) if act else math.nan
        last = warn[-1]["training/global_step"]
        print(f"| {name}: {what} | {'1st' if name in FIRST_HALF else '2nd'} | "
              f"{f'{dmg} ({why})' if dmg else f'none in {last}'} | "
              f"{f'{first[0]} ({first[1]})' if first else 'none'} | {'' if lead is None else lead} | "
              f"{', '.join(fired)} | {fa:.3f} | {aa:.3f} | {aa - fa:+.3f} |")
    leads.sort()
    print(f"\ncaught before (or at) the damage step: {caught} of the {damaged} failures that did damage "
          f"({n} run); median lead "
          f"{leads[len(leads) // 2] if leads else 'n/a'} steps (over the {len(leads)} with both)")
    print("\n| healthy run | steps | steps with a warning | checks |")
    print("|---|---|---|---|")
    for name in HEALTHY:
        for seed in SEEDS:
            rs = rows(f"healthy_{name}_{seed}")
            if rs:
                al = alarms(rs)
                print(f"| {name} seed {seed} | {rs[-1]['training/global_step']} | {len({s for s, _ in al})} | "
                      f"{', '.join(sorted({c for _, c in al}))} |")


def health_report(name, marks):
    try:
        from nanokl.harness.plot import plot_run
        plot_run(OUT / name, marks=marks)
    except Exception as e:  # a picture is not worth losing the table over (matplotlib absent, say)
        print(f"{name}: no health report ({e})", file=sys.stderr)


def plot(path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [n for n in FAILURES if rows(f"{n}_warn")]
    if not names:
        return
    fig, axes = plt.subplots(2, (len(names) + 1) // 2, figsize=(4 * ((len(names) + 1) // 2), 6), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for mode, style in (("warn", "-"), ("act", "--")):
            rs = [r for r in rows(f"{name}_{mode}") if kl_of(r) is not None]
            ax.plot([r["training/global_step"] for r in rs], [kl_of(r) for r in rs], style, label=f"KL ({mode})")
        warn = rows(f"{name}_warn")
        al = alarms(warn)
        if al:
            ax.axvline(al[0][0], color="orange", lw=1, label=f"first alarm ({al[0][1]})")
        dmg, _ = damage(warn)
        if dmg:
            ax.axvline(dmg, color="red", lw=1, label="damage")
        ax.axhspan(0.02, 0.08, color="green", alpha=0.1)
        ax.set_title(f"{name}: {FAILURES[name][0]}", fontsize=8)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"plot: {path}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--report", action="store_true", help="table and plot from runs/failure_zoo/ only")
    p.add_argument("--steps", type=int, default=300, help="steps of every zoo run (default 300, the demo's length)")
    p.add_argument("--healthy-steps", type=int, default=None, help="steps of every healthy run (default: the "
                   "config's own length)")
    p.add_argument("--only", default="", help="comma-separated failures (or healthy_<config>) to run")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--plot", default=str(ROOT / "bench" / "failure_zoo.png"))
    a = p.parse_args()
    if not a.report:
        run_all(jobs(a.steps, a.healthy_steps, set(filter(None, a.only.split(",")))), a.workers)
    report()
    try:
        plot(a.plot)
    except ImportError:
        print("plot: matplotlib is not installed (pip install -e '.[plot]')")


if __name__ == "__main__":
    main()

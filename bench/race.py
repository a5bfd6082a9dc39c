"""The race: nanokl against TRL's GRPOTrainer from the same warm start, on the same clock.

    python bench/race.py                                  # nanokl's default vs TRL's chosen setting, 1 seed
    python bench/race.py --seeds 42,43,44 --plot bench/race.png
    python bench/race.py --no-nanokl --trl g4_lr2e-5:lr=2e-5,gens=4 --trl g8_lr5e-5:lr=5e-5,gens=8 --horizon 1
    python bench/race.py --no-nanokl --trl g8_t06:temp=0.6 --horizon 1    # TRL gets nanokl's sampling temperature too
    python bench/race.py --nanokl rloo:algorithm.adv_estimator=rloo,actor_rollout_ref.rollout.n=4 --no-trl
    python bench/race.py --nanokl default --nanokl dapo:config=configs/dapo_arith.yaml --no-trl --horizon 1
    python bench/race.py --tiny --model DIR               # seconds, no TRL: the test suite's mode

What a user compares before picking a trainer: same warm start, same machine, same minutes; how
far does each get, and how far did it drift from the reference?

The same for both sides:
- the arithmetic task of configs/arith_tiny.yaml, its training prompts (the same token ids: both
  tokenize the plain-template prompt with the warm start's tokenizer) and its warm start;
- the clock: only training-step time counts (TRL: from its on_step_begin to on_step_end, which
  holds generation, scoring, the forwards, backward and the optimizer step; nanokl: train_ppo.ppo_step).
  Setup, the warm start and every evaluation are off the clock. 2 threads each, one after the other;
- evaluation, every `--every` seconds of clock and at 1x and 2x the budget, with nanokl's own
  code for both: greedy accuracy (scoring.evaluate) on two held-out sets, and the on-policy KL
  probe (scoring.on_policy_kl: per-token k1 on fresh samples at temperature 1, against the warm
  start) on the first `--kl-prompts` test prompts. TRL's weights are copied into a nanokl model
  first (the state-dict names are the same).

The held-out sets:
- `val`: the config's 256 validation problems. Everything chosen (nanokl's defaults, TRL's grid
  setting) is chosen on it;
- `test`: 512 problems of the validation side of the task's hash drawn with another seed
  (`--test-seed`), none of them in `val`, never looked at while choosing. The race reports it.

Each run's curve goes to `--out`/<side>_<label>_s<seed>.json; the table is printed at the end, and
`--plot` draws accuracy and KL against seconds. `--report DIR` re-prints the table (and the plot)
from the saved curves without running anything.
"""

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import train_ppo  # noqa: E402
from nanokl.harness.config.load import load_config  # noqa: E402
from nanokl.harness.hf_format import from_pretrained  # noqa: E402
from nanokl.harness.run import setup  # noqa: E402
from nanokl.supervised.stages import train_missing_stages  # noqa: E402
from nanokl.harness.data import build_prompts  # noqa: E402
from nanokl.harness import scoring  # noqa: E402
from nanokl.harness.scoring import on_policy_kl  # noqa: E402
from nanokl.rollout import generate  # noqa: E402
from nanokl.tasks import TASKS  # noqa: E402

ACC = "val-core/arith/acc/mean@1"
TRL_DEFAULT = "lr=2e-5,gens=8,beta=0.04,temp=1.0"  # the grid's choice on `val` (bench/RESULTS.md)


def parse_setting(spec: str) -> tuple[str, list[str]]:
    """'label:a=1,b=2' -> ('label', ['a=1', 'b=2']); a bare 'label' has no overrides."""
    label, _, rest = spec.partition(":")
    return label, [kv for kv in rest.split(",") if kv]


def test_set(cfg, val, n, seed):
    """`n` problems from the validation side of the hash, drawn with `seed`, none in `val`."""
    seen = {ex["prompt"] for ex in val}
    _, more = TASKS["arith"].examples(cfg.data, num_train=0, num_val=n + len(val), seed=seed)
    out = [ex for ex in more if ex["prompt"] not in seen][:n]
    assert len(out) == n
    return out


class Clock:
    """Seconds of training steps only; says when an evaluation or the end is due."""

    def __init__(self, budget, horizon, every):
        self.t, self.budget, self.every = 0.0, budget, every
        self.marks = sorted({budget * k for k in range(1, horizon + 1)})
        self.end, self.next_eval = self.marks[-1], every

    def add(self, seconds):
        self.t += seconds

    def due(self) -> bool:
        """An evaluation is due: every `every` seconds, and at each multiple of the budget."""
        hit = self.t >= self.next_eval or (self.marks and self.t >= self.marks[0])
        if hit:
            while self.next_eval <= self.t:
                self.next_eval += self.every
            while self.marks and self.t >= self.marks[0]:
                self.marks.pop(0)
        return hit

    def done(self) -> bool:
        return self.t >= self.end


def evaluate(model, ref, tok, cfg, sets, kl_prompts, device):
    """Greedy accuracy on each held-out set and the on-policy KL probe; off the clock."""
    row = {}
    for name, examples in sets.items():
        row[f"acc_{name}"] = scoring.evaluate(model, tok, examples, cfg, device)[ACC]
    probe = copy.deepcopy(cfg)
    probe.trainer.val_kl_prompts, probe.algorithm.kl_penalty = kl_prompts, "kl"
    probe.actor_rollout_ref.rollout.temperature = 1.0
    kl = on_policy_kl(model, ref, tok, sets["test"], probe, device)
    row.update(kl_probe=kl["val-aux/kl_on_policy"], kl_probe_se=kl["val-aux/kl_on_policy_se"])
    return row


@torch.no_grad()
def format_ceiling(cfg, examples) -> float:
    """The warm start's greedy accuracy if its majority-teacher "Answer: N" were graded like "#### N":
    what switching the answer format alone can reach, with its arithmetic as it is."""
    path = cfg.actor_rollout_ref.model.path
    model, tok = from_pretrained(path), setup_tokenizer(cfg)
    d = cfg.data
    ids, mask = build_prompts(examples, tok, d.prompt_template, d.max_prompt_length, d.truncation)
    out = generate(model, ids, mask, d.max_response_length, do_sample=False, eos_token_id=tok.eos_token_ids,
                   pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(out.responses, out.response_mask)
    score = TASKS["arith"].score
    return sum(score(t.replace("Answer:", "####"), ex) for t, ex in zip(texts, examples)) / len(examples)


def base_config(args, overrides):
    """arith_tiny.yaml, or the config a setting names (`config=configs/dapo_arith.yaml`), with the race's
    own keys (no logging, no validation or checkpoints in the run: the race evaluates) and the overrides."""
    path = next((o.partition("=")[2] for o in overrides if o.startswith("config=")), "configs/arith_tiny.yaml")
    overrides = [o for o in overrides if not o.startswith("config=")]
    return load_config(ROOT / path, [
        f"trainer.default_local_dir={args.out}/nanokl_run", "trainer.logger=[]", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.resume_mode=disable", "trainer.device=cpu",
        "trainer.kl_monitor.enable=false", "trainer.total_training_steps=1000000",
        *([f"actor_rollout_ref.model.path={args.model}"] if args.model else []), *args.common, *overrides])


def train_kl(metrics):
    """The per-token KL the trainer itself logged this step (in the reward, else in the loss)."""
    return metrics.get("actor/reward_kl_penalty", metrics.get("actor/kl_loss"))


def race_nanokl(args, label, overrides, seed, sets):
    cfg = base_config(args, [f"trainer.seed={seed}", *overrides])
    run = setup(cfg, stages=train_missing_stages)
    torch.set_num_threads(args.threads)
    clock, curve, kls, step = Clock(args.budget, args.horizon, args.every), [], [], 0

    def point():
        curve.append({"t": clock.t, "step": step, **evaluate(run.rollout_model, run.ref, run.tok, cfg, sets,
                                                               args.kl_prompts, run.device)})
        say(label, seed, curve[-1])
    if not args.skip_start:
        point()
    while not clock.done():
        t0 = time.perf_counter()
        m = train_ppo.ppo_step(run, step)
        clock.add(time.perf_counter() - t0)
        step += 1
        kls.append({"t": clock.t, "kl": train_kl(m), "score": m["critic/score/mean"],
                    **{k: v for k, v in m.items() if k.startswith("timing_s/")}})
        if clock.due():
            point()
    return {"side": "nanokl", "label": label, "seed": seed, "settings": overrides, "curve": curve, "train": kls,
            "samples": cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n}


def race_trl(args, label, overrides, seed, sets):
    """TRL's GRPOTrainer: `prompts` prompts a step (default: 64 completions a step) with `gens` completions
    each, KL loss at `beta`, sampling (and, as TRL does, every log-prob) at temperature `temp`."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    s = dict(kv.split("=") for kv in parse_setting(f"x:{TRL_DEFAULT}")[1] + overrides)
    lr, gens, beta, temp = float(s["lr"]), int(s["gens"]), float(s["beta"]), float(s["temp"])
    prompts = int(s.get("prompts", 64 // gens))
    cfg = base_config(args, [f"trainer.seed={seed}"])
    path = cfg.actor_rollout_ref.model.path
    score = TASKS["arith"].score
    train, _ = TASKS["arith"].examples(cfg.data, seed=cfg.data.seed)
    tok = AutoTokenizer.from_pretrained(path)
    device = torch.device("cpu")
    evalm, ref = from_pretrained(path), from_pretrained(path).eval().requires_grad_(False)
    nk_tok = setup_tokenizer(cfg)
    truth = {ex["prompt"]: ex for ex in train}

    def reward(prompts, completions, **_):
        return [score(c, truth[p]) for p, c in zip(prompts, completions)]

    clock, curve, kls, state = Clock(args.budget, args.horizon, args.every), [], [], {"step": 0}

    def point(model):
        evalm.load_state_dict(model.state_dict())
        curve.append({"t": clock.t, "step": state["step"], **evaluate(evalm, ref, nk_tok, cfg, sets, args.kl_prompts,
                                                                         device)})
        say(label, seed, curve[-1])

    class Race(TrainerCallback):
        def on_step_begin(self, a, st, control, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, st, control, model=None, **k):
            clock.add(time.perf_counter() - self.t0)
            state["step"] += 1
            if clock.due():
                point(model)
            if clock.done():
                control.should_training_stop = True

        def on_log(self, a, st, control, logs=None, **k):
            if logs and "kl" in logs:
                kls.append({"t": clock.t, "kl": logs["kl"], "score": logs.get("reward")})

    targs = GRPOConfig(output_dir=str(Path(args.out) / "trl_run"), per_device_train_batch_size=prompts * gens,
                       num_generations=gens,
                       gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
                       max_completion_length=cfg.data.max_response_length, temperature=temp, beta=beta,
                       learning_rate=lr, lr_scheduler_type="constant", max_steps=1_000_000, logging_steps=1,
                       save_strategy="no", report_to=[], use_cpu=True, bf16=False, disable_tqdm=True, seed=seed,
                       data_seed=seed, dataloader_num_workers=0, gradient_checkpointing=False)
    data = Dataset.from_list([{"prompt": ex["prompt"]} for ex in train])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.set_num_threads(args.threads)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=targs, train_dataset=data, processing_class=tok,
                          callbacks=[Race()])
    trainer.remove_callback(PrinterCallback)  # its per-step dict would bury the curve
    check_same_prompt_ids(tok, nk_tok, [ex["prompt"] for ex in train[:64]])
    if not args.skip_start:
        point(trainer.model)
    with contextlib.redirect_stdout(sys.stderr):  # its end-of-training summary is not our table
        trainer.train()
    return {"side": "trl", "label": label, "seed": seed, "settings": [f"{k}={v}" for k, v in s.items()],
            "curve": curve, "train": kls, "samples": prompts * gens}


def setup_tokenizer(cfg):
    from nanokl.harness.tokenizer import load_tokenizer
    return load_tokenizer(cfg.actor_rollout_ref.model.tokenizer_path)


def check_same_prompt_ids(hf_tok, nk_tok, prompts):
    for p in prompts:
        a, b = hf_tok(p, add_special_tokens=True)["input_ids"], nk_tok.encode_one(p)
        if a != b:
            raise SystemExit(f"TRL and nanokl tokenize {p!r} differently: {a} vs {b}")


def say(label, seed, row):
    print(f"  {label} s{seed} t={row['t']:6.1f}s step {row['step']:4d}  val {row['acc_val']:.3f}  "
          f"test {row['acc_test']:.3f}  kl {row['kl_probe']:.4f}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# The table and the plot
# ----------------------------------------------------------------------------------------------

def at(curve, t):
    """The evaluation at the first clock reading >= t (the step that crossed t)."""
    return next((p for p in curve if p["t"] >= t), curve[-1])


def summary(r, budget):
    c, tr = r["curve"], r["train"]
    one, two = at(c, budget), at(c, 2 * budget)
    half = [x["kl"] for x in tr if budget / 2 <= x["t"] <= one["t"] and x["kl"] is not None]
    probe_half = [p["kl_probe"] for p in c if budget / 2 <= p["t"] <= one["t"]]
    val_half = [p["acc_val"] for p in c if budget / 2 <= p["t"] <= one["t"]]
    steps = one["step"]
    return {"acc1": one["acc_test"], "acc2": two["acc_test"] if two["t"] >= 2 * budget else None,
            "best": max(p["acc_test"] for p in c), "val1": one["acc_val"], "val_half": statistics.mean(val_half),
            "kl_train": statistics.mean(half) if half else float("nan"),
            "kl_probe": statistics.mean(probe_half) if probe_half else float("nan"), "kl_end": one["kl_probe"],
            "steps": steps, "s_per_step": one["t"] / max(steps, 1)}


def table(results, budget) -> str:
    lines = [f"| side | setting | seed | test acc @ {budget:.0f} s | @ {2 * budget:.0f} s | best test | val acc @ "
             f"{budget:.0f} s | val acc, 2nd-half mean | train KL, 2nd half | probe KL, 2nd half | probe KL @ {budget:.0f} s | steps | s/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = summary(r, budget)
        acc2 = f"{s['acc2']:.3f}" if s["acc2"] is not None else "-"
        lines.append(f"| {r['side']} | {r['label']} | {r['seed']} | {s['acc1']:.3f} | {acc2} | {s['best']:.3f} | "
                     f"{s['val1']:.3f} | {s['val_half']:.3f} | {s['kl_train']:.4f} | {s['kl_probe']:.4f} | {s['kl_end']:.4f} | "
                     f"{s['steps']} | {s['s_per_step']:.3f} |")
    groups = {}
    for r in results:
        groups.setdefault((r["side"], r["label"]), []).append(summary(r, budget))
    if any(len(g) > 1 for g in groups.values()):
        lines += ["", f"| side | setting | seeds | median test acc @ {budget:.0f} s | median @ {2 * budget:.0f} s | "
                      "median train KL, 2nd half | median probe KL, 2nd half | median s/step |", "|---|---|---|---|---|---|---|---|"]
        for (side, label), g in groups.items():
            med = {k: statistics.median(x[k] for x in g if x[k] is not None) if any(x[k] is not None for x in g)
                   else float("nan") for k in ("acc1", "acc2", "kl_train", "kl_probe", "s_per_step")}
            acc2 = "-" if med["acc2"] != med["acc2"] else f"{med['acc2']:.3f}"  # nan: no run reached 2x
            lines.append(f"| {side} | {label} | {len(g)} | {med['acc1']:.3f} | {acc2} | "
                         f"{med['kl_train']:.4f} | {med['kl_probe']:.4f} | {med['s_per_step']:.3f} |")
    return "\n".join(lines)


def plot(results, budget, path, ceiling=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"nanokl": "tab:blue", "trl": "tab:orange"}
    seen = set()
    for r in results:
        key = (r["side"], r["label"])
        name = f"{r['side']} {r['label']}" if key not in seen else None
        seen.add(key)
        c = colors.get(r["side"])
        ls = "-" if r["side"] == "nanokl" else "--"
        ax1.plot([p["t"] for p in r["curve"]], [p["acc_test"] for p in r["curve"]], ls, color=c, alpha=0.8, label=name)
        ax2.plot([p["t"] for p in r["curve"]], [p["kl_probe"] for p in r["curve"]], ls, color=c, alpha=0.8, label=name)
    if ceiling is not None:
        ax1.axhline(ceiling, color="grey", ls=":", lw=1, label="warm start, any answer format graded")
    for ax in (ax1, ax2):
        ax.axvline(budget, color="grey", lw=0.8)
        ax.set_xlabel("seconds of training steps (2 CPU threads)")
    ax1.set_ylabel("test accuracy (512 held-out, greedy)")
    ax2.set_ylabel("on-policy per-token KL to the warm start")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=float, default=212.0, help="seconds of training-step time (the 1x budget)")
    ap.add_argument("--horizon", type=int, default=2, help="run to this multiple of the budget")
    ap.add_argument("--every", type=float, default=20.0, help="seconds of clock between evaluations")
    ap.add_argument("--seeds", default="42", help="comma list; nanokl's trainer.seed, TRL's seed")
    ap.add_argument("--nanokl", action="append", default=None, metavar="LABEL[:key=v,...]",
                    help="a nanokl setting (repeatable); default: the config's default")
    ap.add_argument("--trl", action="append", default=None, metavar="LABEL[:lr=..,gens=..,prompts=..,beta=..,temp=..]",
                    help=f"a TRL setting (repeatable); default: {TRL_DEFAULT}")
    ap.add_argument("--no-nanokl", action="store_true")
    ap.add_argument("--no-trl", action="store_true")
    ap.add_argument("--common", action="append", default=[], help="key=value for every nanokl config (and TRL's data)")
    ap.add_argument("--model", default=None, help="warm start (default: the config's, trained if missing)")
    ap.add_argument("--test-size", type=int, default=512)
    ap.add_argument("--test-seed", type=int, default=20261203)
    ap.add_argument("--val-size", type=int, default=None, help="default: the config's data.num_val")
    ap.add_argument("--kl-prompts", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-start", action="store_true", help="no evaluation of the warm start (a grid's screen)")
    ap.add_argument("--out", default="runs/race")
    ap.add_argument("--plot", default=None, help="write the plot here (needs matplotlib)")
    ap.add_argument("--report", default=None, help="only print the table (and plot) of the curves in this folder")
    ap.add_argument("--tiny", action="store_true", help="seconds: tiny budget and held-out sets, no TRL")
    args = ap.parse_args(argv)
    if args.tiny:
        args.budget, args.horizon, args.every, args.test_size, args.val_size, args.kl_prompts = 3.0, 2, 1.5, 16, 8, 4
        args.no_trl = True
    if args.report:
        results = [json.loads(p.read_text()) for p in sorted(Path(args.report).glob("*.json"))]
        budget = results[0]["budget"]
    else:
        results, budget = run_all(args), args.budget
    print(table(results, budget))
    cfg, sets = held_out(args)
    ceiling = format_ceiling(cfg, sets["test"])
    print(f"\nthe warm start's test accuracy with either answer format graded (greedy): {ceiling:.3f}")
    if args.plot:
        plot(results, budget, args.plot, ceiling)
    return results


def held_out(args):
    """The config and the two held-out sets (the module docstring)."""
    if args.val_size is not None and f"data.num_val={args.val_size}" not in args.common:
        args.common = [*args.common, f"data.num_val={args.val_size}"]
    cfg = base_config(args, [])
    _, val = TASKS["arith"].examples(cfg.data, num_train=0, seed=cfg.data.seed)
    return cfg, {"val": val, "test": test_set(cfg, val, args.test_size, args.test_seed)}


def run_all(args):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg, sets = held_out(args)
    setup(copy.deepcopy(cfg), stages=train_missing_stages)  # trains the warm start if it is missing, before any clock starts
    have_trl = not args.no_trl
    if have_trl:
        try:
            import trl  # noqa: F401
        except ImportError:
            print("trl is not installed (pip install -e .[bench]): racing nanokl alone", file=sys.stderr)
            have_trl = False
    runs = [("nanokl", *parse_setting(s)) for s in (args.nanokl or ["default"])] if not args.no_nanokl else []
    runs += [("trl", *parse_setting(s)) for s in (args.trl or [f"g8_lr2e-5:{TRL_DEFAULT}"])] if have_trl else []
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for side, label, overrides in runs:
            r = (race_nanokl if side == "nanokl" else race_trl)(args, label, overrides, seed, sets)
            r["budget"] = args.budget
            (out / f"{side}_{label}_s{seed}.json").write_text(json.dumps(r))
            results.append(r)
    return results


if __name__ == "__main__":
    main()

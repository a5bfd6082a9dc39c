"""nanokl's DPO against TRL's DPOTrainer: one batch's loss and gradient, then the same training.

    python bench/dpo_trl.py check                                   # loss + gradient equality (pip install -e .[bench])
    python bench/dpo_trl.py race --betas 0.05,0.1,0.3,0.5 --seeds 42
    python bench/dpo_trl.py race --betas 0.1 --seeds 43,44
    python bench/dpo_trl.py report                                  # the tables, from runs/dpo_trl/*.json

The check. The warm start in float64, moved off itself by seeded noise (the policy) and as it is
(the reference); 8 (chosen, rejected) pairs of the ranked warm-start samples, the same token ids on
both sides. nanokl: `dpo.update_policy` with an optimizer that records the gradient instead of
stepping; TRL: `DPOTrainer.compute_loss` on its collator's batch, then autograd. Conventions
aligned: no label smoothing (TRL's default 0), the reference a separate frozen model on both sides,
temperature 1. IPO: TRL averages each response's log-probs over its tokens (its comment: as the
IPO authors ran it), nanokl sums them as the paper writes h; the check compares nanokl's IPO on
length-averaged log-probs (its own functions) with TRL's, and prints the native gap too. nanokl's
step takes logits in fp32 (forwards.response_logits), so the check also runs nanokl with float64
logits (the same slicing, no cast): that is the 1e-6 comparison; the fp32 one is float rounding.

The race. The same pairs in the same order for both: step s takes the 64 prompts
`batch_indices(rows, 64, s, seed)` and from each the pair `draw_responses(row, 2, seed, s, i)`,
which for seed = data.seed (42) is exactly what `python train_ppo.py --config
configs/offline_dpo.yaml` draws; other seeds change only the draw (the held-out problems depend on
data.seed, so it stays 42). nanokl runs train_ppo.dpo_step with its responses taken from that
list; TRL runs DPOTrainer on the same list, pre-tokenized (its own tokenization would append an
EOS to the cut-off responses) and read in order. Both: the warm start, β, AdamW(lr 5e-5, betas
0.9/0.999, weight decay 0.01 on every weight, eps 1e-8) at a constant rate, 32 pairs per optimizer
step (offline_dpo's mini-batch: 2 per step, 200 in 100 steps), gradient clip 1.0, fp32, 2 threads.
Both are graded by nanokl's code: greedy accuracy on the config's 256 validation problems
(scoring.evaluate), the on-policy KL probe (per-token k1 on fresh samples of the first 128 of them
at temperature 1), and the pair accuracy (chosen implicit reward above rejected) on the training
pairs and on the held-out rankings (rm_data/val.jsonl, every implied pair).

Why DPO collapses here (`analyse`): on the pairs of the first 25 steps, per kind of pair (which
preference key decided it: the rule, the "#### N" format, or length), the mean change of the
chosen and the rejected sequence log-probs from the reference, the pair accuracy and each kind's
share of the remaining gradient weight σ(−βh); and what the greedy answers look like.
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
from nanokl import dpo, forwards  # noqa: E402
from nanokl.engine.batching import Batching  # noqa: E402
from nanokl.harness.config.load import load_config  # noqa: E402
from nanokl.harness.data import batch_indices, build_prompts  # noqa: E402
from nanokl.harness.hf_format import from_pretrained  # noqa: E402
from nanokl.harness.logged import draw_responses, logged_batch, read_logged  # noqa: E402
from nanokl.harness.run import setup  # noqa: E402
from nanokl.supervised.stages import train_missing_stages  # noqa: E402
from nanokl.harness import scoring  # noqa: E402
from nanokl.harness.scoring import on_policy_kl  # noqa: E402
from nanokl.harness.tokenizer import load_tokenizer  # noqa: E402
from nanokl.ppo import logprobs_from_logits  # noqa: E402
from nanokl.supervised.preference_data import preference_key, read_preferences  # noqa: E402
from nanokl.tasks import TASKS  # noqa: E402

ACC = "val-core/arith/acc/mean@1"
OUT = ROOT / "runs" / "dpo_trl"
KINDS = ("rule", "format", "length")


def config(beta=0.05, steps=100):
    return load_config(ROOT / "configs" / "offline_dpo.yaml", [
        f"algorithm.kl_ctrl.kl_coef={beta}", f"trainer.total_training_steps={steps}", "trainer.logger=[]",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.resume_mode=disable", "trainer.device=cpu", "trainer.kl_monitor.enable=false",
        f"trainer.default_local_dir={OUT / 'nanokl_run'}"])


def logged_rows(cfg, tok, path=None):
    d = cfg.data
    return read_logged(path or d.offline_files, tok, template=d.prompt_template, max_prompt_length=d.max_prompt_length,
                       max_response_length=d.max_response_length, need_ranking=True)


def pair_list(rows, seed, steps, batch):
    """[(row, chosen, rejected)] per step: the draw of nanokl's logged step with data.seed = `seed`."""
    out = []
    for s in range(steps):
        idx = batch_indices(len(rows), batch, s, seed, True)
        out.append([(i, *draw_responses(rows[i], 2, seed, s, i)) for i in idx])
    return out


def as_batch(rows, pairs, tok, d):
    return forwards.rollout_batch(logged_batch([rows[i] for i, _, _ in pairs], [[c, r] for _, c, r in pairs], tok,
                                               d.prompt_template, d.max_prompt_length, d.truncation))


def prompt_ids(rows, tok, d):
    ids, mask = build_prompts(rows, tok, d.prompt_template, d.max_prompt_length, d.truncation)
    return [x[m.bool()].tolist() for x, m in zip(ids, mask)]


def trl_examples(rows, pairs, tok, d):
    """TRL's tokenized preference rows, token for token what nanokl's batch holds."""
    p = prompt_ids([rows[i] for i, _, _ in pairs], tok, d)
    return [{"prompt_ids": q, "chosen_ids": rows[i]["response_ids"][c], "rejected_ids": rows[i]["response_ids"][r]}
            for q, (i, c, r) in zip(p, pairs)]


def trl_trainer(model, ref, examples, beta, loss_type, out_dir, optimizers=(None, None), **kw):
    """A DPOTrainer that reads `examples` as given (no re-tokenizing) and in order (no shuffle)."""
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoTokenizer, PrinterCallback
    from trl import DPOConfig, DPOTrainer

    class InOrder(DPOTrainer):
        def _prepare_dataset(self, dataset, *a, **k):
            return dataset

        def _get_train_sampler(self, dataset=None):
            return SequentialSampler(dataset if dataset is not None else self.train_dataset)
    args = DPOConfig(output_dir=str(out_dir), beta=beta, loss_type=[loss_type], label_smoothing=0.0, use_cpu=True,
                     bf16=False, report_to=[], save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
                     gradient_checkpointing=False, precompute_ref_log_probs=False, max_length=None,
                     remove_unused_columns=False, **kw)
    t = InOrder(model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(examples),
                processing_class=AutoTokenizer.from_pretrained(config().actor_rollout_ref.model.path),
                optimizers=optimizers)
    t.remove_callback(PrinterCallback)
    return t


@contextlib.contextmanager
def float64_logits():
    """response_logits without its fp32 cast, for the 1e-6 comparison."""
    def logits64(model, mb, temperature, packed=False, inputs=None):
        R = mb["responses"].shape[1]
        return model(mb["sequences"], mb["attention_mask"], mb["position_ids"], logits_to_keep=R + 1)[:, :-1] / temperature
    saved = dpo.response_logits
    dpo.response_logits = logits64
    try:
        yield
    finally:
        dpo.response_logits = saved


class NanoklForTRL(torch.nn.Module):
    """nanokl's model behind the interface DPOTrainer calls (`model(..., labels=, fused_lm_head=True)`
    returning per-token log-probs, 0 where the label is -100): TRL's loss code on nanokl's forward, so
    a difference is the loss's, not the two implementations of the network's."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, input_ids, attention_mask, labels, fused_lm_head=True, **_):
        pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.inner(input_ids, attention_mask, pos)[:, :-1]
        target = labels[:, 1:]
        lp = torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0)[..., None])[..., 0] * (target != -100)
        zeros = torch.zeros_like(lp)
        return argparse.Namespace(log_probs=lp, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())


class Recorder(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {})

    def step(self):
        self.seen = [p.grad.clone() for g in self.param_groups for p in g["params"]]


def nanokl_loss_grad(pol, ref, batch, beta, loss_type, length_mean):
    """nanokl's loss and {name: gradient} on `batch`: the training update (summed log-probs), or for
    IPO with `length_mean` nanokl's functions on per-token-averaged log-probs (TRL's convention)."""
    batch = dict(batch)
    with torch.no_grad():  # compute_log_probs' computation, at the logits' precision (its buffer is fp32)
        batch["ref_log_probs"] = logprobs_from_logits(dpo.response_logits(ref, batch, 1.0), batch["responses"])
    names = [n for n, _ in pol.named_parameters()]
    if not length_mean:
        opt = Recorder(pol.parameters())
        a = argparse.Namespace(objective={"sigmoid": "dpo", "ipo": "ipo"}[loss_type], ppo_epochs=1, grad_clip=1e30)
        m = dpo.update_policy(pol, opt, batch, a, 1.0, mini_size=len(batch["responses"]), spec=Batching(), beta=beta)
        return m["actor/dpo_loss"][0], dict(zip(names, opt.seen))
    mask = batch["response_mask"]
    lp = logprobs_from_logits(dpo.response_logits(pol, batch, 1.0), batch["responses"])
    seq = dpo.sequence_log_probs(lp, mask) / mask.sum(-1)
    refs = dpo.sequence_log_probs(batch["ref_log_probs"], mask) / mask.sum(-1)
    losses, _ = dpo.dpo_loss(seq[0::2], seq[1::2], refs[0::2], refs[1::2], beta, loss_type)
    loss = losses.mean()
    grads = torch.autograd.grad(loss, list(pol.parameters()))
    return loss.item(), dict(zip(names, grads))


def check(args):
    from transformers import AutoModelForCausalLM
    cfg = config()
    path, d = cfg.actor_rollout_ref.model.path, cfg.data
    tok = load_tokenizer(path)
    rows = logged_rows(cfg, tok)
    pairs = pair_list(rows, d.seed, 1, d.train_batch_size)[0][:args.pairs]
    batch = as_batch(rows, pairs, tok, d)
    pol, ref = from_pretrained(path).double().train(), from_pretrained(path).double().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # off the reference: the pairs get different h, so the gradient weights differ
        for p in pol.parameters():
            p.add_(args.noise * torch.randn(p.shape, generator=g, dtype=p.dtype))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    hf.load_state_dict(pol.state_dict())
    hf_ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    examples = trl_examples(rows, pairs, tok, d)
    print(f"{len(pairs)} pairs, response lengths {batch['response_mask'].sum(-1).tolist()}; policy = warm start "
          f"+ N(0, {args.noise}^2) noise; float64 models")
    print("| loss | β | TRL loss | same forward (nanokl's), float64: |Δ loss| / max |Δ grad| | own forwards, float64 "
          "| own forwards, nanokl as trained (fp32 logits) | max |grad| |")
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    shared, shared_ref = NanoklForTRL(pol), NanoklForTRL(ref).eval()
    for loss_type, beta in (("sigmoid", 0.1), ("sigmoid", 0.5), ("ipo", 0.1), ("ipo", 0.5)):
        cells = []
        for model, model_ref, ctx in ((shared, shared_ref, float64_logits), (hf, hf_ref, float64_logits),
                                      (hf, hf_ref, contextlib.nullcontext)):
            trainer = trl_trainer(hf, hf_ref, examples, beta, loss_type, OUT / "check")
            trainer.ref_model = model_ref  # compute_loss runs `model` and self.ref_model: either pair of networks
            inputs = trainer.data_collator(examples)
            hf.train(), model.train()
            loss = trainer.compute_loss(model, inputs)
            names = [n.removeprefix("inner.") for n, _ in model.named_parameters()]
            tg = dict(zip(names, torch.autograd.grad(loss, list(model.parameters()))))
            loss = loss.item()
            with ctx():
                nl, ng = nanokl_loss_grad(pol, ref, batch, beta, loss_type, length_mean=loss_type == "ipo")
            dl, dg = abs(nl - loss), max(float((ng[n] - tg[n]).abs().max()) for n in tg)
            cells.append(f"{dl:.1e} / {dg:.1e}")
            if model is shared:
                worst, trl_loss, scale = max(worst, dl, dg), loss, max(float(t.abs().max()) for t in tg.values())
        print(f"| {loss_type}{' (token-mean log-probs)' * (loss_type == 'ipo')} | {beta} | {trl_loss:.6f} | "
              + " | ".join(cells) + f" | {scale:.2e} |")
        if loss_type == "ipo":  # nanokl's own IPO (summed log-probs) is another h: the gap is by design
            with float64_logits():
                nl, _ = nanokl_loss_grad(pol, ref, batch, beta, "ipo", length_mean=False)
            print(f"| ipo: nanokl's own, h on summed log-probs (the paper's) | {beta} | {trl_loss:.6f} | "
                  f"{nl:.6f} (another h, by design) | | | |")
    with torch.no_grad(), float64_logits():  # what the two networks alone differ by
        mine = logprobs_from_logits(dpo.response_logits(pol, batch, 1.0), batch["responses"])
        inputs = trainer.data_collator(examples)
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        theirs = hf(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels,
                    fused_lm_head=True).log_probs
    P, theirs = len(examples), theirs[:, -(inputs["input_ids"].shape[1] - 1):]  # column t: token t + 1
    gap = 0.0
    for j in range(2 * P):
        row = j // 2 if j % 2 == 0 else P + j // 2  # nanokl's rows alternate; TRL's are all chosen, then rejected
        n, start = int(batch["response_mask"][j].sum()), len(examples[j // 2]["prompt_ids"]) - 1
        gap = max(gap, float((mine[j, :n] - theirs[row, start:start + n]).abs().max()))
    print(f"\nworst difference with the same forward, float64 (loss or gradient element): {worst:.1e} "
          f"({'within' if worst <= 1e-6 else 'OVER'} 1e-6). The two networks' per-token log-probs differ by up to "
          f"{gap:.1e} in float64 (transformers' Qwen2 runs RMSNorm and RoPE in fp32 whatever the dtype).")


# ---------------------------------------------------------------------------------------------
# The race and its evaluation


def held_out_pairs(rows):
    return [(i, rk[a], rk[b]) for i, r in enumerate(rows) for rk in [r["ranking"]]
            for a in range(len(rk)) for b in range(a + 1, len(rk))]


@torch.no_grad()
def pair_stats(model, ref, rows, pairs, tok, d, beta, chunk=256):
    """Per pair: (Δ log π chosen, Δ log π rejected) from the reference, as [P, 2]."""
    out = []
    for i in range(0, len(pairs), chunk):
        b = as_batch(rows, pairs[i:i + chunk], tok, d)
        lp, _ = forwards.compute_log_probs(model, b, 1.0, spec=Batching(micro_size=128))
        rp, _ = forwards.compute_log_probs(ref, b, 1.0, spec=Batching(micro_size=128))
        delta = dpo.sequence_log_probs(lp - rp, b["response_mask"])
        out.append(torch.stack([delta[0::2], delta[1::2]], -1))
    return torch.cat(out)


def pair_kind(row, c, r, score):
    kc, kr = (preference_key(row["responses"][k], row, score) for k in (c, r))
    return next((KINDS[j] for j in range(3) if kc[j] != kr[j]), "tie")


def analyse(model, ref, tok, cfg, data, beta):
    """The collapse in figures: per kind of training pair, and the greedy answers' shape."""
    d, score = cfg.data, TASKS["arith"].score
    rows, pairs = data["rows"], [p for step in data["pairs"][:25] for p in step]
    delta = pair_stats(model, ref, rows, pairs, tok, d, beta)
    h = delta[:, 0] - delta[:, 1]
    w = torch.sigmoid(-beta * h)
    kinds = [pair_kind(rows[i], c, r, score) for i, c, r in pairs]
    per = {}
    for k in sorted(set(kinds)):
        sel = torch.tensor([x == k for x in kinds])
        per[k] = {"pairs": int(sel.sum()), "chosen": float(delta[sel, 0].mean()), "rejected": float(delta[sel, 1].mean()),
                  "acc": float((h[sel] > 0).float().mean()), "weight_share": float(w[sel].sum() / w.sum())}
    samples = []
    scoring.evaluate(model, tok, data["val"], cfg, torch.device("cpu"), samples=samples)
    texts = [s[1] for s in samples]
    shape = {"graded": sum("####" in t for t in texts) / len(texts),
             "answer_format": sum("Answer:" in t for t in texts) / len(texts),
             "mean_chars": statistics.mean(len(t) for t in texts), "examples": texts[:3]}
    return {"kinds": per, "greedy": shape, "both_down": float(((delta[:, 0] < 0) & (delta[:, 1] < 0)).float().mean())}


def evaluate(model, ref, tok, cfg, data, beta, full):
    row = {"acc_val": scoring.evaluate(model, tok, data["val"], cfg, torch.device("cpu"))[ACC]}
    if full:
        probe = copy.deepcopy(cfg)
        probe.trainer.val_kl_prompts, probe.algorithm.kl_penalty = 128, "kl"
        kl = on_policy_kl(model, ref, tok, data["val"], probe, torch.device("cpu"))
        row.update(kl=kl["val-aux/kl_on_policy"], kl_se=kl["val-aux/kl_on_policy_se"])
        delta = pair_stats(model, ref, data["val_rows"], data["val_pairs"], tok, cfg.data, beta)
        row["pair_acc_heldout"] = float((delta[:, 0] > delta[:, 1]).float().mean())
        row["analysis"] = analyse(model, ref, tok, cfg, data, beta)
    return row


def race_nanokl(args, beta, seed, data):
    cfg = config(beta, args.steps)
    run = setup(cfg, stages=train_missing_stages)
    torch.set_num_threads(args.threads)
    d = cfg.data

    def respond(run, rows, step, generator, metrics):  # the shared list instead of nanokl's own draw
        pairs = data["pairs"][step]
        out = logged_batch([data["rows"][i] for i, _, _ in pairs], [[c, r] for _, c, r in pairs], run.tok,
                           d.prompt_template, d.max_prompt_length, d.truncation)
        return out, None
    run.respond = respond
    curve, t_train = [], 0.0
    for step in range(args.steps):
        t0 = time.perf_counter()
        m = train_ppo.dpo_step(run, step)
        t_train += time.perf_counter() - t0
        if (step + 1) in args.evals:
            curve.append({"step": step + 1, "t": t_train, "pair_acc_train": m["actor/dpo_reward_accuracy"],
                          "loss": m["actor/dpo_loss"],
                          **evaluate(run.rollout_model, run.ref, run.tok, cfg, data, beta, step + 1 == args.steps)})
            print(f"nanokl β={beta} s{seed} step {step + 1}: {json.dumps({k: v for k, v in curve[-1].items() if k != 'analysis'})}",
                  file=sys.stderr)
    return curve


def race_trl(args, beta, seed, data):
    from transformers import AutoModelForCausalLM, TrainerCallback
    cfg = config(beta, args.steps)
    path, d, a = cfg.actor_rollout_ref.model.path, cfg.data, cfg.actor_rollout_ref.actor
    tok = load_tokenizer(path)
    evalm, ref = from_pretrained(path), from_pretrained(path).eval().requires_grad_(False)
    per_opt = a.ppo_mini_batch_size  # pairs per optimizer step
    opt_steps = d.train_batch_size // per_opt
    examples = [e for step in data["pairs"] for e in trl_examples(data["rows"], step, tok, d)]
    curve, logs, clock = [], [], {"t": 0.0}

    class Clock(TrainerCallback):  # training-step time only
        def on_step_begin(self, targs, st, control, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, targs, st, control, **k):
            clock["t"] += time.perf_counter() - self.t0

    def after_log(t):  # the Trainer logs each optimizer step after its on_step_end: evaluate here
        step, done = divmod(t.state.global_step, opt_steps)
        if done == 0 and step in args.evals:
            evalm.load_state_dict(t.model.state_dict())
            last = logs[-opt_steps:]
            curve.append({"step": step, "t": clock["t"],
                          "pair_acc_train": statistics.mean(x["rewards/accuracies"] for x in last),
                          "loss": statistics.mean(x["loss"] for x in last),
                          **evaluate(evalm, ref, tok, cfg, data, beta, step == args.steps)})
            print(f"trl β={beta} s{seed} step {step}: "
                  f"{json.dumps({k: v for k, v in curve[-1].items() if k != 'analysis'})}", file=sys.stderr)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf_ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.set_num_threads(args.threads)
    # nanokl's AdamW exactly (HF's default one exempts biases and norms from weight decay), constant rate
    opt = torch.optim.AdamW(model.parameters(), lr=a.optim.lr, betas=tuple(a.optim.betas),
                            weight_decay=a.optim.weight_decay)
    t = trl_trainer(model, hf_ref, examples, beta, "sigmoid", OUT / "trl_run", per_device_train_batch_size=per_opt,
                    gradient_accumulation_steps=1, max_steps=args.steps * opt_steps, learning_rate=a.optim.lr,
                    lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=a.grad_clip, logging_steps=1,
                    seed=seed, optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)))
    orig_log = t.log

    def log(entry, *x, **k):
        out = orig_log(entry, *x, **k)  # DPOTrainer.log adds its metrics to `entry`
        if "loss" in entry and "rewards/accuracies" in entry:
            logs.append(dict(entry))
            after_log(t)
        return out
    t.log = log
    t.add_callback(Clock())
    with contextlib.redirect_stdout(sys.stderr):
        t.train()
    return curve


def load_data(cfg, seed, steps):
    tok = load_tokenizer(cfg.actor_rollout_ref.model.path)
    rows = logged_rows(cfg, tok)
    val_rows = logged_rows(cfg, tok, cfg.reward_model.train.val_data_path)
    _, val = TASKS["arith"].examples(cfg.data, seed=cfg.data.seed)
    return {"rows": rows, "pairs": pair_list(rows, seed, steps, cfg.data.train_batch_size), "val": val,
            "val_rows": val_rows, "val_pairs": held_out_pairs(val_rows)}


def race(args):
    OUT.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        data = load_data(config(), seed, args.steps)
        for beta in args.betas:
            for side in args.sides:
                path = OUT / f"{side}_b{beta}_s{seed}.json"
                if path.exists() and not args.force:
                    continue
                t0 = time.time()
                curve = (race_nanokl if side == "nanokl" else race_trl)(args, beta, seed, data)
                path.write_text(json.dumps({"side": side, "beta": beta, "seed": seed, "steps": args.steps,
                                            "wall_s": time.time() - t0, "curve": curve}, indent=1))


def report(args):
    runs = [json.loads(p.read_text()) for p in sorted(OUT.glob("*_b*_s*.json"))]
    print("| side | β | seed | val acc @25 / @50 / @100 | pair acc, train (last step) | pair acc, held-out | "
          "on-policy KL/token (± s.e.) | train s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(runs, key=lambda r: (r["beta"], r["seed"], r["side"])):
        c, last = {p["step"]: p for p in r["curve"]}, r["curve"][-1]
        accs = " / ".join(f"{c[s]['acc_val']:.3f}" if s in c else "—" for s in (25, 50, 100))
        print(f"| {r['side']} | {r['beta']} | {r['seed']} | {accs} | {last['pair_acc_train']:.3f} | "
              f"{last.get('pair_acc_heldout', float('nan')):.3f} | {last.get('kl', float('nan')):.3f} ± "
              f"{last.get('kl_se', float('nan')):.3f} | {last['t']:.0f} |")
    print("\nThe collapse, at the end of each run (pairs of the first 25 steps; Δ = log π − log π_ref, summed over the response):")
    print("| side | β | seed | kind | share of pairs | Δ chosen | Δ rejected | pair acc | share of σ(−βh) | "
          "both Δ < 0 (all pairs) | greedy: '####' / 'Answer:' / chars |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(runs, key=lambda r: (r["beta"], r["seed"], r["side"])):
        an = r["curve"][-1].get("analysis")
        if not an:
            continue
        n = sum(v["pairs"] for v in an["kinds"].values())
        g = an["greedy"]
        for k, v in an["kinds"].items():
            print(f"| {r['side']} | {r['beta']} | {r['seed']} | {k} | {v['pairs'] / n:.3f} | {v['chosen']:.2f} | "
                  f"{v['rejected']:.2f} | {v['acc']:.3f} | {v['weight_share']:.3f} | {an['both_down']:.3f} | "
                  f"{g['graded']:.2f} / {g['answer_format']:.2f} / {g['mean_chars']:.1f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["check", "race", "report"])
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--noise", type=float, default=0.02)
    p.add_argument("--betas", default="0.05,0.1,0.3,0.5")
    p.add_argument("--seeds", default="42")
    p.add_argument("--sides", default="nanokl,trl")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--evals", default="25,50,100")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    args.betas = [float(b) for b in args.betas.split(",")]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.sides = args.sides.split(",")
    args.evals = {int(s) for s in args.evals.split(",")} | {args.steps}
    {"check": check, "race": race, "report": report}[args.what](args)


if __name__ == "__main__":
    main()

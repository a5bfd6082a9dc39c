"""One GRPO step, nanokl against TRL's GRPOTrainer, in one process on the same model and prompts.

    python bench/step.py                      # both sizes, TRL side by side (pip install -e .[bench])
    python bench/step.py --sizes 24m --steps 8
    python bench/step.py --tiny               # seconds, no TRL needed: the smoke test's mode

The work, identical on both sides:
- GRPO: 8 prompts of the arithmetic task x 4 samples, exactly 32 new tokens each (EOS can never
  end a response: nanokl is given no EOS id, TRL `min_new_tokens=32`), temperature 1;
- a k3 KL loss against the frozen initial model at coefficient 0.04 (TRL: beta=0.04, nanokl:
  use_kl_loss, kl_loss_type=low_var_kl, kl_loss_coef=0.04), no KL in the reward, token-mean loss
  (TRL's default loss_type "dapo" is the same token mean), one optimizer step per batch (TRL:
  num_iterations=1, steps_per_generation=1, gradient_accumulation_steps=1; nanokl: one mini-batch),
  AdamW at the same learning rate, betas, no weight decay, grad clip 1.0;
- random-init Qwen2-shaped models (GQA, qkv bias, tied embeddings), bench/rollout.py's 4m shape and
  its 25m shape with 4 KV heads, which give the issue's parameter counts without the embedding:
    3m:  vocab 4096, hidden 256, 4 layers, 4 heads / 2 KV heads, MLP 704   (4.0M; 3.0M without embeddings)
    24m: vocab 8192, hidden 512, 8 layers, 8 heads / 4 KV heads, MLP 1408  (27.8M; 23.6M without)
  saved once as a Hugging Face checkpoint that both load; the tokenizer is a byte-level BPE trained
  to exactly that vocabulary on the task's prompts and random words;
- the reward, for both, is the share of digits in the decoded response (a random-init policy never
  solves a sum, and all-zero rewards would leave the policy still): advantages and the KL move.

What each does per step: TRL generates with transformers' `generate`, runs the reference forward
(beta != 0) and the training forward/backward; it skips the old-log-prob forward because with one
update per batch the ratio is computed against the detached current log-probs. nanokl runs its own
rollout, takes the old log-probs from it (algorithm.rollout_correction.bypass_mode=auto), then the
reference forward and the update: the same count of forwards. TRL's GRPOConfig turns gradient
checkpointing on by default (one more forward inside the backward); nanokl's config has it off, so
the bench turns TRL's off too (`--trl-checkpointing on` measures TRL's default instead). nanokl's time is train_ppo.ppo_step's
`timing_s/step`; TRL's is the time from the trainer's on_step_begin to on_step_end (generation,
scoring, forwards, backward, optimizer step). The two alternate step by step in this process
(nanokl runs inside TRL's on_step_end callback), so both share the VM's noise; after `--warmup`
steps each, the median of `--steps` steps is reported.

FLOP floor: the matmul FLOPs of nanokl's step (2 per weight per token; attention QK and PV
at each token's context; the LM head only where logits are used): rollout = prefill of the 8
prompts + 32 decode tokens x 32 rows; reference forward and training forward over the 32 sequences
(prompt + response), backward = 2 x forward. Divided by this machine's fp32 matmul rate from a GEMM
probe (1024^3, same thread count), it is the time a step would take if every FLOP ran at GEMM
speed; `floor %` = that time / nanokl's measured step.
"""

import argparse
import contextlib
import random
import types
import statistics
import string
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import train_ppo  # noqa: E402
from nanokl.harness.config.load import load_config  # noqa: E402
from nanokl.harness.hf_format import save_pretrained  # noqa: E402
from nanokl.harness.run import setup  # noqa: E402
from nanokl.supervised.stages import train_missing_stages  # noqa: E402
from nanokl.harness.tokenizer import train_tokenizer  # noqa: E402
from nanokl.engine.model import CausalLM, ModelConfig, init_weights  # noqa: E402
from nanokl.tasks import TASKS  # noqa: E402

SHAPES = {  # the 3.0M and 23.6M count the parameters without the embedding
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "3m": dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2),
    "24m": dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=4),
}
PROMPTS, N, NEW, BETA, LR = 8, 4, 32, 0.04, 1e-5


def digit_share(text, example=None, method=None):
    return sum(c.isdigit() for c in text) / max(1, len(text))


# the arithmetic prompts, scored by digit_share; a task is known once it is in the table
TASKS["bench_digits"] = types.SimpleNamespace(examples=TASKS["arith"].examples, score=digit_share,
                                              demonstrations=None)


def make_checkpoint(size, root, prompts):
    """Tokenizer of exactly the shape's vocabulary + random-init Qwen2 weights, HF format."""
    path = Path(root) / size
    rng = random.Random(0)
    words = [" " + "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7))) for _ in range(60000)]
    tok = train_tokenizer(prompts + ["".join(words[i:i + 50]) for i in range(0, len(words), 50)],
                          vocab_size=SHAPES[size]["vocab_size"])
    assert tok.vocab_size == SHAPES[size]["vocab_size"], tok.vocab_size
    torch.manual_seed(0)
    cfg = ModelConfig(model_type="qwen2", tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=256,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **SHAPES[size])
    model = init_weights(CausalLM(cfg))
    save_pretrained(model, path)
    tok.save(path)
    params = sum(p.numel() for p in model.parameters())
    return path, params, params - model.model.embed_tokens.weight.numel()


def nanokl_run(path, run_dir, threads, overrides=()):
    cfg = load_config(ROOT / "configs" / "grpo_arith.yaml", ["data.task=bench_digits",
        f"actor_rollout_ref.model.path={path}", f"trainer.default_local_dir={run_dir}", "trainer.device=cpu",
        "trainer.logger=[]", "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
        "trainer.kl_monitor.enable=false", "trainer.total_training_steps=1000", "data.num_val=0",
        f"data.train_batch_size={PROMPTS}", f"actor_rollout_ref.rollout.n={N}", f"data.max_response_length={NEW}",
        "actor_rollout_ref.actor.strategy=none", f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={PROMPTS * N}",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        f"actor_rollout_ref.actor.kl_loss_coef={BETA}", f"actor_rollout_ref.actor.optim.lr={LR}",
        "actor_rollout_ref.actor.optim.weight_decay=0.0", "actor_rollout_ref.rollout.temperature=1.0",
        "algorithm.use_kl_in_reward=false", *overrides])
    run = setup(cfg, stages=train_missing_stages)
    run.tok.eos_token_ids = []  # EOS never ends a response: exactly NEW tokens, like TRL's min_new_tokens
    torch.set_num_threads(threads)
    return run


def trl_trainer(path, out_dir, prompts, examples, total_steps, threads, callback, checkpointing=False):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    tok = AutoTokenizer.from_pretrained(path)

    def reward(completions, **_):
        return [digit_share(c) for c in completions]
    args = GRPOConfig(output_dir=str(out_dir), per_device_train_batch_size=PROMPTS * N, num_generations=N,
                      gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
                      max_completion_length=NEW, generation_kwargs={"min_new_tokens": NEW}, temperature=1.0,
                      beta=BETA, learning_rate=LR, weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="constant",
                      max_steps=total_steps, logging_steps=10_000, save_strategy="no", report_to=[], use_cpu=True,
                      bf16=False, disable_tqdm=True, seed=0, dataloader_num_workers=0,
                      gradient_checkpointing=checkpointing)
    data = Dataset.from_list([{"prompt": p, "ground_truth": ex["ground_truth"]} for p, ex in zip(prompts, examples)])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.set_num_threads(threads)
    return GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok,
                       callbacks=[callback])


def step_flops(shape, prompt_len):
    """Matmul FLOPs of one nanokl step (see the module docstring), at the mean prompt length."""
    H, I, L, V = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["vocab_size"]
    hd = H // shape["num_attention_heads"]
    q, kv = H, shape["num_key_value_heads"] * hd
    lin = 2 * L * (H * q + 2 * H * kv + q * H + 3 * H * I)  # per token
    attn = 4 * L * q  # per token per key in its context (QK^T and PV)
    head = 2 * H * V
    P, R, rows = prompt_len, NEW, PROMPTS * N
    prefill = PROMPTS * (P * lin + attn * P * (P + 1) / 2 + head)
    decode = rows * sum(lin + attn * (P + t + 1) + head for t in range(R))
    T = P + R
    forward = rows * (T * lin + attn * T * (T + 1) / 2 + R * head)
    return prefill + decode + forward + 3 * forward  # rollout, reference, train (fwd + 2x bwd)


def gemm_flops_per_s(n=1024, reps=5):
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def bench(size, args, tmp):
    task = TASKS["arith"]
    cfg = load_config(ROOT / "configs" / "grpo_arith.yaml")
    train, _ = task.examples(cfg.data, num_train=PROMPTS * (args.warmup + args.steps + 2), num_val=0, seed=0)
    prompts = [ex["prompt"] for ex in train]
    path, params, non_emb = make_checkpoint(size, tmp, prompts)
    run = nanokl_run(path, Path(tmp) / f"run_{size}", args.threads, args.set)
    prompt_len = statistics.mean(len(run.tok.encode_one(p)) for p in prompts)
    times = {"nanokl": [], "trl": []}
    parts = []
    state = {"step": 0}

    def nanokl_step():
        m = train_ppo.ppo_step(run, state["step"])
        state["step"] += 1
        times["nanokl"].append(m["timing_s/step"])
        parts.append({k: v for k, v in m.items() if k.startswith("timing_s/")})

    have_trl = not args.tiny and not args.no_trl
    if have_trl:
        try:
            import trl
        except ImportError:
            print("trl is not installed (pip install -e .[bench]): measuring nanokl alone", file=sys.stderr)
            have_trl = False
    total = args.warmup + args.steps
    if have_trl:
        from transformers import TrainerCallback

        class Alternate(TrainerCallback):  # time TRL's step, then run one nanokl step before TRL's next
            def on_step_begin(self, *a, **k):
                self.t = time.perf_counter()

            def on_step_end(self, *a, **k):
                times["trl"].append(time.perf_counter() - self.t)
                nanokl_step()
        trainer = trl_trainer(path, Path(tmp) / f"trl_{size}", prompts, train, total, args.threads, Alternate(),
                              checkpointing=args.trl_checkpointing == "on")
        with contextlib.redirect_stdout(sys.stderr):  # its end-of-training summary is not our table
            trainer.train()
        version = trl.__version__
    else:
        for _ in range(total):
            nanokl_step()
        version = None
    med = {k: statistics.median(v[args.warmup:]) if len(v) > args.warmup else None for k, v in times.items()}
    floor = step_flops(SHAPES[size], prompt_len) / gemm_flops_per_s()
    breakdown = {k.split("/")[1]: statistics.median(p[k] for p in parts[args.warmup:])
                 for k in parts[-1] if k != "timing_s/step"}
    return dict(size=size, params=params, non_emb=non_emb, nanokl=med["nanokl"], trl=med["trl"], trl_version=version,
                floor=floor, breakdown=breakdown, threads=torch.get_num_threads(),
                spread={k: (min(v[args.warmup:]), max(v[args.warmup:])) for k, v in times.items() if v})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="3m,24m", help="comma list of tiny,3m,24m")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per implementation (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per implementation first")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--no-trl", action="store_true", help="measure nanokl alone")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a nanokl config override, e.g. actor_rollout_ref.model.use_remove_padding=false")
    ap.add_argument("--trl-checkpointing", choices=["off", "on"], default="off",
                    help="TRL's gradient checkpointing: off = the same work as nanokl (which does not recompute); "
                         "on = GRPOConfig's own default, one more forward per step for TRL")
    ap.add_argument("--tiny", action="store_true", help="the smoke mode: tiny shape, 1+2 steps, no TRL")
    args = ap.parse_args(argv)
    if args.tiny:
        args.sizes, args.steps, args.warmup = "tiny", 2, 1
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            rows.append(bench(size, args, tmp))
            r = rows[-1]
            print(f"{size}: nanokl {r['nanokl']:.3f} s/step, TRL {r['trl'] or float('nan'):.3f}; nanokl parts "
                  + ", ".join(f"{k} {v:.3f}" for k, v in r["breakdown"].items()), file=sys.stderr, flush=True)
    version = next((r["trl_version"] for r in rows if r["trl_version"]), None)
    print(f"GRPO step, {PROMPTS} prompts x {N} samples, {NEW} new tokens, k3 KL loss {BETA}, one update; "
          f"{rows[0]['threads']} threads; TRL {version or 'not measured'}; median of {args.steps} steps "
          f"after {args.warmup} warm-up, alternating; TRL gradient checkpointing {args.trl_checkpointing}" + (f"; nanokl {' '.join(args.set)}" if args.set else ""))
    print("| model | params (non-emb.) | nanokl s/step | TRL s/step | TRL / nanokl | nanokl floor s | floor % |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        trl_s = f"{r['trl']:.3f}" if r["trl"] else "-"
        ratio = f"{r['trl'] / r['nanokl']:.2f}x" if r["trl"] else "-"
        print(f"| {r['size']} | {r['params'] / 1e6:.1f}M ({r['non_emb'] / 1e6:.1f}M) | {r['nanokl']:.3f} | {trl_s} | "
              f"{ratio} | {r['floor']:.3f} | {100 * r['floor'] / r['nanokl']:.0f}% |")
    return rows


if __name__ == "__main__":
    main()

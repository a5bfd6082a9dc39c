"""End-to-end PPO throughput on one GPU: GSM8K prompts, a Qwen2.5-0.5B-shaped random-init model.

    python bench/ppo_gpu.py --data ../shared/data/gsm8k/train.jsonl --out OUT   # on a lent GPU
    python bench/ppo_gpu.py --shape tiny --device cpu --data ... --out /tmp/x   # CPU smoke of the script

No real checkpoint can be downloaded on the benchmark machine, so the policy is random-init with
Qwen2.5-0.5B's exact shape (what the speed depends on) and a byte-level BPE trained here on the
GSM8K questions. A random policy rarely emits EOS, so every response runs to
max_response_length: the step does the most work it can. Runs `train_ppo.main` with the GSM8K
config (fsdp2 strategy at world size 1, bf16 rollout copy, CUDA graphs) for a few steps and prints
perf/throughput (tokens/s/GPU), the timing_s/* breakdown and peak GPU memory from metrics.jsonl,
and how the actor was wrapped: under `torchrun --nproc_per_node=1` fsdp2 must really shard (every
parameter a DTensor on a 1-rank mesh); plain `python` has no process group and leaves it unwrapped.
It also runs one actor micro-batch forward to name its attention kernels, reads the rollout graph
engine's captures and rebuilds, and the first step's KL (0 when the reference runs at the actor's
precision). These figures also go to OUT/summary.json (keys strategy, world, sharded, mesh, ...), which
bench/gpu_summary.py reads. It writes no checkpoint (trainer.save_freq=-1: a 0.5B one with both
Adam states is ~12 GB, minutes of the GPU check's budget); summary.json counts any that appeared
as `checkpoints`. bench/gpu_check.sh runs it as `python3 -m torch.distributed.run --standalone
--nproc_per_node=1 bench/ppo_gpu.py ...` (the GPU machine has no `torchrun` or `python`).
"""

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train_ppo  # noqa: E402
from nanokl import dist, workers  # noqa: E402
from nanokl.attention import record_kernels  # noqa: E402
from nanokl.graphs import engine_stats  # noqa: E402
from nanokl.harness.hf_format import save_pretrained  # noqa: E402
from nanokl.model import CausalLM, ModelConfig, init_weights  # noqa: E402
from nanokl.harness.tokenizer import train_tokenizer  # noqa: E402
from nanokl.harness.tracking import read_metrics  # noqa: E402

SHAPES = {
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2),
    "tiny": dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}


def train(argv):
    """train_ppo.main, keeping the Run so that the bench can say how the actor was wrapped."""
    run = train_ppo.setup(train_ppo.parse_cli(argv))
    for step in train_ppo.steps(run):
        if not train_ppo.end_step(run, step, train_ppo.ppo_step(run, step)):
            break
    run.tracker.close()
    return run


def sharding(model):
    """(sharded, mesh size, how many parameters are DTensors, how many parameters)."""
    params = list(dist.unwrap(model).parameters())
    dtensors = [p for p in params if type(p).__name__ == "DTensor"]
    mesh = dtensors[0].device_mesh.size() if dtensors else None
    return len(dtensors) == len(params) > 0, mesh, len(dtensors), len(params)


def actor_kernels(run):
    """The attention kernels one actor micro-batch runs (the update's forward, under its autocast and
    packing setting): a left-padded micro-batch of 4 responses of different lengths."""
    spec, dev = run.specs["actor"], run.device
    P, R, V = 24, 16, run.actor_vocab
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(3, V, (4, P + R), generator=g)
    mask = torch.ones(4, P + R, dtype=torch.long)
    for i in range(4):
        mask[i, :3 * i] = 0  # left padding
        mask[i, P + R - 2 * i:] = 0  # shorter responses
    mb = {"sequences": seqs, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
          "responses": seqs[:, P:], "response_mask": mask[:, P:]}
    mb = {k: v.to(dev) for k, v in mb.items()}
    with torch.no_grad(), workers.autocast(dev), record_kernels() as names:
        workers.response_logits(run.actor, mb, 1.0, spec.packed)
    return f"{'packed' if spec.packed else 'padded'}: " + ", ".join(sorted(set(names)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="GSM8K train.jsonl")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="0.5b", choices=SHAPES)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=128, help="prompts per step")
    ap.add_argument("--response", type=int, default=256, help="max response tokens")
    ap.add_argument("--strategy", choices=["none", "ddp", "fsdp2"], help="actor (and critic, reference) strategy; "
                    "default: the config's (fsdp2)")
    args = ap.parse_args()
    out = Path(args.out)
    model_dir = out / "model"
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    tok = train_tokenizer([r["question"] + "\n" + r["answer"] for r in rows[:4000]], vocab_size=2048)
    cfg = ModelConfig(model_type="qwen2", attention_bias=True, tie_word_embeddings=True, rope_theta=1e6,
                      **SHAPES[args.shape])
    torch.manual_seed(0)
    model = CausalLM(cfg)
    init_weights(model)
    save_pretrained(model, model_dir, dtype=torch.bfloat16 if args.device == "cuda" else None)
    tok.save(model_dir)
    del model
    run_dir = out / "run"
    B, mini = args.batch, max(1, args.batch // 2)
    argv = ["--config", str(ROOT / "configs" / "gsm8k_qwen2.5_0.5b.yaml"),
            f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={args.data}",
            f"data.val_files={args.data}", f"data.train_batch_size={B}", f"data.max_response_length={args.response}",
            "data.max_prompt_length=256", "data.truncation=left", "data.prompt_template=plain",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}", f"critic.ppo_mini_batch_size={mini}",
            # the config's micro-batch of 4 must divide the mini-batch (the CPU smoke runs --batch 4)
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={math.gcd(4, mini)}",
            f"critic.ppo_micro_batch_size_per_gpu={math.gcd(4, mini)}",
            f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
            # no checkpoint: a 0.5B one (actor, critic, their Adam states) is ~12 GB, minutes of the GPU check
            "trainer.save_freq=-1", f"trainer.device={args.device}", f"trainer.default_local_dir={run_dir}",
            "trainer.logger=[jsonl]", "trainer.resume_mode=disable"]
    if args.strategy:
        argv.append(f"actor_rollout_ref.actor.strategy={args.strategy}")
    run = train(argv)
    strategy, world = run.cfg.actor_rollout_ref.actor.strategy, dist.world()
    sharded, mesh, n_dt, n_p = sharding(run.actor)  # before any no-grad forward, which leaves the root unsharded
    run.actor_vocab = SHAPES[args.shape]["vocab_size"]
    kernels = actor_kernels(run)
    engine = engine_stats(dist.unwrap(run.rollout_model))
    print(f"actor micro-batch attention: {kernels}\nrollout graph engine over {args.steps} steps: {engine}")
    print(f"{strategy} at world size {world} ({'torchrun' if dist.active() else 'no process group'}): sharded "
          f"{'yes' if sharded else 'no'} ({n_dt}/{n_p} actor parameters DTensor, mesh of {mesh}); "
          f"rollout copy {'yes' if run.rollout_copy else 'no'}")
    del run
    metrics = [r for r in read_metrics(run_dir) if "timing_s/step" in r]
    steady = metrics[1:] or metrics  # the first step captures CUDA graphs and warms the allocator
    keys = sorted({k for r in steady for k in r if k.startswith("timing_s/")})
    print(f"| metric | mean over steps 2..{len(metrics)} |\n|---|---|")
    for k in ["perf/throughput", "perf/total_num_tokens", "response_length/mean", *keys]:
        vals = [r[k] for r in steady if k in r]
        if vals:
            print(f"| {k} | {sum(vals) / len(vals):.2f} |")
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
    if peak is not None:
        print(f"| peak GPU memory (GiB) | {peak:.1f} |")

    def mean(k):
        vals = [r[k] for r in steady if k in r]
        return sum(vals) / len(vals) if vals else None
    summary = out / "summary.json"  # merged: other figures of the GPU check may already be there
    fields = json.loads(summary.read_text()) if summary.exists() else {}
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("global_step_*"))  # none expected: save_freq=-1
    if saved:
        print(f"checkpoints written despite trainer.save_freq=-1: {saved}")
    new = dict(steps=len(metrics), checkpoints=len(saved), strategy=strategy, world=world,
               sharded="yes" if sharded else "no", mesh=mesh,
               throughput=mean("perf/throughput"), peak_gib=peak, timing={k: mean(k) for k in keys},
               attention_kernel=kernels, engine=engine,
               kl_step0=metrics[0].get("actor/reward_kl_penalty") if metrics else None,
               log_prob_max_diff=max((r["rollout/log_prob_max_diff"] for r in metrics
                                      if "rollout/log_prob_max_diff" in r), default=None))
    fields.update({k: v for k, v in new.items() if v is not None})  # absent, not null: readers use defaults
    summary.write_text(json.dumps(fields, indent=1))
    dist.destroy()  # torchrun started us: leave the process group before exiting


if __name__ == "__main__":
    main()

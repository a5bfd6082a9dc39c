"""End-to-end PPO throughput on one GPU: GSM8K prompts, a Qwen2.5-0.5B-shaped random-init model.

    python bench/ppo_gpu.py --data ../shared/data/gsm8k/train.jsonl --out OUT   # on a lent GPU
    python bench/ppo_gpu.py --shape tiny --device cpu --data ... --out /tmp/x   # CPU smoke of the script

No real checkpoint can be downloaded on the benchmark machine, so the policy is random-init with
Qwen2.5-0.5B's exact shape (what the speed depends on) and a byte-level BPE trained here on the
GSM8K questions. A random policy rarely emits EOS, so every response runs to
max_response_length: the step does the most work it can. Runs `train_ppo.main` with the GSM8K
config (fsdp2 strategy at world size 1, bf16 rollout copy, CUDA graphs) for a few steps and prints
perf/throughput (tokens/s/GPU), the timing_s/* breakdown and peak GPU memory from metrics.jsonl.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train_ppo  # noqa: E402
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="GSM8K train.jsonl")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="0.5b", choices=SHAPES)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=128, help="prompts per step")
    ap.add_argument("--response", type=int, default=256, help="max response tokens")
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
    train_ppo.main(["--config", str(ROOT / "configs" / "gsm8k_qwen2.5_0.5b.yaml"),
                    f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={args.data}",
                    f"data.val_files={args.data}", f"data.train_batch_size={B}", f"data.max_response_length={args.response}",
                    "data.max_prompt_length=256", "data.truncation=left", "data.prompt_template=plain",
                    f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}", f"critic.ppo_mini_batch_size={mini}",
                    f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
                    "trainer.save_freq=-1", f"trainer.device={args.device}", f"trainer.default_local_dir={run_dir}",
                    "trainer.logger=[jsonl]", "trainer.resume_mode=disable"])
    metrics = [r for r in read_metrics(run_dir) if "timing_s/step" in r]
    steady = metrics[1:] or metrics  # the first step captures CUDA graphs and warms the allocator
    keys = sorted({k for r in steady for k in r if k.startswith("timing_s/")})
    print(f"| metric | mean over steps 2..{len(metrics)} |\n|---|---|")
    for k in ["perf/throughput", "perf/total_num_tokens", "response_length/mean", *keys]:
        vals = [r[k] for r in steady if k in r]
        if vals:
            print(f"| {k} | {sum(vals) / len(vals):.2f} |")
    if args.device == "cuda":
        print(f"| peak GPU memory (GiB) | {torch.cuda.max_memory_allocated() / 2**30:.1f} |")


if __name__ == "__main__":
    main()

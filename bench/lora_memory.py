"""Computed (not measured: no GPU) memory per GPU of PPO on a 7B model, full fine-tune and LoRA side by side.

    python bench/lora_memory.py               # the table bench/RESULTS.md shows
    python bench/lora_memory.py --ranks 8 64  # other LoRA ranks

Qwen2.5-7B's shapes (bench/memory.py's SHAPES: hidden 3584, intermediate 18944, 28 layers, 28 heads /
4 KV heads, vocabulary 152064, the LM head untied). Parameters are counted twice, and must agree: a
closed form written out below, and nanokl's own models built on the meta device (engine/model.py's
CausalLM and ValueModel, no memory used), with the adapters of nanokl/lora.py's `add_adapters`
(all-linear: q, k, v, o, gate, up, down of every layer; the LM head left alone) counted by
`trainable_parameters`.

Bytes per parameter on one GPU of W, FSDP full shard (verl's layout: everything below divided by W,
but the rollout copy):

    trained parameter   fp32 weight 4 + fp32 grad 4 + AdamW's two fp32 moments 8 = 16 B
    frozen parameter    fp32 weight 4 B (LoRA's base: no grad, no moments)
    reference           full fine-tune: a bf16 copy of the actor, 2 B/param; LoRA: none (the
                        reference is the actor with its adapters off, nanokl/harness/lora_run.py)
    critic              trained in full, 16 B/param, under LoRA too: nanokl refuses LoRA on the
                        critic (README's verl table); the column "GRPO" leaves the critic out
    rollout copy        bf16, 2 B/param, whole on every GPU (generation needs every weight; under
                        LoRA the merged W + (alpha/r)·B A), alpha = 2r (the scale does not change memory)

Left out: activations, logits, the rollout's KV cache, CUDA workspaces and allocator fragmentation,
which grow with the batch and the sequence rather than with LoRA (bench/memory.py's second table
measures the activations per token). nanokl itself runs LoRA on a plain or DDP actor (it refuses
LoRA under FSDP2): under DDP every figure but the rollout copy is multiplied by W again.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import GiB, SHAPES  # noqa: E402
from nanokl.engine.model import CausalLM, ModelConfig, ValueModel  # noqa: E402
from nanokl.lora import add_adapters, trainable_parameters  # noqa: E402

MODEL = "Qwen2.5-7B"


def closed_form(shape: dict) -> dict:
    """Parameter counts written out: the causal LM, its value model, and LoRA's per unit of rank."""
    h, inter, L, V = (shape[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]  # the K and V projections' width
    attn = (h * h + h) + 2 * (h * kv + kv) + h * h  # q, k, v with biases (Qwen2), o without
    layer = attn + 3 * h * inter + 2 * h  # gate, up, down; two RMSNorms
    backbone = V * h + L * layer + h  # embeddings, layers, final norm
    head = 0 if shape["tie_word_embeddings"] else V * h
    # LoRA on a d_in -> d_out linear: A [r, d_in] + B [d_out, r]
    lora_per_rank = L * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + inter) + (inter + h))
    return {"actor": backbone + head, "critic": backbone + h + 1, "lora_per_rank": lora_per_rank}


def meta_counts(shape: dict, ranks) -> dict:
    """The same counts from nanokl's models on the meta device."""
    cfg = ModelConfig(model_type="qwen2", attention_bias=True, **shape)
    with torch.device("meta"):
        actor, critic = CausalLM(cfg), ValueModel(cfg)
    out = {"actor": sum(p.numel() for p in actor.parameters()),
           "critic": sum(p.numel() for p in critic.parameters())}
    for r in ranks:
        with torch.device("meta"):
            m = CausalLM(cfg)
            add_adapters(m, r, 2 * r)
        out[f"lora_r{r}"] = trainable_parameters(m)
    return out


def per_gpu(P_actor, P_critic, W, lora_params=0) -> dict:
    """Bytes on one GPU of W under FSDP full shard (the module docstring)."""
    if lora_params:
        actor = (4 * P_actor + 16 * lora_params) / W
        ref = 0
    else:
        actor, ref = 16 * P_actor / W, 2 * P_actor / W
    critic, rollout = 16 * P_critic / W, 2 * P_actor
    return {"actor": actor, "ref": ref, "critic": critic, "rollout": rollout,
            "ppo": actor + ref + critic + rollout, "grpo": actor + ref + rollout}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64])
    args = ap.parse_args(argv)
    shape = SHAPES[MODEL]
    closed, meta = closed_form(shape), meta_counts(shape, args.ranks)
    for k in ("actor", "critic"):
        assert closed[k] == meta[k], f"{k}: closed form {closed[k]:,} != meta model {meta[k]:,}"
    for r in args.ranks:
        assert closed["lora_per_rank"] * r == meta[f"lora_r{r}"], f"LoRA rank {r}: closed form != meta model"
    P_a, P_c = meta["actor"], meta["critic"]
    print(f"{MODEL}: actor parameters {P_a:,} (closed form {closed['actor']:,}, meta model {meta['actor']:,}); "
          f"critic {P_c:,}; LoRA all-linear {closed['lora_per_rank']:,} per unit of rank")
    configs = [("full fine-tune", 0)] + [(f"LoRA r={r}, alpha={2 * r}", meta[f"lora_r{r}"]) for r in args.ranks]
    print()
    print("| actor | trained actor params | GPUs | actor GiB | reference GiB | critic GiB | rollout copy GiB | "
          "PPO (GAE) GiB per GPU | GRPO (no critic) GiB per GPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for W in (1, 8):
        for name, lp in configs:
            m = per_gpu(P_a, P_c, W, lp)
            trained = f"{lp / 1e6:.1f}M ({100 * lp / P_a:.2f}%)" if lp else f"{P_a / 1e9:.2f}B (100%)"
            print(f"| {name} | {trained} | {W} | {m['actor'] / GiB:.1f} | {m['ref'] / GiB:.1f} | "
                  f"{m['critic'] / GiB:.1f} | {m['rollout'] / GiB:.1f} | {m['ppo'] / GiB:.1f} | {m['grpo'] / GiB:.1f} |")
    r = 32 if 32 in args.ranks else args.ranks[-1]
    print()
    print(f"| GPUs | job | full fine-tune GiB per GPU | LoRA r={r} GiB per GPU | LoRA saves |")
    print("|---|---|---|---|---|")
    for W in (1, 8):
        full, lora = per_gpu(P_a, P_c, W), per_gpu(P_a, P_c, W, meta[f"lora_r{r}"])
        for job, key in (("PPO (GAE, critic in full)", "ppo"), ("GRPO (no critic)", "grpo")):
            print(f"| {W} | {job} | {full[key] / GiB:.1f} | {lora[key] / GiB:.1f} | "
                  f"{100 * (1 - lora[key] / full[key]):.0f}% |")


if __name__ == "__main__":
    main()

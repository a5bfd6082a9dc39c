"""Computed (not measured) memory per GPU of each strategy, for Qwen2.5-0.5B and Qwen2.5-7B shapes.

    python bench/memory.py            # prints bench/RESULTS.md's table

Counts the exact parameters of nanokl's models built on the meta device (no memory used), then
applies the bytes each strategy keeps per parameter on one GPU of a W-GPU node:

    actor, critic   fp32 weights 4 + fp32 grads 4 + AdamW moments 8 = 16 B/param, replicated
                    (`ddp`, and `none` at W = 1) or divided by W (`fsdp2`)
    reference       fp32 weights, 4 B/param, replicated (`ddp`) or divided by W (`fsdp2`): loaded like
                    the actor and run under the same bf16 autocast, so step-0 KL is exactly 0
    rollout copy    bf16 weights, 2 B/param, always whole: generation needs every weight
    fsdp2 transient one decoder layer all-gathered in fp32 (the largest unsharded block)

Left out, because they depend on batch and sequence length rather than on the strategy:
activations (cut by gradient checkpointing), the KV cache of rollout, logits, CUDA workspace and
allocator fragmentation, and DDP's gradient buckets (up to another 4 B/param unless gradients are
bucket views). Treat the figures as lower bounds for sizing.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanokl.model import CausalLM, ModelConfig, ValueModel  # noqa: E402

SHAPES = {  # the published shapes of the two checkpoints
    "Qwen2.5-0.5B": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
}
GiB = 2 ** 30


def count(model):
    return sum(p.numel() for p in model.parameters())


def per_gpu(P_actor, P_critic, P_layer, strategy, W):
    shard = W if strategy == "fsdp2" else 1
    train = 16 * (P_actor + P_critic) / shard
    ref, rollout = 4 * P_actor / shard, 2 * P_actor
    transient = 4 * P_layer if strategy == "fsdp2" else 0
    return train + ref + rollout + transient


def main():
    rows = []
    for name, shape in SHAPES.items():
        cfg = ModelConfig(model_type="qwen2", attention_bias=True, **shape)
        with torch.device("meta"):
            actor, critic = CausalLM(cfg), ValueModel(cfg)
        P_a, P_c, P_l = count(actor), count(critic), count(actor.model.layers[0])
        for strategy, W in (("none", 1), ("ddp", 8), ("fsdp2", 8)):
            rows.append((name, f"{P_a / 1e9:.2f}B", strategy, W, per_gpu(P_a, P_c, P_l, strategy, W) / GiB))
    print("| model | actor params | strategy | GPUs | GiB per GPU (computed: weights, grads, Adam, ref, rollout copy) |")
    print("|---|---|---|---|---|")
    for name, p, strategy, W, gib in rows:
        print(f"| {name} | {p} | {strategy} | {W} | {gib:.1f} |")


if __name__ == "__main__":
    main()

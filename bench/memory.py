"""Computed (not measured) memory per GPU of each strategy, for Qwen2.5-0.5B and Qwen2.5-7B shapes,
and the activation memory of a training micro-batch: what sizes the GPU config's token budgets.

    python bench/memory.py                 # prints bench/RESULTS.md's two tables
    python bench/memory.py --no-activations   # the model-state table only

Counts the exact parameters of nanokl's models built on the meta device (no memory used), then
applies the bytes each strategy keeps per parameter on one GPU of a W-GPU node:

    actor, critic   fp32 weights 4 + fp32 grads 4 + AdamW moments 8 = 16 B/param, replicated
                    (`ddp`, and `none` at W = 1) or divided by W (`fsdp2`)
    reference       fp32 weights, 4 B/param, replicated (`ddp`) or divided by W (`fsdp2`): loaded like
                    the actor and run under the same bf16 autocast, so step-0 KL is exactly 0
    rollout copy    bf16 weights, 2 B/param, always whole: generation needs every weight
    fsdp2 transient one decoder layer all-gathered in fp32 (the largest unsharded block)

Left out of that table, because they depend on batch and sequence length rather than on the strategy:
activations, the KV cache of rollout, logits, CUDA workspace and allocator fragmentation, and DDP's
gradient buckets (up to another 4 B/param unless gradients are bucket views). Treat the figures as
lower bounds for sizing.

Activations (the second table). What a training micro-batch keeps for its backward grows with its
tokens, so a token budget (`ppo_max_token_len_per_gpu`) bounds it. The bytes a token costs are
*measured* here, not guessed: one decoder layer of the real widths runs forward on a packed row of
512 tokens (two documents) under bf16 autocast on the CPU, and `torch.autograd.graph.saved_tensors_hooks`
adds up every tensor autograd saves for the backward (each storage once), with and without activation
checkpointing, for the actor's layer and the LM head chunked as nanokl/engine/fused.py runs it (which saves
only its input: the chunk's logits are made again in the backward). Per token and layer that is the
figure; a budget of B tokens then keeps B x layers x it, plus the chunk workspace (a few fp32
chunk x vocab tensors). The CPU's SDPA keeps the attention inputs and output as FlashAttention does
(plus its logsumexp), so the figure transfers to the GPU up to the kernels' small workspaces.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanokl.engine import attention as A  # noqa: E402
from nanokl.engine.fused import chunked_log_probs  # noqa: E402
from nanokl.engine.model import CausalLM, DecoderLayer, ModelConfig, ValueModel, rope_tables  # noqa: E402

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


def saved_bytes(fn, *args):
    """Bytes autograd keeps for the backward of fn(*args) (every saved storage once), and fn's output."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return sum(seen.values()), out


def _saved_per_call(shape, tokens, chunk):
    """Saved bytes of one decoder layer (plain, checkpointed) and of the chunked LM head, `tokens` tokens."""
    from torch.utils.checkpoint import checkpoint
    cfg = ModelConfig(model_type="qwen2", attention_bias=True, **{**shape, "num_hidden_layers": 1})
    torch.manual_seed(0)
    layer = DecoderLayer(cfg)
    x = torch.randn(1, tokens, cfg.hidden_size, requires_grad=True)
    half = tokens // 2
    seq = torch.cat([torch.full((half,), 1), torch.full((tokens - half,), 2)])[None]
    pos = torch.cat([torch.arange(half), torch.arange(tokens - half)])[None]
    lay = A.packed_layout([half, tokens - half], seq)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    rope = rope_tables(pos, inv_freq, torch.float32)
    # the chunked head saves its input only, whatever the vocabulary: a small one keeps this fast
    weight = torch.zeros(4096, cfg.hidden_size, requires_grad=True)
    labels = torch.zeros(tokens, dtype=torch.long)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain, _ = saved_bytes(layer, x, rope, lay)
        ckpt, _ = saved_bytes(lambda *a: checkpoint(layer, *a, use_reentrant=False), x, rope, lay)
        head, _ = saved_bytes(lambda h: chunked_log_probs(h, weight, labels, 1.0, chunk),
                              torch.randn(tokens, cfg.hidden_size, requires_grad=True))
    return plain, ckpt, head


def activation_bytes_per_token(shape, chunk=2048):
    """(bytes a token keeps per decoder layer without and with checkpointing, in the chunked LM head),
    measured on one layer of `shape` under bf16 autocast (see the module docstring): the slope between
    512 and 1024 tokens, so that what a micro-batch keeps whatever its size (the weights' bf16 copies,
    the LM head's weight) is not counted per token."""
    small, large = _saved_per_call(shape, 512, chunk), _saved_per_call(shape, 1024, chunk)
    return tuple((b - a) / 512 for a, b in zip(small, large))


def activation_table():
    """Activation GiB of a training micro-batch of B tokens, Qwen2.5-0.5B, beside the model state."""
    shape = {k: v for k, v in SHAPES["Qwen2.5-0.5B"].items() if k != "tie_word_embeddings"}
    plain, ckpt, head = activation_bytes_per_token(shape)
    L, V, chunk = shape["num_hidden_layers"], shape["vocab_size"], 2048
    workspace = 4 * chunk * V * 4  # the chunked head's backward: logits, softmax, their product, a cast
    cfg = ModelConfig(model_type="qwen2", attention_bias=True, **SHAPES["Qwen2.5-0.5B"])
    with torch.device("meta"):
        P_a, P_c = count(CausalLM(cfg)), count(ValueModel(cfg))
    state = per_gpu(P_a, P_c, 0, "none", 1)
    print(f"per token and layer: {plain / 2**10:.1f} KiB without checkpointing, {ckpt / 2**10:.2f} KiB with "
          f"(one layer measured, bf16 autocast); chunked LM head {head / 2**10:.2f} KiB a token")
    print(f"| token budget | checkpointing | activations GiB ({L} layers + head) | + chunk workspace | "
          f"+ model state (none, 1 GPU) = GiB | fits 78 GiB (H100, 15% left for the allocator) |")
    print("|---|---|---|---|---|---|")
    for budget in (8192, 16384, 32768):
        for on, per in (("off", plain), ("on", ckpt)):
            # checkpointed: every layer's input, plus one layer's whole activations while it recomputes
            act = budget * (L * per + head + (plain if on == "on" else 0))
            total = act + workspace + state
            print(f"| {budget} | {on} | {act / GiB:.1f} | {workspace / GiB:.1f} | {total / GiB:.1f} | "
                  f"{'yes' if total < 0.85 * 78 * GiB else 'no'} |")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-activations", action="store_true", help="the model-state table only")
    args = ap.parse_args(argv)
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
    if not args.no_activations:
        print()
        activation_table()


if __name__ == "__main__":
    main()

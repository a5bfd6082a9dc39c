"""One PPO update (critic and actor) on a fixed batch, run by tests/test_dist.py.

    python tests/dist_worker.py --out ref.pt                                 # 1 process, whole batch
    torchrun --nproc_per_node=2 tests/dist_worker.py --strategy ddp --out ddp.pt

Every process builds the same tiny models and the same batch of 8 responses from fixed seeds,
keeps its slice of the rows, and runs the real machinery (nanokl.workers updates, nanokl.dist
wrapping and reductions, GAE whitened over all ranks). Rank 0 saves the full parameters after
the update and the metrics, which the test compares across world sizes.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from types import SimpleNamespace  # noqa: E402

from nanokl import workers as workers  # noqa: E402
from nanokl import dist  # noqa: E402
from nanokl import model as M  # noqa: E402
from nanokl.batching import Batching, token_budget_micro_batches  # noqa: E402
from nanokl.advantages import compute_gae_advantage_return  # noqa: E402
from nanokl.rollout import generate  # noqa: E402


def tiny(cls, seed):
    torch.manual_seed(seed)
    cfg = M.ModelConfig(model_type="qwen2", vocab_size=43, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, rope_theta=1e4, tie_word_embeddings=True)
    m = cls(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.2)
    return m


def fixed_batch(policy):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 43, (8, 6), generator=g)
    mask = torch.ones_like(ids)
    for b in range(8):
        mask[b, : b % 3] = 0
    out = generate(policy, ids.masked_fill(mask == 0, 0), mask, 7, eos_token_id=[1, 2], pad_token_id=0, generator=g)
    scores = torch.zeros(out.response_mask.shape)
    last = (out.response_mask.sum(-1) - 1).clamp(min=0)
    scores[torch.arange(8), last] = torch.randn(8, generator=g)
    return {"sequences": out.sequences, "attention_mask": out.attention_mask, "position_ids": out.position_ids,
            "responses": out.responses, "response_mask": out.response_mask}, scores


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="none")
    ap.add_argument("--mode", default="token-mean")
    ap.add_argument("--spec", default="fixed", help="fixed: 2 responses per micro-batch; budget: packed, token budget")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rank, W, device = dist.init()
    actor, critic, ref = tiny(M.CausalLM, 1), tiny(M.ValueModel, 2), tiny(M.CausalLM, 3)
    full, scores = fixed_batch(actor.eval())
    init = {f"actor.{k}": v.detach().clone() for k, v in actor.named_parameters()}
    init.update({f"critic.{k}": v.detach().clone() for k, v in critic.named_parameters()})
    per = 8 // W
    rows = slice(rank * per, (rank + 1) * per)
    batch = {k: v[rows] for k, v in full.items()}
    scores = scores[rows]
    actor, critic = dist.wrap(actor.train(), args.strategy, device), dist.wrap(critic.train(), args.strategy, device)
    # optimizers right after wrapping: between a no-grad forward and the next backward FSDP2
    # exposes the root's *unsharded* parameters, which an optimizer must never hold
    a_opt = torch.optim.AdamW(actor.parameters(), lr=3e-3)
    c_opt = torch.optim.AdamW(critic.parameters(), lr=3e-3)

    spec = Batching(micro_size=2)
    if args.spec == "budget":
        # packed micro-batches under a token budget chosen so the two halves need different counts:
        # the rank that needs fewer runs an empty (masked) micro-batch to keep the collectives paired
        lengths = full["attention_mask"].sum(-1).tolist()
        budget = next(b for b in range(max(lengths), sum(lengths))
                      if len(token_budget_micro_batches(lengths[:4], b)) != len(token_budget_micro_batches(lengths[4:], b)))
        spec = Batching(token_budget=budget, packed=True)
    batch["old_log_probs"], _ = workers.compute_log_probs(actor, batch, 1.0, spec)
    batch["ref_log_probs"], _ = workers.compute_log_probs(ref, batch, 1.0, spec)
    batch["values"] = workers.compute_values(critic, batch, spec)
    adv, ret = compute_gae_advantage_return(scores, batch["values"], batch["response_mask"], 1.0, 0.95,
                                            whiten_stats=dist.all_reduce_moments)
    batch.update(advantages=adv, returns=ret)

    a = SimpleNamespace(loss_agg_mode=args.mode, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                        entropy_coeff=0.01, use_kl_loss=True, kl_loss_type="low_var_kl", kl_loss_coef=0.1,
                        ppo_epochs=2, shuffle=False, grad_clip=1.0)
    c = SimpleNamespace(loss_agg_mode=args.mode, cliprange_value=0.5, ppo_epochs=2, shuffle=False, grad_clip=1.0)
    # one mini-batch holding all 8 responses (8 // W on each rank), micro-batches of 2
    metrics = dict(workers.update_critic(critic, c_opt, batch, c, 8 // W, spec, horizon=7))
    metrics.update(workers.update_actor(actor, a_opt, batch, a, 1.0, 8 // W, spec, horizon=7,
                                        kl_loss_coef=a.kl_loss_coef))
    params = {f"actor.{k}": v.detach().clone() for k, v in dist.full_tensors(actor)}
    params.update({f"critic.{k}": v.detach().clone() for k, v in dist.full_tensors(critic)})
    if rank == 0:
        torch.save({"params": params, "init": init, "metrics": metrics}, args.out)
    del actor, critic, a_opt, c_opt  # release the DDP/FSDP wrappers before leaving the group
    dist.destroy()


if __name__ == "__main__":
    main()

"""One PPO update (critic and actor) on a fixed batch, run by tests/test_dist.py.

    python tests/dist_worker.py --reference DIR           # 1 process, whole batch: every reference
    torchrun --nproc_per_node=2 tests/dist_worker.py --strategy fsdp2 --out w.pt \
        [--param-dtypes float32,bfloat16] [--checks]

Every process builds the same tiny models and the same batch of 8 responses from fixed seeds,
keeps its slice of the rows, and runs the real machinery (nanokl.workers updates, nanokl.engine.shard
wrapping, nanokl.engine.dist reductions, GAE whitened over all ranks). Rank 0 saves the full parameters after
the update and the metrics, which the test compares across world sizes.

`--param-dtypes bfloat16` computes in bf16 from fp32 masters: FSDP2's MixedPrecisionPolicy under
torchrun; in the one-process reference, every parameter is read through a cast
(`torch.nn.utils.parametrize`), an implementation of the same arithmetic that shares no code
with FSDP2: forward and backward in bf16, each gradient cast to fp32 before it is summed.

`--offloads none,params,optimizer` runs the update once per offload mode (nanokl/engine/shard.py): `params`
wraps with FSDP2's CPUOffloadPolicy, `optimizer` keeps only the optimizer state on CPU between
steps; each result records where the shards and the optimizer state live, whether every FSDP2
module carries the policy (on a CPU-only box everything is on CPU anyway: the policy is what shows
that the flag reached `fully_shard`) and the optimizer's step hooks.

Under FSDP2 each run also counts collectives (`Collectives`): per optimizer step of the first
update, the micro-batches (`shard.no_sync` calls), FSDP2's gradient reductions (`foreach_reduce`:
a reduce-scatter, or a copy on one rank) and the gloo reduce-scatters; the unit gathers of the
actor's no-grad log-prob pass; whether its layers stay gathered after that pass and are resharded
on entering `shard.no_sync`; and each unit's reshard_after_forward (root first).

`--checks` adds, after the update: (a) the rollout copy synced right after the update and (b)
synced again right after a no-grad forward (which leaves FSDP2's root gathered in bf16), both
saved for the test; (c) a checkpoint written by nanokl.harness.run.save, a second update (the
uninterrupted run), then fresh models restored from the checkpoint by run_state._restore (the
rollback path: weights, optimizer and scheduler states) and the same second update. Rank 1 must
not open optim.pt nor the weights: its torch.load and weight loaders raise if it tries.
"""

import argparse
import contextlib
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.nn.utils import parametrize
from torch.optim.optimizer import register_optimizer_step_pre_hook

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanokl import forwards  # noqa: E402
from nanokl import workers as workers  # noqa: E402
from nanokl.engine import dist  # noqa: E402
from nanokl.engine import shard  # noqa: E402
from nanokl.engine import model as M  # noqa: E402
from nanokl.engine.batching import Batching, token_budget_micro_batches  # noqa: E402
from nanokl.advantages import compute_gae_advantage_return  # noqa: E402
from nanokl.rollout import generate  # noqa: E402

VANILLA = SimpleNamespace(loss_mode="vanilla")  # actor.policy_loss: the clipped PPO loss

REFERENCES = {"token-mean": ("token-mean", "float32"), "seq-mean-token-mean": ("seq-mean-token-mean", "float32"),
              "token-mean-bf16": ("token-mean", "bfloat16")}


def tiny(cls, seed):
    torch.manual_seed(seed)
    cfg = M.ModelConfig(model_type="qwen2", vocab_size=43, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, rope_theta=1e4, tie_word_embeddings=True)
    m = cls(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.2)
    return m


class Cast(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, w):
        return w.to(self.dtype)


def compute_in(model, dtype, on=True):
    """Read every parameter through a cast to `dtype` (on), or take the casts off again (on=False)."""
    for m in list(model.modules()):
        if on:
            for name, _ in list(m.named_parameters(recurse=False)):
                parametrize.register_parametrization(m, name, Cast(dtype), unsafe=True)
        elif parametrize.is_parametrized(m):
            for name in list(m.parametrizations):
                parametrize.remove_parametrizations(m, name, leave_parametrized=False)


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


def full_params(actor, critic):
    params = {f"actor.{k}": v.detach().clone() for k, v in shard.full_tensors(actor)}
    params.update({f"critic.{k}": v.detach().clone() for k, v in shard.full_tensors(critic)})
    return params


def offload_report(model, opt):
    """Where the model's shards and the optimizer's state live, and what FSDP2 was told."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    groups = [m._get_fsdp_state()._fsdp_param_group for m in shard.unwrap(model).modules() if isinstance(m, FSDPModule)]
    groups = [g for g in groups if g is not None]
    return {"fsdp_groups": len(groups),
            "policy": [isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups],
            "offload_to_cpu": [fp.offload_to_cpu for g in groups for fp in g.fsdp_params],
            "param_devices": sorted({str(p.device) for p in shard.unwrap(model).parameters()}),
            "state_devices": sorted({str(v.device) for st in opt.state.values() for v in st.values()
                                     if torch.is_tensor(v) and v.dim() > 0}),
            "step_hooks": (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks))}


class Collectives:
    """Counts FSDP2's collectives, wrapped where FSDP2 looks them up, and shard.no_sync's calls.
    torch 2.13 at world size 1 neither all-gathers nor reduce-scatters: it copies (and casts) the
    shard into the unsharded buffer, and copies the gradient back; `gathers` and `reductions`
    count those steps at any world size, `reduce_scatters` the collective itself."""

    def __init__(self):
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group
        group = _fsdp_param_group.FSDPParamGroup
        self.counts, self._undo = Counter(), []
        for owner, name, key in ((torch.distributed, "reduce_scatter_single", "reduce_scatters"),
                                 (_fsdp_param_group, "foreach_reduce", "reductions"),
                                 (group, "_to_unsharded", "gathers"),  # after the all-gather (or copy)
                                 (shard, "no_sync", "micro_batches")):  # workers.ppo_epochs: one per micro-batch
            real = getattr(owner, name)
            setattr(owner, name, self._counted(real, key, group if owner is group else None))
            self._undo.append((owner, name, real))

    def _counted(self, real, key, group):
        def counted(*args, **kwargs):
            # a param group's _to_unsharded is a no-op when it is unsharded already: not a gather
            if group is None or not args[0].is_unsharded:
                self.counts[key] += 1
            return real(*args, **kwargs)
        return counted

    @contextlib.contextmanager
    def per_step(self):
        """The counts between optimizer steps: a list, one dict per step (any optimizer)."""
        steps = []
        self.counts.clear()

        def snapshot(opt, args, kwargs):
            steps.append({k: self.counts[k] for k in ("micro_batches", "reductions", "reduce_scatters")})
            self.counts.clear()
        handle = register_optimizer_step_pre_hook(snapshot)
        try:
            yield steps
        finally:
            handle.remove()

    def close(self):
        for owner, name, real in reversed(self._undo):
            setattr(owner, name, real)


def gathered_layers(model):
    """Whether the decoder layers hold plain (gathered) tensors rather than their DTensor shards."""
    return [type(p).__name__ != "DTensor" for layer in shard.unwrap(model).model.layers for p in layer.parameters()]


def run(strategy, mode, spec_name, param_dtype, checks=False, ckpt_dir=None, offload="none"):
    rank, W, device = dist.init()
    dtype = getattr(torch, param_dtype)
    actor, critic, ref = tiny(M.CausalLM, 1), tiny(M.ValueModel, 2), tiny(M.CausalLM, 3)
    full, scores = fixed_batch(actor.eval())
    init = {f"actor.{k}": v.detach().clone() for k, v in actor.named_parameters()}
    init.update({f"critic.{k}": v.detach().clone() for k, v in critic.named_parameters()})
    per = 8 // W
    rows = slice(rank * per, (rank + 1) * per)
    batch = {k: v[rows] for k, v in full.items()}
    scores = scores[rows]

    def build(actor, critic):
        if strategy == "none" and dtype != torch.float32:
            compute_in(actor, dtype), compute_in(critic, dtype)
        actor = shard.wrap(actor.train(), strategy, device, param_dtype=dtype, offload=offload == "params")
        critic = shard.wrap(critic.train(), strategy, device, param_dtype=dtype, offload=offload == "params")
        # optimizers right after wrapping: between a no-grad forward and the next backward FSDP2
        # exposes the root's *unsharded* parameters, which an optimizer must never hold
        # eps 1e-6, not 1e-8: Adam's first steps move a parameter by lr * g / (|g| + eps), so a
        # gradient at float-noise level (~1e-9: a token no response used) would turn summation-order
        # noise of 1e-10 into parameter differences of lr * 1e-2 = 3e-5 and hide a real mismatch
        a_opt = torch.optim.AdamW(actor.parameters(), lr=3e-3, eps=1e-6)
        c_opt = torch.optim.AdamW(critic.parameters(), lr=3e-3, eps=1e-6)
        scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)) for o in (a_opt, c_opt)]
        if offload == "optimizer":
            shard.offload_optimizer(a_opt), shard.offload_optimizer(c_opt)
        return actor, critic, a_opt, c_opt, scheds

    actor, critic, a_opt, c_opt, scheds = build(actor, critic)
    spec = Batching(micro_size=2)
    if spec_name == "budget":
        # packed micro-batches under a token budget chosen so the two halves need different counts:
        # the rank that needs fewer runs an empty (masked) micro-batch to keep the collectives paired
        lengths = full["attention_mask"].sum(-1).tolist()
        def count(half, b):
            return len(token_budget_micro_batches(half, b))
        budget = next(b for b in range(max(lengths), sum(lengths)) if count(lengths[:4], b) != count(lengths[4:], b))
        spec = Batching(token_budget=budget, packed=True)
    counter = Collectives() if strategy == "fsdp2" else None
    counted = {}
    if counter:
        counter.counts.clear()
    batch["old_log_probs"], _ = forwards.compute_log_probs(actor, batch, 1.0, spec)
    if counter:  # the no-grad pass over several micro-batches, and what it leaves registered
        counted.update(no_grad_gathers=counter.counts["gathers"],
                       no_grad_micro_batches=len(list(forwards.forward_micro_batches(batch, spec))),
                       gathered_after_forward=gathered_layers(actor))
        with shard.no_sync(actor, skip=True):
            counted["gathered_in_no_sync"] = gathered_layers(actor)
    batch["ref_log_probs"], _ = forwards.compute_log_probs(ref, batch, 1.0, spec)
    batch["values"] = forwards.compute_values(critic, batch, spec)
    adv, ret = compute_gae_advantage_return(scores, batch["values"], batch["response_mask"], 1.0, 0.95,
                                            whiten_stats=dist.all_reduce_moments)
    batch.update(advantages=adv, returns=ret)

    a = SimpleNamespace(loss_mode="ppo", policy_loss=VANILLA,
                        loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                        entropy_coeff=0.01, use_kl_loss=True, kl_loss_type="low_var_kl", kl_loss_coef=0.1,
                        ppo_epochs=2, shuffle=False, grad_clip=1.0)
    c = SimpleNamespace(loss_agg_mode=mode, cliprange_value=0.5, ppo_epochs=2, shuffle=False, grad_clip=1.0)

    def update(actor, critic, a_opt, c_opt):
        # one mini-batch holding all 8 responses (8 // W on each rank), micro-batches of 2
        metrics = dict(workers.update_critic(critic, c_opt, batch, c, mini_size=8 // W, spec=spec, horizon=7))
        metrics.update(workers.update_actor(actor, a_opt, batch, a, 1.0, mini_size=8 // W, spec=spec, horizon=7,
                                            kl_loss_coef=a.kl_loss_coef)[0])
        return metrics

    with counter.per_step() if counter else contextlib.nullcontext() as steps:
        metrics = update(actor, critic, a_opt, c_opt)
    if counter:
        counter.close()
        counted["steps"] = steps
    if strategy == "none" and dtype != torch.float32:
        compute_in(actor, dtype, on=False), compute_in(critic, dtype, on=False)
    p = next(shard.unwrap(actor).parameters())
    out = {"params": full_params(actor, critic), "init": init, "metrics": metrics, "world": W,
           "dtensor": [type(q).__name__ == "DTensor" for q in shard.unwrap(actor).parameters()],
           "mesh": p.device_mesh.size() if hasattr(p, "device_mesh") else None}
    if strategy == "fsdp2":
        out["offload"] = {"actor": offload_report(actor, a_opt), "critic": offload_report(critic, c_opt)}
        groups = [m._get_fsdp_state()._fsdp_param_group for m in shard.unwrap(actor).modules()
                  if isinstance(m, torch.distributed.fsdp.FSDPModule)]
        out["collectives"] = {**counted, "reshard_after_forward": [g._reshard_after_forward for g in groups]}
    if checks:
        out.update(run_checks(rank, W, actor, critic, a_opt, c_opt, scheds, build, update, batch, spec, ckpt_dir))
    del actor, critic, a_opt, c_opt  # release the DDP/FSDP wrappers before leaving the group
    return out


def run_checks(rank, W, actor, critic, a_opt, c_opt, scheds, build, update, batch, spec, ckpt_dir):
    from nanokl.harness import run_state as harness  # save, _restore and the loaders _restore would call
    from nanokl.kl_ctrl import FixedKLController
    out = {}
    rollout = tiny(M.CausalLM, 4)  # other values than the actor's: a missed or partial sync shows
    shard.sync_rollout_weights(rollout, actor)
    out["rollout_after_update"] = {f"actor.{k}": v.clone() for k, v in rollout.state_dict().items()}
    forwards.compute_log_probs(actor, batch, 1.0, spec)  # no grad: FSDP2 leaves the root gathered
    shard.sync_rollout_weights(rollout, actor)
    out["rollout_after_forward"] = {f"actor.{k}": v.clone() for k, v in rollout.state_dict().items()}

    def fake_run(actor, critic, a_opt, c_opt, scheds):
        return SimpleNamespace(rank=rank, actor=actor, critic=critic, actor_opt=a_opt, critic_opt=c_opt,
                               actor_sched=scheds[0], critic_sched=scheds[1], rollout_model=tiny(M.CausalLM, 5),
                               rollout_copy=True, run_dir=Path(ckpt_dir), healthy_step=None, nan_streak=0,
                               kl_ctrl=FixedKLController(0.0), kl_loss_ctrl=FixedKLController(0.1), monitor=None,
                               tok=None, cfg=SimpleNamespace(trainer=SimpleNamespace(max_actor_ckpt_to_keep=None)))
    for s in scheds:
        s.step()
    path = harness.save(fake_run(actor, critic, a_opt, c_opt, scheds), 1)
    for s in scheds:
        s.step()  # the next step's learning rate: a restored scheduler must agree
    update(actor, critic, a_opt, c_opt)
    out["straight"] = full_params(actor, critic)

    if rank != 0:  # rank 1 must receive the states from rank 0, never open them itself
        real_load = torch.load

        def guarded_load(f, *args, **kw):
            assert not (isinstance(f, (str, Path)) and Path(f).name == "optim.pt"), f"rank {rank} opened {f}"
            return real_load(f, *args, **kw)

        def refuse(path, *args, **kw):
            raise AssertionError(f"rank {rank} loaded the weights at {path}")
        torch.load, harness.from_pretrained, harness.load_value_model = guarded_load, refuse, refuse
    actor2, critic2, a_opt2, c_opt2, scheds2 = build(tiny(M.CausalLM, 11), tiny(M.ValueModel, 12))
    r2 = fake_run(actor2, critic2, a_opt2, c_opt2, scheds2)
    sched_states, _ = harness._restore(r2, path, weights=True)
    for name, s in (("actor", scheds2[0]), ("critic", scheds2[1])):
        s.load_state_dict(sched_states[f"{name}_sched"])
        s.step()
    out["restored_rollout"] = {f"actor.{k}": v.clone() for k, v in r2.rollout_model.state_dict().items()}
    update(actor2, critic2, a_opt2, c_opt2)
    resumed = full_params(actor2, critic2)
    out["resumed"] = resumed
    # DDP replicas on other ranks must agree with rank 0's (rank 0 alone saves what the test sees)
    out["replica_spread"] = max((dist.all_reduce(v, "max") - dist.all_reduce(v, "min")).abs().max().item()
                                for v in resumed.values())
    out["guarded_ranks"] = dist.all_reduce(torch.tensor(float(rank != 0))).item()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="none")
    ap.add_argument("--mode", default="token-mean")
    ap.add_argument("--spec", default="fixed", help="fixed: 2 responses per micro-batch; budget: packed, token budget")
    ap.add_argument("--param-dtypes", default="float32",
                    help="compute dtypes (FSDP2's MixedPrecisionPolicy), comma-separated: one update each")
    ap.add_argument("--offloads", default="none", help="none, params, optimizer, comma-separated: one update each")
    ap.add_argument("--checks", action="store_true", help="rollout sync and checkpoint restore checks")
    ap.add_argument("--out", help="result file (rank 0 writes it)")
    ap.add_argument("--reference", help="directory: write every 1-process reference into it")
    args = ap.parse_args()
    if args.reference:
        for name, (mode, dtype) in REFERENCES.items():
            torch.save(run("none", mode, "fixed", dtype), Path(args.reference) / f"{name}.pt")
        return
    # several dtypes share one launch: starting the processes costs more than the updates
    out = {(dtype, off): run(args.strategy, args.mode, args.spec, dtype, args.checks,
                             Path(args.out).parent / f"ckpt_{dtype}_{off}", off)
           for dtype in args.param_dtypes.split(",") for off in args.offloads.split(",")}
    if dist.rank() == 0:
        torch.save(out, args.out)
    dist.destroy()


if __name__ == "__main__":
    main()

"""KL-regularised PPO for a language model, top to bottom (the lesson that ties nanokl together).

    python train_ppo.py                                        # CPU: the arithmetic task (configs/arith_tiny.yaml)
    python train_ppo.py --config configs/grpo_arith.yaml       # GRPO with a KL loss instead of a critic
    torchrun --nproc_per_node=8 train_ppo.py --config configs/gsm8k_qwen2.5_0.5b.yaml actor_rollout_ref.model.path=...

One step, as in verl's RayPPOTrainer.fit (design.md, "Data flow of one PPO step"):
  1. rollout     sample `rollout.n` responses per prompt from the current policy   (nanokl/rollout.py)
  2. score       the task's rule, or a learned reward model, scores each response; the scalar
                 sits on its last token                                       (scoring.py)
  3. forwards    old log-probs + entropy (actor), reference log-probs, values (critic)   (actor.py)
  4. KL          in the reward: r_t = score_t - beta * KL_t, and beta adapts toward target_kl
                 (kl.py, kl_ctrl.py); and/or in the loss: + kl_loss_coef * KL (actor.use_kl_loss)
  5. advantages  GAE with the critic, or GRPO's group baseline                      (gae.py)
  6. update      ppo_epochs x mini-batches x micro-batches: clipped policy and value losses (ppo.py)
  7. log         metrics.jsonl + console; validation every test_freq; checkpoint every save_freq;
                 the KL health monitor warns, stops or rolls back                 (monitor.py)
Under torchrun each process takes a slice of the prompts (nanokl/dist.py). With the default config
a missing reference checkpoint is first trained by nanokl/supervised/sft.py (and a missing reward model, when
one is enabled, by nanokl/supervised/reward_model.py).
"""

import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from nanokl import workers as workers
from nanokl import dist
from nanokl.batching import Batching
from nanokl.harness.checkpoint import latest_checkpoint, load_state, rng_state, save_checkpoint, set_rng_state
from nanokl.harness.config import config_to_dict, parse_cli, run_cli, save_config
from nanokl.harness.config_io import UserError
from nanokl.harness.data import (arith_difficulty, batch_indices, build_prompts, load_examples, make_arith_task,
                         steps_per_epoch)
from nanokl.advantages import compute_gae_advantage_return, compute_grpo_outcome_advantage
from nanokl.masked import masked_mean
from nanokl.kl import kl_penalty
from nanokl.kl_ctrl import make_kl_controller
from nanokl.harness.metrics import add_stats, explained_variance, global_var, timer
from nanokl.harness.hf_format import from_pretrained, load_value_model
from nanokl.harness.monitor import CHECKS, KLMonitor
from nanokl.supervised.reward_model import load_reward_model
from nanokl.supervised.reward_model import train_from_config as train_reward_model
from nanokl.harness.scoring import score_batch, validate
from nanokl.rollout import generate
from nanokl.supervised.sft import train_sft
from nanokl.harness.tokenizer import load_tokenizer
from nanokl.tasks import TASKS
from nanokl.harness.tracking import Tracker

MAX_NAN_STEPS = 3  # consecutive steps with a skipped (non-finite) update before the run stops


class TrainingStopped(Exception):
    """The run cannot continue (e.g. repeated NaN losses); a checkpoint was saved first."""


def load_data(cfg):
    return TASKS[cfg.data.task].examples(cfg.data, seed=cfg.data.seed)


def lr_lambda(optim, total_steps):
    """Linear warm-up, then constant or cosine down to min_lr_ratio (verl's two schedules)."""
    warm = optim.lr_warmup_steps if optim.lr_warmup_steps > 0 else int(optim.lr_warmup_steps_ratio * total_steps)

    def f(step):
        if step < warm:
            return (step + 1) / warm
        if optim.lr_scheduler_type == "cosine":
            progress = (step - warm) / max(1, total_steps - warm)
            return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0
    return f


def make_optimizer(model, optim, total_steps):
    opt = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(optim, total_steps))


def main(argv=None):
    cfg = parse_cli(argv)
    d, arr, alg, t, c = cfg.data, cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer, cfg.critic
    a, ro = arr.actor, arr.rollout
    rank, W, _ = dist.init()  # torchrun sets RANK / WORLD_SIZE; plain python is rank 0 of 1
    device = dist.local_device(t.device)
    for key, v in (("data.train_batch_size", d.train_batch_size), ("actor_rollout_ref.actor.ppo_mini_batch_size", a.ppo_mini_batch_size),
                   ("critic.ppo_mini_batch_size", c.ppo_mini_batch_size)):
        if v % W:
            raise UserError(f"{key} ({v}) must be divisible by the number of processes ({W})")
    # (a frozen reference may stay `none`: a full copy per process, like a DDP replica without grads)
    for key, v in (("actor_rollout_ref.actor.strategy", a.strategy), ("critic.strategy", c.strategy)):
        if v == "none" and W > 1 and (key != "critic.strategy" or alg.adv_estimator == "gae"):
            # each process would train its own model and silently diverge
            raise UserError(f"{key}=none runs one process, but torchrun started {W}: use ddp or fsdp2")
    torch.manual_seed(t.seed)
    run_dir = Path(t.default_local_dir)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")

    # ---- models: the policy (actor), its frozen copy (reference), the critic --------------------
    model_path = Path(arr.model.path)
    if not (model_path / "config.json").exists() and d.train_files is None and model_path == Path(cfg.sft.output_dir):
        if rank == 0:
            print(f"no reference policy at {model_path}: training the warm start first (nanokl.supervised.sft)", file=sys.stderr)
            train_sft(cfg)
        dist.barrier()
    if not model_path.is_dir():
        raise UserError(f"model directory {str(model_path)!r} does not exist (actor_rollout_ref.model.path)")
    rm_path = cfg.reward_model.model.path
    if cfg.reward_model.enable and not (Path(rm_path) / "config.json").exists() and cfg.reward_model.train.data_path:
        if rank == 0:  # the config says how to distil one from rankings: do it first, like the warm start
            print(f"no reward model at {rm_path}: training it from rankings first (nanokl.supervised.reward_model)",
                  file=sys.stderr)
            train_reward_model(cfg)
        dist.barrier()
    tok = load_tokenizer(arr.model.tokenizer_path)
    train, val = load_data(cfg)
    use_critic = alg.adv_estimator == "gae"
    ckpt = None
    if t.resume_mode == "auto":
        ckpt = latest_checkpoint(run_dir)
    elif t.resume_mode == "resume_path":
        ckpt = Path(t.resume_from_path)
    actor_path = ckpt / "actor" if ckpt else model_path
    actor = from_pretrained(actor_path, device=device).train()
    actor.model.gradient_checkpointing = arr.model.enable_gradient_checkpointing
    ref = from_pretrained(model_path, device=device, dtype=torch.bfloat16 if device.type == "cuda" else None)
    ref.eval().requires_grad_(False)
    critic = load_value_model(ckpt / "critic" if ckpt else c.model.path, device=device).train() if use_critic else None
    # Rollout reads the policy's whole weights. A plain CPU actor (or a DDP replica) is used as is;
    # otherwise (CUDA: bf16; FSDP2: the weights are sharded) rollout runs a copy that is refreshed
    # in place after every update, so that its captured CUDA graphs stay valid (nanokl/dist.py).
    rollout_model = actor
    rollout_copy = device.type == "cuda" or (a.strategy == "fsdp2" and W > 1)
    if rollout_copy:
        dtype = getattr(torch, ro.dtype) if device.type == "cuda" else torch.float32
        rollout_model = from_pretrained(actor_path, device=device, dtype=dtype).eval().requires_grad_(False)
    actor = dist.wrap(actor, a.strategy, device)
    ref = dist.wrap(ref, arr.ref.strategy, device, trainable=False)
    critic = dist.wrap(critic, c.strategy, device) if use_critic else None

    total_steps = t.total_training_steps or t.total_epochs * steps_per_epoch(len(train), d.train_batch_size)
    actor_opt, actor_sched = make_optimizer(actor, a.optim, total_steps)
    critic_opt, critic_sched = make_optimizer(critic, c.optim, total_steps) if use_critic else (None, None)
    kl_ctrl = make_kl_controller(alg.kl_ctrl)
    rm = None
    if cfg.reward_model.enable:
        rm = load_reward_model(rm_path, device=device).eval()
        rm_tok, policy_tok = Path(rm_path) / "tokenizer.json", Path(arr.model.tokenizer_path) / "tokenizer.json"
        if rm_tok.is_file() and rm_tok.read_bytes() != policy_tok.read_bytes():  # it reads the policy's token ids
            raise UserError(f"the reward model at {rm_path} was trained with another tokenizer than the policy's "
                            f"({policy_tok}); retrain it: python -m nanokl.supervised.reward_model --config ...")
    km = t.kl_monitor
    monitor = KLMonitor(km) if km.enable else None
    rollback_on = monitor is not None and "rollback" in {getattr(km, f"{k}_action") for k in CHECKS}
    start, nan_streak, healthy_step = 0, 0, None  # healthy_step: the last checkpoint a rollback may return to

    def restore(path, weights=False):
        """Optimizer states (+ weights, for a rollback) from checkpoint `path`; returns its trainer state."""
        optim_state, state = load_state(path)
        for name, model, opt in (("actor", actor, actor_opt), ("critic", critic, critic_opt)):
            if model is not None:
                if weights:
                    load = from_pretrained if name == "actor" else load_value_model
                    dist.load_full_state_dict(model, load(path / name).state_dict())
                dist.load_optimizer_state(model, opt, optim_state[name])
        if weights and rollout_copy:
            dist.sync_rollout_weights(rollout_model, actor)
        return optim_state, state

    if ckpt:
        optim_state, state = restore(ckpt)
        actor_sched.load_state_dict(optim_state["actor_sched"])
        if use_critic:
            critic_sched.load_state_dict(optim_state["critic_sched"])
        kl_ctrl.load_state_dict(state["kl_ctrl"])
        a.kl_loss_coef = state.get("kl_loss_coef", a.kl_loss_coef)  # a rollback may have raised it
        if monitor and "monitor" in state:
            monitor.load_state_dict(state["monitor"])
        set_rng_state(state["rng"])
        start, nan_streak, healthy_step = state["global_step"], state.get("nan_streak", 0), state.get("healthy_step")
        if rank == 0:
            print(f"resumed from {ckpt} at step {start}", file=sys.stderr)

    def checkpoint(step, healthy=True):
        """Every rank gathers (a collective), rank 0 writes full HF weights + name-keyed optimizer state."""
        nonlocal healthy_step
        healthy_step = step if healthy else healthy_step
        models = {"actor": actor, **({"critic": critic} if use_critic else {})}
        weights = {name: (dist.unwrap(m), dist.full_state_dict(m)) for name, m in models.items()}
        optim = {"actor": dist.optimizer_state(actor, actor_opt), "actor_sched": actor_sched.state_dict()}
        if use_critic:
            optim.update(critic=dist.optimizer_state(critic, critic_opt), critic_sched=critic_sched.state_dict())
        state = {"kl_ctrl": kl_ctrl.state_dict(), "rng": rng_state(), "nan_streak": nan_streak,
                 "kl_loss_coef": a.kl_loss_coef, "healthy_step": healthy_step,
                 **({"monitor": monitor.state_dict()} if monitor else {})}
        path = run_dir / "checkpoints" / f"global_step_{step}"
        if rank == 0:
            path = save_checkpoint(run_dir, step, weights, optim, state, tokenizer=tok, keep=t.max_actor_ckpt_to_keep)
        dist.barrier()
        return path

    def rollback(step):
        """Reload the last healthy checkpoint's weights and optimizer states, raise beta, go on from
        `step` (the step count and the learning-rate schedule keep moving forward)."""
        path = run_dir / "checkpoints" / f"global_step_{healthy_step}"
        if healthy_step is None or not (path / "trainer_state.pt").is_file():
            return None
        _, state = restore(path, weights=True)
        if alg.use_kl_in_reward:  # beta as it is now or was then, whichever is larger, times the factor
            kl_ctrl.value = max(kl_ctrl.value, state["kl_ctrl"]["value"], km.rollback_min_beta) * km.rollback_beta_factor
        if a.use_kl_loss:
            a.kl_loss_coef = max(a.kl_loss_coef, km.rollback_min_beta) * km.rollback_beta_factor
        monitor.rolled_back()
        return path

    if rollback_on and healthy_step is None:
        checkpoint(start)  # the starting point is healthy by definition: something to roll back to

    tracker = Tracker(run_dir, t.logger, config_to_dict(cfg), enabled=rank == 0, project=t.project_name,
                      experiment=t.experiment_name)
    if t.val_before_train and val and start == 0:
        tracker.log(validate(rollout_model, tok, val, cfg, device), step=0)

    n, R = ro.n, ro.response_length
    packed, packed_c = arr.model.use_remove_padding, c.model.use_remove_padding
    def spec(micro_size, max_tokens, dynamic, packed):  # verl's knobs -> how a batch is cut (batching.py)
        return Batching(micro_size, max_tokens if dynamic else None, packed)
    old_spec = spec(ro.log_prob_micro_batch_size_per_gpu, ro.log_prob_max_token_len_per_gpu, ro.log_prob_use_dynamic_bsz,
                    packed)
    ref_spec = spec(arr.ref.log_prob_micro_batch_size_per_gpu, arr.ref.log_prob_max_token_len_per_gpu,
                    arr.ref.log_prob_use_dynamic_bsz, packed)
    actor_spec = spec(a.ppo_micro_batch_size_per_gpu, a.ppo_max_token_len_per_gpu, a.use_dynamic_bsz, packed)
    critic_spec = spec(c.ppo_micro_batch_size_per_gpu, c.ppo_max_token_len_per_gpu, c.use_dynamic_bsz, packed_c)
    values_spec = spec(c.ppo_micro_batch_size_per_gpu, c.forward_max_token_len_per_gpu, c.use_dynamic_bsz, packed_c)
    mini_actor, mini_critic = a.ppo_mini_batch_size * n // W, c.ppo_mini_batch_size * n // W  # this rank's share
    per_rank = d.train_batch_size // W
    steps = range(start, total_steps)
    for step in tqdm(steps, desc="ppo", initial=start, total=total_steps, file=sys.stderr, disable=rank != 0):
        metrics, t_step = {}, time.perf_counter()
        # stateless per-step seeds: resume needs only `step`; each rank samples differently
        gen = torch.Generator(device).manual_seed(t.seed * 1_000_003 + step * 8191 + rank)
        shuffle = torch.Generator().manual_seed(t.seed + step)
        batch_idx = batch_indices(len(train), d.train_batch_size, step, d.seed, d.shuffle)
        examples = [train[i] for i in batch_idx[rank * per_rank:(rank + 1) * per_rank]]  # this rank's prompts

        # 1. rollout: n responses per prompt from the current policy
        with timer(metrics, "gen", device):
            ids, mask = build_prompts(examples, tok, d.prompt_template, d.max_prompt_length, d.truncation, device=device)
            out = generate(dist.unwrap(rollout_model), ids, mask, R, temperature=ro.temperature, top_k=ro.top_k,
                           top_p=ro.top_p, do_sample=ro.do_sample, eos_token_id=tok.eos_token_ids,
                           pad_token_id=tok.pad_token_id, generator=gen, use_cuda_graph=ro.use_cuda_graph, n=n)
        examples_n = [ex for ex in examples for _ in range(n)]
        batch = {"sequences": out.sequences, "attention_mask": out.attention_mask, "position_ids": out.position_ids,
                 "responses": out.responses, "response_mask": out.response_mask}
        rmask = out.response_mask

        # 2. score each response (the rule, or the reward model); the score sits on its last token
        with timer(metrics, "reward", device):
            scores, seq_scores, rule_scores = score_batch(tok, out, examples_n, cfg, rm)

        # 3. forwards: old log-probs + entropy, reference log-probs, values
        with timer(metrics, "old_log_prob", device):
            old_logp, entropy = workers.compute_log_probs(actor, batch, ro.temperature, old_spec, with_entropy=True)
        batch["old_log_probs"] = old_logp
        with timer(metrics, "ref", device):
            batch["ref_log_probs"], _ = workers.compute_log_probs(ref, batch, ro.temperature, ref_spec)
        if use_critic:
            with timer(metrics, "values", device):
                batch["values"] = workers.compute_values(critic, batch, values_spec)

        # 4. KL in the reward: r_t = score_t - beta * KL_t, and the controller moves beta
        with timer(metrics, "adv", device):
            rewards = scores
            if alg.use_kl_in_reward:
                kld = kl_penalty(old_logp, batch["ref_log_probs"], alg.kl_penalty) * rmask
                beta = kl_ctrl.value
                rewards = scores - beta * kld
                # per-token mean of each response, averaged over all ranks' responses
                kl_per_response = masked_mean(kld, rmask, dim=-1)
                current_kl = dist.global_stats(kl_per_response)[0]
                kl_ctrl.update(current_kl, n_steps=len(examples_n) * W)
                metrics.update({"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta,
                                "actor/reward_kl_var": global_var(kl_per_response)})  # for the KL monitor

            # 5. advantages: GAE with the critic (whitened over all ranks), or GRPO's group baseline
            if use_critic:
                adv, ret = compute_gae_advantage_return(rewards, batch["values"], rmask, alg.gamma, alg.lam,
                                                        whiten_stats=dist.all_reduce_moments)
            else:
                index = torch.arange(len(examples)).repeat_interleave(n)
                adv, ret = compute_grpo_outcome_advantage(rewards, rmask, index, alg.norm_adv_by_std_in_grpo)
            batch.update(advantages=adv, returns=ret)

        # 6. update: critic first (verl's order), then the actor once critic_warmup has passed
        upd = {}
        if use_critic:
            with timer(metrics, "update_critic", device):
                upd.update(workers.update_critic(critic, critic_opt, batch, c, mini_critic, critic_spec, shuffle, R))
            critic_sched.step()
        if step >= t.critic_warmup:
            with timer(metrics, "update_actor", device):
                upd.update(workers.update_actor(actor, actor_opt, batch, a, ro.temperature, mini_actor, actor_spec, shuffle,
                                           R))
            actor_sched.step()
            if rollout_copy:  # refresh the rollout copy in place: its graphs see new weights
                dist.sync_rollout_weights(rollout_model, actor)
        metrics.update({k: sum(v) / len(v) for k, v in upd.items() if v})
        skipped = sum(upd.get("actor/nan_skipped", [])) + sum(upd.get("critic/nan_skipped", []))
        metrics["actor/nan_skipped"] = skipped
        nan_streak = nan_streak + 1 if skipped else 0

        # 7. metrics (verl's names, reduced over ranks), validation, checkpoint
        metrics["actor/entropy"] = dist.global_stats(entropy, rmask)[0]
        metrics["actor/lr"] = actor_sched.get_last_lr()[0]
        metrics["rollout/log_prob_max_diff"] = dist.global_stats((out.log_probs - old_logp).abs(), rmask)[1]
        add_stats(metrics, "critic/score", seq_scores)
        metrics["critic/score/var"] = global_var(seq_scores)
        if rm is not None:  # the rule's verdict on the same responses: the RM's score is only a proxy
            add_stats(metrics, "critic/rule_score", rule_scores)
        add_stats(metrics, "critic/rewards", rewards.sum(-1))
        add_stats(metrics, "critic/advantages", adv, rmask)
        add_stats(metrics, "critic/returns", ret, rmask)
        if use_critic:
            add_stats(metrics, "critic/values", batch["values"], rmask)
            metrics["critic/vf_explained_var"] = explained_variance(batch["values"], ret, rmask)
        add_stats(metrics, "response_length", rmask.sum(-1).float())
        metrics["response_length/clip_ratio"] = dist.global_stats((rmask.sum(-1) == R).float())[0]
        add_stats(metrics, "prompt_length", mask.sum(-1).float())
        tokens = dist.all_reduce(out.attention_mask.sum().float()).item()
        metrics["timing_s/step"] = time.perf_counter() - t_step
        metrics.update({"perf/total_num_tokens": tokens, "perf/throughput": tokens / metrics["timing_s/step"] / W,
                        "training/epoch": step // steps_per_epoch(len(train), d.train_batch_size)})
        last = step + 1 == total_steps
        if val and t.test_freq > 0 and ((step + 1) % t.test_freq == 0 or last):
            with timer(metrics, "testing", device):
                metrics.update(validate(rollout_model, tok, val, cfg, device))
        if nan_streak >= MAX_NAN_STEPS:
            path = checkpoint(step + 1, healthy=False)
            tracker.log(metrics, step=step + 1)
            raise TrainingStopped(f"stopped at step {step + 1}: {MAX_NAN_STEPS} steps in a row had a non-finite loss "
                                  f"or gradient (updates skipped); checkpoint saved to {path}")
        actions = set()
        if monitor:  # KL health (nanokl/harness/monitor.py): warn, stop cleanly, or roll back
            events = monitor.check(step + 1, metrics)
            metrics.update(monitor.metrics(), **{"monitor/health": monitor.health})
            actions = {e.action for e in events}
            if rank == 0:
                for e in events:
                    tqdm.write(e.message, file=sys.stderr)
            if "rollback" in actions and "stop" not in actions:
                back = rollback(step + 1)
                if back is None:
                    actions.add("stop")
                    if rank == 0:
                        tqdm.write("kl_monitor: no healthy checkpoint to roll back to; stopping", file=sys.stderr)
                elif rank == 0:
                    tqdm.write(f"kl_monitor: rolled back to {back}; beta is now {kl_ctrl.value:.4g}", file=sys.stderr)
        if "stop" in actions:
            path = checkpoint(step + 1, healthy=False)
            tracker.log(metrics, step=step + 1)
            if rank == 0:
                which = ", ".join(e.check for e in events if e.action == "stop") or "rollback impossible"
                print(f"kl_monitor stopped the run at step {step + 1} (check: {which}); checkpoint saved to {path}",
                      file=sys.stderr)
            break
        if (t.save_freq > 0 and (step + 1) % t.save_freq == 0) or last:
            with timer(metrics, "save_checkpoint", device):
                checkpoint(step + 1, healthy=monitor is None or monitor.rollback_safe)
        tracker.log(metrics, step=step + 1)
    tracker.close()


def cli():
    status = 0
    try:
        run_cli(main)
    except TrainingStopped as e:
        print(f"error: {e}", file=sys.stderr)
        status = 1
    dist.destroy()  # after main returned, so its DDP/FSDP models are already released
    sys.exit(status)


if __name__ == "__main__":
    cli()

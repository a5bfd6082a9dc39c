"""KL-regularised PPO for a language model, top to bottom (the lesson that ties nanokl together).

    python train_ppo.py                                        # CPU: the arithmetic task (configs/arith_tiny.yaml)
    python train_ppo.py --config configs/grpo_arith.yaml       # GRPO with a KL loss instead of a critic
    torchrun --nproc_per_node=8 train_ppo.py --config configs/gsm8k_qwen2.5_0.5b.yaml actor_rollout_ref.model.path=...

One step, as in verl's RayPPOTrainer.fit (design.md, "Data flow of one PPO step"):
  1. rollout     sample `rollout.n` responses per prompt from the current policy   (nanokl/rollout.py)
  2. score       the task's rule scores each response; the scalar sits on its last token (reward.py)
  3. forwards    old log-probs + entropy (actor), reference log-probs, values (critic)   (actor.py)
  4. KL          in the reward: r_t = score_t - beta * KL_t, and beta adapts toward target_kl
                 (kl.py, kl_ctrl.py); and/or in the loss: + kl_loss_coef * KL (actor.use_kl_loss)
  5. advantages  GAE with the critic, or GRPO's group baseline                      (gae.py)
  6. update      ppo_epochs x mini-batches x micro-batches: clipped policy and value losses (ppo.py)
  7. log         metrics.jsonl + console; validation every test_freq; checkpoint every save_freq
With the default config a missing reference checkpoint is first trained by nanokl/sft.py.
"""

import copy
import math
import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from nanokl import actor as W
from nanokl.checkpoint import latest_checkpoint, load_state, rng_state, save_checkpoint, set_rng_state
from nanokl.config import config_to_dict, parse_cli, run_cli, save_config
from nanokl.config_io import UserError
from nanokl.data import (arith_difficulty, batch_indices, build_prompts, load_examples, make_arith_task,
                         steps_per_epoch)
from nanokl.gae import compute_gae_advantage_return, compute_grpo_outcome_advantage, masked_mean
from nanokl.kl import kl_penalty
from nanokl.kl_ctrl import make_kl_controller
from nanokl.model import from_pretrained, load_value_model
from nanokl.ppo import explained_variance
from nanokl.reward import score_response, token_level_scores
from nanokl.rollout import generate
from nanokl.sft import train_sft
from nanokl.tokenizer import load_tokenizer
from nanokl.tracking import Tracker

MAX_NAN_STEPS = 3  # consecutive steps with a skipped (non-finite) update before the run stops


class TrainingStopped(Exception):
    """The run cannot continue (e.g. repeated NaN losses); a checkpoint was saved first."""


def load_data(cfg):
    d = cfg.data
    if d.train_files is None:  # the built-in synthetic task
        return make_arith_task(d.num_train, d.num_val, seed=d.seed, difficulty=arith_difficulty(d))
    val = load_examples(d.val_files, d.prompt_key, d.reward_fn_key) if d.val_files else []
    return load_examples(d.train_files, d.prompt_key, d.reward_fn_key), val


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


def add_stats(metrics, name, values, mask=None):
    """name/mean, /max, /min over the masked entries (verl's compute_data_metrics style)."""
    v = values[mask.bool()] if mask is not None else values.flatten()
    if v.numel():
        metrics.update({f"{name}/mean": v.float().mean().item(), f"{name}/max": v.max().item(),
                        f"{name}/min": v.min().item()})


def score_batch(tok, out, examples, cfg):
    """Decode, score by rule, put each score on its response's last token."""
    texts = tok.batch_decode(out.responses, out.response_mask)
    scores = [score_response(t, ex, cfg.reward_model.score_method) for t, ex in zip(texts, examples)]
    last = (out.response_mask.sum(-1) - 1).clamp(min=0)
    ended = torch.isin(out.responses.gather(1, last[:, None])[:, 0], torch.tensor(tok.eos_token_ids, device=last.device))
    missing_eos = ~ended | (out.response_mask.sum(-1) == 0)
    token_scores = token_level_scores(scores, out.response_mask, missing_eos, cfg.reward_model.missing_eos_penalty)
    return token_scores, torch.tensor(scores)


@torch.no_grad()
def validate(model, tok, val, cfg, device):
    """Greedy (val_kwargs) accuracy on the held-out prompts, per data source: val-core/<src>/acc/mean@n."""
    d, vk = cfg.data, cfg.actor_rollout_ref.rollout.val_kwargs
    scores, lengths = defaultdict(list), []
    for i in range(0, len(val), d.val_batch_size):
        chunk = val[i:i + d.val_batch_size]
        ids, mask = build_prompts(chunk, tok, d.prompt_template, d.max_prompt_length, d.truncation, device=device)
        out = generate(model, ids, mask, cfg.actor_rollout_ref.rollout.response_length, temperature=vk.temperature,
                       top_k=vk.top_k, top_p=vk.top_p, do_sample=vk.do_sample and vk.temperature > 0,
                       eos_token_id=tok.eos_token_ids, pad_token_id=tok.pad_token_id, n=vk.n,
                       generator=torch.Generator(device).manual_seed(cfg.trainer.seed))
        texts = tok.batch_decode(out.responses, out.response_mask)
        for j, text in enumerate(texts):
            ex = chunk[j // vk.n]
            scores[ex["data_source"]].append(score_response(text, ex, cfg.reward_model.score_method))
        lengths += out.response_mask.sum(-1).tolist()
    metrics = {f"val-core/{src}/acc/mean@{vk.n}": sum(s) / len(s) for src, s in scores.items()}
    if lengths:
        metrics["val-aux/response_length/mean"] = sum(lengths) / len(lengths)
    return metrics


@contextmanager
def timer(metrics, name, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize()
    metrics[f"timing_s/{name}"] = time.perf_counter() - t


def main(argv=None):
    cfg = parse_cli(argv)
    d, arr, alg, t, c = cfg.data, cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer, cfg.critic
    a, ro = arr.actor, arr.rollout
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("this train_ppo.py runs one process; data-parallel training under torchrun "
                        "(nanokl/dist.py) is not built yet")
    if {a.strategy, c.strategy} != {"none"}:
        print(f"warning: strategy {a.strategy!r} is not built yet; one process trains unsharded", file=sys.stderr)
    device = torch.device("cuda" if t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available()) else "cpu")
    torch.manual_seed(t.seed)
    run_dir = Path(t.default_local_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")

    # ---- models: the policy (actor), its frozen copy (reference), the critic --------------------
    model_path = Path(arr.model.path)
    if not (model_path / "config.json").exists() and d.train_files is None and model_path == Path(cfg.sft.output_dir):
        print(f"no reference policy at {model_path}: training the warm start first (nanokl.sft)", file=sys.stderr)
        train_sft(cfg)
    if not model_path.is_dir():
        raise UserError(f"model directory {str(model_path)!r} does not exist (actor_rollout_ref.model.path)")
    tok = load_tokenizer(arr.model.tokenizer_path)
    train, val = load_data(cfg)
    use_critic = alg.adv_estimator == "gae"
    ckpt = None
    if t.resume_mode == "auto":
        ckpt = latest_checkpoint(run_dir)
    elif t.resume_mode == "resume_path":
        ckpt = Path(t.resume_from_path)
    actor = from_pretrained(ckpt / "actor" if ckpt else model_path, device=device).train()
    ref = from_pretrained(model_path, device=device, dtype=torch.bfloat16 if device.type == "cuda" else None)
    ref.eval().requires_grad_(False)
    critic = None
    if use_critic:
        critic = load_value_model(ckpt / "critic" if ckpt else c.model.path, device=device).train()
    actor.model.gradient_checkpointing = arr.model.enable_gradient_checkpointing
    # Rollout reads the policy's weights. On CUDA it runs a bf16 copy that is refreshed in place
    # after every update (so its captured CUDA graphs stay valid); on CPU the actor itself.
    rollout_model = actor
    if device.type == "cuda":
        rollout_model = copy.deepcopy(actor).to(getattr(torch, ro.dtype)).eval().requires_grad_(False)

    total_steps = t.total_training_steps or t.total_epochs * steps_per_epoch(len(train), d.train_batch_size)
    actor_opt, actor_sched = make_optimizer(actor, a.optim, total_steps)
    critic_opt, critic_sched = make_optimizer(critic, c.optim, total_steps) if use_critic else (None, None)
    kl_ctrl = make_kl_controller(alg.kl_ctrl)
    start, nan_streak = 0, 0
    if ckpt:
        optim_state, state = load_state(ckpt)
        actor_opt.load_state_dict(optim_state["actor"])
        actor_sched.load_state_dict(optim_state["actor_sched"])
        if use_critic:
            critic_opt.load_state_dict(optim_state["critic"])
            critic_sched.load_state_dict(optim_state["critic_sched"])
        kl_ctrl.load_state_dict(state["kl_ctrl"])
        set_rng_state(state["rng"])
        start, nan_streak = state["global_step"], state.get("nan_streak", 0)
        print(f"resumed from {ckpt} at step {start}", file=sys.stderr)

    def checkpoint(step):
        models = {"actor": actor, **({"critic": critic} if use_critic else {})}
        optim = {"actor": actor_opt.state_dict(), "actor_sched": actor_sched.state_dict()}
        if use_critic:
            optim.update(critic=critic_opt.state_dict(), critic_sched=critic_sched.state_dict())
        state = {"kl_ctrl": kl_ctrl.state_dict(), "rng": rng_state(), "nan_streak": nan_streak}
        return save_checkpoint(run_dir, step, models, optim, state, tokenizer=tok, keep=t.max_actor_ckpt_to_keep)

    tracker = Tracker(run_dir, t.logger, config_to_dict(cfg), project=t.project_name, experiment=t.experiment_name)
    if t.val_before_train and val and start == 0:
        tracker.log(validate(rollout_model, tok, val, cfg, device), step=0)

    n, R = ro.n, ro.response_length
    mini_actor, mini_critic = a.ppo_mini_batch_size * n, c.ppo_mini_batch_size * n
    for step in tqdm(range(start, total_steps), desc="ppo", initial=start, total=total_steps, file=sys.stderr):
        metrics, t_step = {}, time.perf_counter()
        gen = torch.Generator(device).manual_seed(t.seed * 1_000_003 + step)  # stateless: resume needs only `step`
        examples = [train[i] for i in batch_indices(len(train), d.train_batch_size, step, d.seed, d.shuffle)]

        # 1. rollout: n responses per prompt from the current policy
        with timer(metrics, "gen", device):
            ids, mask = build_prompts(examples, tok, d.prompt_template, d.max_prompt_length, d.truncation, device=device)
            out = generate(rollout_model, ids, mask, R, temperature=ro.temperature, top_k=ro.top_k, top_p=ro.top_p,
                           do_sample=ro.do_sample, eos_token_id=tok.eos_token_ids, pad_token_id=tok.pad_token_id,
                           generator=gen, use_cuda_graph=ro.use_cuda_graph, n=n)
        examples_n = [ex for ex in examples for _ in range(n)]
        batch = {"sequences": out.sequences, "attention_mask": out.attention_mask, "position_ids": out.position_ids,
                 "responses": out.responses, "response_mask": out.response_mask}
        rmask = out.response_mask

        # 2. score each response by rule; the score sits on its last token
        with timer(metrics, "reward", device):
            scores, seq_scores = score_batch(tok, out, examples_n, cfg)

        # 3. forwards: old log-probs + entropy, reference log-probs, values
        with timer(metrics, "old_log_prob", device):
            old_logp, entropy = W.compute_log_probs(actor, batch, ro.temperature, ro.log_prob_micro_batch_size_per_gpu,
                                                    with_entropy=True)
        batch["old_log_probs"] = old_logp
        with timer(metrics, "ref", device):
            batch["ref_log_probs"], _ = W.compute_log_probs(ref, batch, ro.temperature,
                                                            arr.ref.log_prob_micro_batch_size_per_gpu)
        if use_critic:
            with timer(metrics, "values", device):
                batch["values"] = W.compute_values(critic, batch, c.ppo_micro_batch_size_per_gpu)

        # 4. KL in the reward: r_t = score_t - beta * KL_t, and the controller moves beta
        with timer(metrics, "adv", device):
            rewards = scores
            if alg.use_kl_in_reward:
                kld = kl_penalty(old_logp, batch["ref_log_probs"], alg.kl_penalty) * rmask
                beta = kl_ctrl.value
                rewards = scores - beta * kld
                current_kl = masked_mean(kld, rmask, dim=-1).mean().item()  # per-token mean, averaged over responses
                kl_ctrl.update(current_kl, n_steps=len(examples_n))
                metrics.update({"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta})

            # 5. advantages: GAE with the critic, or the group baseline of GRPO
            if use_critic:
                adv, ret = compute_gae_advantage_return(rewards, batch["values"], rmask, alg.gamma, alg.lam)
            else:
                index = torch.arange(len(examples)).repeat_interleave(n)
                adv, ret = compute_grpo_outcome_advantage(rewards, rmask, index, alg.norm_adv_by_std_in_grpo)
            batch.update(advantages=adv, returns=ret)

        # 6. update: critic first (verl's order), then the actor once critic_warmup has passed
        upd = defaultdict(list)
        if use_critic:
            with timer(metrics, "update_critic", device):
                upd.update(W.update_critic(critic, critic_opt, batch, c, mini_critic, gen, R))
            critic_sched.step()
        if step >= t.critic_warmup:
            with timer(metrics, "update_actor", device):
                upd.update(W.update_actor(actor, actor_opt, batch, a, ro.temperature, mini_actor, gen, R))
            actor_sched.step()
            if rollout_model is not actor:  # refresh the rollout copy in place: its graphs see new weights
                with torch.no_grad():
                    for p_r, p_a in zip(rollout_model.parameters(), actor.parameters()):
                        p_r.copy_(p_a)
        metrics.update({k: sum(v) / len(v) for k, v in upd.items() if v})
        skipped = sum(upd.get("actor/nan_skipped", [])) + sum(upd.get("critic/nan_skipped", []))
        metrics["actor/nan_skipped"] = skipped
        nan_streak = nan_streak + 1 if skipped else 0

        # 7. metrics (verl's names), validation, checkpoint
        metrics["actor/entropy"] = masked_mean(entropy, rmask).item()
        metrics["actor/lr"] = actor_sched.get_last_lr()[0]
        metrics["rollout/log_prob_max_diff"] = ((out.log_probs - old_logp).abs() * rmask).max().item()
        add_stats(metrics, "critic/score", seq_scores)
        add_stats(metrics, "critic/rewards", rewards.sum(-1))
        add_stats(metrics, "critic/advantages", adv, rmask)
        add_stats(metrics, "critic/returns", ret, rmask)
        if use_critic:
            add_stats(metrics, "critic/values", batch["values"], rmask)
            metrics["critic/vf_explained_var"] = explained_variance(batch["values"], ret, rmask).item()
        add_stats(metrics, "response_length", rmask.sum(-1).float())
        metrics["response_length/clip_ratio"] = (rmask.sum(-1) == R).float().mean().item()
        add_stats(metrics, "prompt_length", mask.sum(-1).float())
        tokens = out.attention_mask.sum().item()
        metrics["timing_s/step"] = time.perf_counter() - t_step
        metrics.update({"perf/total_num_tokens": tokens, "perf/throughput": tokens / metrics["timing_s/step"],
                        "training/epoch": step // steps_per_epoch(len(train), d.train_batch_size)})
        last = step + 1 == total_steps
        if val and t.test_freq > 0 and ((step + 1) % t.test_freq == 0 or last):
            with timer(metrics, "testing", device):
                metrics.update(validate(rollout_model, tok, val, cfg, device))
        if nan_streak >= MAX_NAN_STEPS:
            path = checkpoint(step + 1)
            tracker.log(metrics, step=step + 1)
            raise TrainingStopped(f"stopped at step {step + 1}: {MAX_NAN_STEPS} steps in a row had a non-finite loss "
                                  f"or gradient (updates skipped); checkpoint saved to {path}")
        if (t.save_freq > 0 and (step + 1) % t.save_freq == 0) or last:
            with timer(metrics, "save_checkpoint", device):
                checkpoint(step + 1)
        tracker.log(metrics, step=step + 1)
    tracker.close()


def cli():
    try:
        run_cli(main)
    except TrainingStopped as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli()

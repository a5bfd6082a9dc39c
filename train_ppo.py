"""KL-regularised PPO for a language model: one step, top to bottom, and the loop around it.

    python train_ppo.py                                    # CPU: configs/arith_tiny.yaml
    python train_ppo.py --config configs/grpo_arith.yaml   # GRPO with a KL loss instead of a critic
    torchrun --nproc_per_node=8 train_ppo.py --config configs/gsm8k_qwen2.5_0.5b.yaml ...

`ppo_step` is one step of verl's RayPPOTrainer.fit, in the order the data flow: rollout, score,
forwards, the KL in the reward (r_t = score_t - beta * KL_t, on this page), advantages, update,
metrics. Every formula is one or two calls away (go to definition), each in its lesson under
nanokl/. Where a config turns a step on or off (a critic, the KL in the reward) the step says so
with a plain `if`; where a step has real alternatives (offline responses, importance weights, a
probe-corrected KL, ReMax's greedy baseline) `run` holds the one this config chose, typed in
nanokl/harness/run.py. `dpo_step` is the other algorithm on logged pairs. `main` is the loop;
everything that is not the step (models, resume, checkpoints, validation, the KL monitor, the
command line) is the harness, nanokl/harness/.
"""

import math
import time

import torch

from nanokl import dpo, forwards, workers
from nanokl.advantages import compute_advantage
from nanokl.engine import dist, shard
from nanokl.harness.after_step import end_step, finish, take_step
from nanokl.harness.cli import cli
from nanokl.harness.config.load import parse_cli
from nanokl.harness.data import rank_rows, step_seed
from nanokl.harness.hacking import watch_ratio
from nanokl.harness.metrics import step_metrics, timer
from nanokl.harness.run import Run, setup, steps
from nanokl.harness.scoring import score_batch
from nanokl.harness.variants import reward_kl, reward_kl_metrics
from nanokl.rewards import mean_kl
from nanokl.supervised.stages import train_missing_stages


def ppo_step(run: Run, step: int) -> dict:
    """One PPO step on this rank's share of the prompts of global step `step`; its metrics."""
    cfg, device, W = run.cfg, run.device, run.world
    a, ro, alg = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.algorithm
    metrics, t_step = {}, time.perf_counter()
    rows, gen, shuffle = step_seeds(run, step)

    # 1. rollout: n responses per prompt, with the sampler's log-prob of each token (mu's)
    with timer(metrics, "gen", device):
        out, examples = run.respond(rows, step, gen, metrics)
    batch = forwards.rollout_batch(out)

    # 2. score each response (the task's rule, or a reward model); the score sits on its last token
    with timer(metrics, "reward", device):
        scores, seq_scores, rule_scores = score_batch(run.tok, out, examples, cfg, run.rm,
                                                      global_step=step + 1, metrics=metrics)

    # 3. forwards: pi_old's log-probs and entropy, the reference's, the critic's values; then the
    #    importance weights of tokens another policy sampled and their rejection (nanokl/offline.py)
    entropy = before_update(run, batch, out, metrics)
    batch["is_weights"], batch["response_mask"], corr = run.rollout_correction(batch, out.log_probs)
    metrics.update(corr)

    with timer(metrics, "adv", device):
        # 4. KL in the reward: r_t = score_t - beta * KL_t, KL_t an estimator of the sampled token
        #    (nanokl/kl.py); the controller moves beta toward target_kl from the batch's mean KL
        rewards, mask = scores, batch["response_mask"]
        if alg.use_kl_in_reward:
            beta, kl = run.kl_ctrl.value, reward_kl(run, batch, metrics)
            rewards = scores - beta * kl
            current = run.read_kl(batch, kl, mean_kl(kl, mask, dist.all_reduce), metrics)
            run.kl_ctrl.update(current, n_steps=len(mask) * W)
            metrics.update(reward_kl_metrics(run, kl, mask, current, beta))
        # 5. advantages: GAE with the critic (whitened over all ranks), or a baseline (the prompt's
        #    group; remax: its greedy response) over the tokens step 3 kept; an outcome score is
        #    still summed over the rollout's tokens (score_mask), as verl sums the whole row
        index = torch.arange(len(rows)).repeat_interleave(ro.n)  # the prompt of each response
        batch["advantages"], batch["returns"] = compute_advantage(
            alg.adv_estimator, rewards, mask, batch["values"], index, alg,
            whiten_stats=dist.all_reduce_moments, baselines=run.baselines(examples, metrics),
            score_mask=out.response_mask)

    # 6. update: critic first (verl's order), then the actor once critic_warmup has passed (verl's
    #    `critic_warmup <= global_steps`, counted from 1: N trains the critic alone N - 1 steps)
    update = {}
    if run.critic is not None:
        c = cfg.critic
        with timer(metrics, "update_critic", device):
            update = workers.update_critic(run.critic, run.critic_opt, batch, c,
                                           mini_size=c.ppo_mini_batch_size * ro.n // W,
                                           spec=run.specs["critic"], generator=shuffle,
                                           horizon=ro.response_length)
        run.critic_sched.step()
    if cfg.trainer.critic_warmup <= step + 1:
        with timer(metrics, "update_actor", device):
            actor_update, first_pass_entropy = workers.update_actor(
                run.actor, run.actor_opt, batch, a, ro.temperature,
                mini_size=a.ppo_mini_batch_size * ro.n // W, spec=run.specs["actor"],
                generator=shuffle, horizon=ro.response_length, kl_loss_coef=run.kl_loss_ctrl.value,
                ref=run.ref, record_entropy=entropy is None, watch=watch_ratio)
        update |= actor_update
        entropy = first_pass_entropy if entropy is None else entropy  # bypass: the update's pi_old
        run.actor_sched.step()
        shard.sync_rollout_weights(run.rollout_model, run.actor)  # in place: CUDA graphs see it

    # 7. metrics (verl's names), every one reduced over all ranks; then the KL loss's weight moves,
    #    when adaptive, toward its target from this step's KL loss, as beta did in step 4
    metrics.update(step_metrics(run, step, out, batch, update=update, entropy=entropy,
                                t_step=t_step, phases=metrics, scores=seq_scores,
                                rule_scores=rule_scores, rewards=rewards))
    steer_kl_loss(run, metrics)
    return metrics


def step_seeds(run: Run, step: int):
    """This rank's prompts of step `step` and the step's generators: stateless per-step seeds, so
    resume needs only `step`; each rank samples differently, every rank shuffles alike."""
    d, seed = run.cfg.data, run.cfg.trainer.seed
    rows = rank_rows(len(run.train), d.train_batch_size, step, d.seed, d.shuffle, run.rank,
                     run.world)
    gen = torch.Generator(run.device).manual_seed(step_seed(seed, step, run.rank))
    return rows, gen, torch.Generator().manual_seed(seed + step)


def before_update(run: Run, batch: dict, out, metrics: dict):
    """Step 3's passes without gradients; fills batch's old_log_probs, ref_log_probs and values
    (None without a critic). Returns pi_old's entropy, or None when the update records it (bypass).
    pi_old's log-probs are the actor's forward (verl's compute_log_prob; its largest gap to the
    rollout's own is logged: the sampler's numerics), or the rollout's own when the sampler is the
    fp32 actor itself (run.bypass: forwards.rollout_log_probs_are_old)."""
    device, T = run.device, run.cfg.actor_rollout_ref.rollout.temperature
    batch["old_log_probs"], entropy = out.log_probs, None
    if not run.bypass:
        with timer(metrics, "old_log_prob", device):
            batch["old_log_probs"], entropy = forwards.compute_log_probs(
                run.actor, batch, T, spec=run.specs["old"], with_entropy=True)
        if run.cfg.data.offline_files is None:
            gap = (out.log_probs - batch["old_log_probs"]).abs()
            metrics["rollout/log_prob_max_diff"] = dist.global_stats(gap, out.response_mask)[1]
    with timer(metrics, "ref", device):
        batch["ref_log_probs"], _ = forwards.compute_log_probs(run.ref, batch, T,
                                                               spec=run.specs["ref"])
    batch["values"] = None
    if run.critic is not None:
        with timer(metrics, "values", device):
            batch["values"] = forwards.compute_values(run.critic, batch, spec=run.specs["values"])
    return entropy


def steer_kl_loss(run: Run, metrics: dict) -> None:
    """An adaptive KL-loss coefficient (actor.kl_loss_ctrl) moves toward its target from this
    step's KL loss, actor/kl_loss, over the step's responses (kl_ctrl.py); with the on-policy
    probe (algorithm.kl_probe, nanokl/kl_probe.py) from the corrected KL instead, as beta's
    reading does. A step without a KL loss (critic warm-up, a skipped update) leaves it be."""
    kl = float(metrics.get("actor/kl_loss", math.nan))
    kl = float(metrics.get("kl_probe/kl_corrected", kl)) if math.isfinite(kl) else kl
    if run.kl_loss_ctrl.type == "adaptive" and math.isfinite(kl):
        ro = run.cfg.actor_rollout_ref.rollout
        run.kl_loss_ctrl.update(kl, n_steps=run.cfg.data.train_batch_size * ro.n)
        metrics["actor/kl_loss_target"] = run.kl_loss_ctrl.target


def dpo_step(run: Run, step: int) -> dict:
    """One DPO step (actor.objective dpo / ipo) on logged pairs: the chosen and the rejected
    response of each prompt, in that order. No score and no advantages: the ranking that ordered
    each pair is the signal, and the pair loss of nanokl/dpo.py the update; beta is the KL
    controller's value. The policy's KL is still read, for the controller and the monitor."""
    cfg, device = run.cfg, run.device
    a, ro, alg = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.algorithm
    metrics, t_step = {}, time.perf_counter()
    rows, gen, shuffle = step_seeds(run, step)
    with timer(metrics, "gen", device):
        out, _ = run.respond(rows, step, gen, metrics)
    batch = forwards.rollout_batch(out)
    entropy = before_update(run, batch, out, metrics)
    batch["is_weights"], batch["response_mask"], corr = run.rollout_correction(batch, out.log_probs)
    metrics.update(corr)
    with timer(metrics, "adv", device):
        if alg.use_kl_in_reward:
            beta, mask = run.kl_ctrl.value, batch["response_mask"]
            kl = reward_kl(run, batch, metrics)  # watched, not paid: DPO's loss holds pi near ref
            current = run.read_kl(batch, kl, mean_kl(kl, mask, dist.all_reduce), metrics)
            run.kl_ctrl.update(current, n_steps=len(mask) * run.world)
            metrics.update(reward_kl_metrics(run, kl, mask, current, beta))
    with timer(metrics, "update_actor", device):
        update = dpo.update_policy(run.actor, run.actor_opt, batch, a, ro.temperature,
                                   mini_size=a.ppo_mini_batch_size * ro.n // run.world,
                                   spec=run.specs["actor"], generator=shuffle,
                                   beta=run.kl_ctrl.value)
    run.actor_sched.step()
    shard.sync_rollout_weights(run.rollout_model, run.actor)
    metrics.update(step_metrics(run, step, out, batch, update=update, entropy=entropy,
                                t_step=t_step, phases=metrics))
    return metrics


def main(argv=None) -> int:
    """The run; its exit status (0, or 130 when Ctrl-C stopped it after a step and its save)."""
    run = setup(parse_cli(argv), stages=train_missing_stages)  # models, data, resume, ...
    step_fn = ppo_step if run.cfg.actor_rollout_ref.actor.objective == "ppo" else dpo_step
    for step in steps(run):
        metrics = take_step(step_fn, run, step)  # a reward function that fails: save, stop (exit 1)
        if not end_step(run, step, metrics):  # validation, NaN guard, KL monitor, checkpoint, log
            break
    return finish(run)  # the summary; the folder's lock released


if __name__ == "__main__":
    cli(main)

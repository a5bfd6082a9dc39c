"""KL-regularised PPO for a language model: one step, top to bottom (the lesson that ties nanokl together).

    python train_ppo.py                                        # CPU: the arithmetic task (configs/arith_tiny.yaml)
    python train_ppo.py --config configs/grpo_arith.yaml       # GRPO with a KL loss instead of a critic
    python train_ppo.py --config configs/dapo_arith.yaml       # DAPO: clip-higher, dynamic sampling, no KL
    torchrun --nproc_per_node=8 train_ppo.py --config configs/gsm8k_qwen2.5_0.5b.yaml actor_rollout_ref.model.path=...

`ppo_step` is one step of verl's RayPPOTrainer.fit, in the order the data flows:
  1. rollout     n responses per prompt from the current policy, and the log-prob of each
                 token under the policy that sampled it                                nanokl/rollout.py
  2. score       the task's rule (or a learned reward model) scores each response; the
                 scalar sits on the response's last token                              nanokl/rewards.py
  3. forwards    old log-probs + entropy (policy), reference log-probs, values (critic);
                 importance weights when another policy sampled                        nanokl/workers.py, offline.py
  4. KL          in the reward: r_t = score_t - beta * KL_t, beta steered toward
                 target_kl; and/or in the loss (actor.use_kl_loss, step 6)             nanokl/rewards.py, kl_ctrl.py
  5. advantages  GAE with the critic, or a baseline: the group's (GRPO, RLOO, ...), the
                 greedy response's (ReMax)                                             nanokl/advantages.py
  6. update      ppo_epochs x mini-batches x micro-batches of the clipped value and
                 policy losses (+ KL loss, - entropy bonus)                            nanokl/workers.py, ppo.py
  7. metrics     verl's names, reduced over all ranks                                  harness/metrics.py
Where configs differ, a step is replaced, not branched: `run.respond` samples (or, offline, draws
logged responses: nothing is generated; or, with DAPO's dynamic sampling, samples rounds until enough
prompts' responses disagree), `run.old_log_probs` recomputes (or takes the rollout's when the sampler
is the fp32 actor itself: bypass), `run.correct` weighs and rejects tokens another policy sampled,
`run.baselines` rolls out greedily for ReMax, and so on; setup chooses each once
(nanokl/harness/variants.py). DPO is another algorithm (no score, no advantages, a pair loss):
`dpo_step`. `main` is the loop around them; a reward function that fails in a step
(reward_fn.RewardError) ends it with a checkpoint of the steps done (exit 1), and Ctrl-C with one of
the step it finishes (exit 130, harness/faults.py). Everything that is not the step (models, resume,
checkpoints, validation, the KL monitor's warn/stop/rollback, logging) is the harness:
nanokl/harness/run.py. Under torchrun each process takes a slice of the prompts and the reductions
are global (nanokl/dist.py), so the logged numbers do not depend on the number of processes.
"""

import sys
import time

import torch

from nanokl import dist, dpo, workers
from nanokl.harness.checkpoint import rng_state, set_rng_state
from nanokl.harness.config import parse_cli, run_cli
from nanokl.harness.data import rank_rows
from nanokl.harness.faults import INTERRUPTED, check_writable
from nanokl.harness.metrics import step_metrics, timer
from nanokl.harness.reward_fn import RewardError
from nanokl.harness.run import TrainingStopped, end_step, finish, setup, steps
from nanokl.harness.run_state import save
from nanokl.harness.scoring import score_batch


def step_seeds(run, step):
    """This rank's prompts of step `step` and the step's generators: stateless per-step seeds, so
    resume needs only `step`; each rank samples differently, every rank shuffles alike."""
    d, seed = run.cfg.data, run.cfg.trainer.seed
    rows = rank_rows(len(run.train), d.train_batch_size, step, d.seed, d.shuffle, run.rank, run.world)
    gen = torch.Generator(run.device).manual_seed(seed * 1_000_003 + step * 8191 + run.rank)
    return rows, gen, torch.Generator().manual_seed(seed + step)


def ppo_step(run, step) -> dict:
    """One PPO step on this rank's share of the prompts of global step `step`; returns its metrics."""
    cfg, device, W = run.cfg, run.device, run.world
    a, ro, alg = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.algorithm
    metrics, t_step = {}, time.perf_counter()
    rows, gen, shuffle = step_seeds(run, step)

    # 1. rollout: n responses per prompt, with the sampler's log-prob of each token (mu's)
    with timer(metrics, "gen", device):
        out, examples = run.respond(run, rows=rows, step=step, generator=gen, metrics=metrics)
    batch = workers.rollout_batch(out)

    # 2. score each response (the task's rule, or the reward model); the score sits on its last token
    with timer(metrics, "reward", device):
        scores, seq_scores, rule_scores = score_batch(run.tok, out, examples, cfg, run.rm, global_step=step + 1,
                                                      metrics=metrics)

    # 3. forwards: old log-probs + entropy, reference log-probs, values; importance weights min(pi_old/mu, C),
    #    and rejection: tokens far off pi_old leave the mask the losses read
    batch["old_log_probs"], entropy = run.old_log_probs(run, batch, out, metrics)
    with timer(metrics, "ref", device):
        batch["ref_log_probs"], _ = workers.compute_log_probs(run.ref, batch, ro.temperature, spec=run.specs["ref"])
    batch["values"] = run.values(run, batch, metrics)
    batch["is_weights"], batch["response_mask"], is_metrics = run.correct(run, batch, out.log_probs)
    metrics.update(is_metrics)

    with timer(metrics, "adv", device):
        # 4. KL in the reward: r_t = score_t - beta * KL_t, and the controller moves beta
        rewards, kl_metrics = run.kl_reward(run, batch, scores)
        metrics.update(kl_metrics)
        # 5. advantages: GAE with the critic (whitened over all ranks), or a baseline (the group; remax: greedy),
        #    over the tokens step 3 kept (verl's compute_advantage reads the mask rollout_rs rewrote); an outcome
        #    score is still the sum over the rollout's tokens (score_mask), as verl sums the whole row: a rejected
        #    last token takes no response's score away
        index = torch.arange(len(rows)).repeat_interleave(ro.n)  # the prompt of each response
        batch["advantages"], batch["returns"] = run.estimator.fn(rewards, batch["response_mask"], batch["values"], index,
                                                                 alg, dist.all_reduce_moments,
                                                                 baselines=run.baselines(run, examples, metrics),
                                                                 score_mask=out.response_mask)

    # 6. update: critic first (verl's order), then the actor once critic_warmup has passed
    update = run.update_critic(run, batch, shuffle, metrics)
    if step >= cfg.trainer.critic_warmup:
        with timer(metrics, "update_actor", device):
            actor_update, first_pass_entropy = workers.update_actor(
                run.actor, run.actor_opt, batch, a, ro.temperature, mini_size=a.ppo_mini_batch_size * ro.n // W,
                spec=run.specs["actor"], generator=shuffle, horizon=ro.response_length,
                kl_loss_coef=run.kl_loss_ctrl.value, ref=run.ref, record_entropy=run.bypass)
        update |= actor_update
        run.actor_sched.step()
        dist.sync_rollout_weights(run.rollout_model, run.actor)  # in place: its CUDA graphs see new weights
        entropy = first_pass_entropy if run.bypass else entropy

    # 7. metrics (verl's names), every one reduced over all ranks
    metrics.update(step_metrics(run, step, out, batch, update=update, entropy=entropy, t_step=t_step,
                                scores=seq_scores, rule_scores=rule_scores, rewards=rewards))
    return metrics


def dpo_step(run, step) -> dict:
    """One DPO step (actor.loss_mode dpo / ipo) on logged pairs: the chosen and the rejected response
    of each prompt, in that order. No score and no advantages: the ranking that ordered each pair is
    the signal, and the pair loss of nanokl/dpo.py the update. beta is the KL controller's value."""
    cfg, device = run.cfg, run.device
    a, ro = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    metrics, t_step = {}, time.perf_counter()
    rows, gen, shuffle = step_seeds(run, step)
    with timer(metrics, "gen", device):
        out, _ = run.respond(run, rows=rows, step=step, generator=gen, metrics=metrics)
    batch = workers.rollout_batch(out)
    batch["old_log_probs"], entropy = run.old_log_probs(run, batch, out, metrics)
    with timer(metrics, "ref", device):
        batch["ref_log_probs"], _ = workers.compute_log_probs(run.ref, batch, ro.temperature, spec=run.specs["ref"])
    batch["is_weights"], batch["response_mask"], is_metrics = run.correct(run, batch, out.log_probs)
    metrics.update(is_metrics)
    with timer(metrics, "adv", device):  # the policy's KL, for the controller and the monitor: no reward to pay it
        metrics.update(run.kl_reward(run, batch, torch.zeros_like(batch["old_log_probs"]))[1])
    with timer(metrics, "update_actor", device):
        update = dpo.update_policy(run.actor, run.actor_opt, batch, a, ro.temperature,
                                   mini_size=a.ppo_mini_batch_size * ro.n // run.world, spec=run.specs["actor"],
                                   generator=shuffle, beta=run.kl_ctrl.value)
    run.actor_sched.step()
    dist.sync_rollout_weights(run.rollout_model, run.actor)
    metrics.update(step_metrics(run, step, out, batch, update=update, entropy=entropy, t_step=t_step))
    return metrics


def reward_stop(run, done, error, before_commit=None):
    """A reward function failed (reward_fn.RewardError, on every rank): checkpoint the `done` steps, as the
    NaN stop does, and stop with one line naming the function, the row and the checkpoint (exit 1)."""
    path = save(run, done, healthy=False, before_commit=before_commit)
    run.ended = (f"reward function error in step {done + 1}" if before_commit is None else
                 f"reward function error in the validation after step {done}")
    finish(run)
    if before_commit is None:  # in the step: its update had not happened, and the resume runs it again
        raise TrainingStopped(f"stopped in step {done + 1}: {error}; checkpoint saved to {path} (the {done} steps "
                              f"done: the same command resumes there and runs step {done + 1} again)") from None
    raise TrainingStopped(f"stopped in the validation after step {done}: {error}; checkpoint saved to {path} "
                          "(the same command resumes after that step)") from None


def main(argv=None) -> int:
    """The run; its exit status (0, or 130 when Ctrl-C stopped it after a step and its checkpoint)."""
    cfg = parse_cli(argv)
    for key in ("default_local_dir", "rollout_data_dir", "validation_data_dir"):  # one line now, not a traceback later
        if getattr(cfg.trainer, key):
            check_writable(getattr(cfg.trainer, key), f"trainer.{key}")
    run = setup(cfg)  # models, optimizers, KL controllers, data; resumes a checkpoint if any
    step_fn = ppo_step if run.cfg.actor_rollout_ref.actor.loss_mode == "ppo" else dpo_step
    for step in steps(run):
        # as the step starts: what a checkpoint of the steps before it holds (ReMax scores again after beta moved)
        rng, ctrls = rng_state(), (run.kl_ctrl.state_dict(), run.kl_loss_ctrl.state_dict())
        try:
            metrics = step_fn(run, step)
        except RewardError as e:  # no update happened: save the steps done, and the resume redoes this one
            set_rng_state(rng)
            run.kl_ctrl.load_state_dict(ctrls[0])
            run.kl_loss_ctrl.load_state_dict(ctrls[1])
            reward_stop(run, step, e)
        try:
            go_on = end_step(run, step, metrics)  # validate, guard, monitor, checkpoint, log
        except RewardError as e:  # in the validation after the update: the step is done, its row logged with it
            reward_stop(run, step + 1, e, before_commit=lambda: run.tracker.log(metrics, step=step + 1))
        if not go_on:
            break
    finish(run)  # close the tracker; rank 0 prints the run's summary and writes summary.json
    interrupted = run.ended is not None and run.preempt is not None and run.preempt.signal == "SIGINT"
    return INTERRUPTED if interrupted else 0


def cli():
    status = 0
    try:
        status = run_cli(main) or 0
    except TrainingStopped as e:  # every rank stops; one says why
        if dist.rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        status = 1
    except KeyboardInterrupt:  # Ctrl-C outside the steps (setup, the first validation): no step to finish
        if dist.rank() == 0:
            print("error: interrupted (Ctrl-C) outside the training steps: no step was running", file=sys.stderr)
        status = INTERRUPTED
    dist.destroy()  # after main returned, so its DDP/FSDP models are already released
    sys.exit(status)


if __name__ == "__main__":
    cli()

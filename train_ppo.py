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
                 importance weights when another policy sampled                        nanokl/forwards.py, offline.py
  4. KL          in the reward: r_t = score_t - beta * KL_t (apply_kl_penalty), and the
                 controller moves beta toward target_kl (kl_ctrl.update); and/or in the
                 loss (actor.use_kl_loss, step 6)                                      nanokl/rewards.py, kl_ctrl.py
  5. advantages  GAE with the critic, or a baseline: the group's (GRPO, RLOO, ...), the
                 greedy response's (ReMax): compute_advantage                         nanokl/advantages.py
  6. update      ppo_epochs x mini-batches x micro-batches of the clipped value and
                 policy losses (+ KL loss, - entropy bonus)                            nanokl/workers.py, ppo.py
  7. metrics     verl's names, reduced over all ranks                                  harness/metrics.py
Each formula is a call or two away: go to definition from the step. Where a config turns a step on
or off (a critic, the KL in the reward, critic warm-up) the step says so with a plain named `if`; step
3's passes (`before_update`) skip pi_old's forward when the sampler is the fp32 actor itself (bypass). Four
steps have real alternatives, chosen once in setup (nanokl/harness/variants.py): `run.respond` samples
(or, offline, draws logged responses: nothing is generated; or, with DAPO's dynamic sampling, samples
rounds until enough prompts' responses disagree), `run.rollout_correction` weighs and rejects tokens
another policy sampled, `run.read_kl` is the KL the controller reads (the step's own, or corrected by
an on-policy probe), and `run.baselines` rolls out greedily for ReMax. DPO is another algorithm (no score, no advantages, a pair loss):
`dpo_step`. `main` is the loop around them; a reward function that fails in a step
(reward_fn.RewardError) ends it with a checkpoint of the steps done (exit 1), and Ctrl-C with one of
the step it finishes (exit 130, harness/faults.py). Everything that is not the step (models, resume,
checkpoints, validation, the KL monitor's warn/stop/rollback, logging) is the harness:
nanokl/harness/run.py. Under torchrun each process takes a slice of the prompts and the reductions
are global (nanokl/engine/dist.py), so the logged numbers do not depend on the number of processes.
"""

import math
import sys
import time

import torch

from nanokl import dpo, forwards, workers
from nanokl.engine import dist, shard
from nanokl.advantages import compute_advantage
from nanokl.harness.checkpoint import rng_state, set_rng_state
from nanokl.harness.config.yaml_io import run_cli
from nanokl.harness.config.load import parse_cli
from nanokl.harness.data import rank_rows, step_seed
from nanokl.harness.faults import INTERRUPTED, check_writable
from nanokl.harness.hacking import watch_ratio
from nanokl.harness.metrics import step_metrics, timer
from nanokl.harness.reward_fn import RewardError
from nanokl.harness.after_step import end_step, finish
from nanokl.harness.run import TrainingStopped, setup, steps
from nanokl.harness.run_state import save
from nanokl.harness.scoring import score_batch
from nanokl.harness.variants import exact_kl, reward_kl_metrics
from nanokl.rewards import apply_kl_penalty


def step_seeds(run, step):
    """This rank's prompts of step `step` and the step's generators: stateless per-step seeds, so
    resume needs only `step`; each rank samples differently, every rank shuffles alike."""
    d, seed = run.cfg.data, run.cfg.trainer.seed
    rows = rank_rows(len(run.train), d.train_batch_size, step, d.seed, d.shuffle, run.rank, run.world)
    gen = torch.Generator(run.device).manual_seed(step_seed(seed, step, run.rank))
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
    batch = forwards.rollout_batch(out)

    # 2. score each response (the task's rule, or the reward model); the score sits on its last token
    with timer(metrics, "reward", device):
        scores, seq_scores, rule_scores = score_batch(run.tok, out, examples, cfg, run.rm, global_step=step + 1,
                                                      metrics=metrics)

    # 3. forwards: pi_old's log-probs and entropy, the reference's, the critic's values; the weights and the
    #    rejection of tokens another policy sampled; the exact KL when kl_penalty is `full`
    entropy, exact = before_update(run, batch, out, metrics)

    with timer(metrics, "adv", device):
        # 4. KL in the reward: r_t = score_t - beta * KL_t, and the controller moves beta toward target_kl
        rewards, mask = scores, batch["response_mask"]
        if alg.use_kl_in_reward:
            beta = run.kl_ctrl.value
            rewards, kl, current = apply_kl_penalty(scores, batch["old_log_probs"], batch["ref_log_probs"], mask,
                                                    beta, alg.kl_penalty, reduce=dist.all_reduce, kl=exact)
            current = run.read_kl(run, batch, kl, current, metrics)  # offline: importance-weighted (+ the probe)
            run.kl_ctrl.update(current, n_steps=len(mask) * W)
            metrics.update(reward_kl_metrics(run, kl, mask, current, beta))
        # 5. advantages: GAE with the critic (whitened over all ranks), or a baseline (the group; remax: greedy),
        #    over the tokens step 3 kept; an outcome score is still the sum over the rollout's tokens
        #    (score_mask), as verl sums the whole row: a rejected last token takes no response's score away
        index = torch.arange(len(rows)).repeat_interleave(ro.n)  # the prompt of each response
        batch["advantages"], batch["returns"] = compute_advantage(
            alg.adv_estimator, rewards, mask, batch["values"], index, alg, whiten_stats=dist.all_reduce_moments,
            baselines=run.baselines(run, examples, metrics), score_mask=out.response_mask)

    # 6. update: critic first (verl's order), then the actor once critic_warmup has passed
    update = {}
    if run.critic is not None:
        c = cfg.critic
        with timer(metrics, "update_critic", device):
            update = workers.update_critic(run.critic, run.critic_opt, batch, c,
                                           mini_size=c.ppo_mini_batch_size * ro.n // W, spec=run.specs["critic"],
                                           generator=shuffle, horizon=ro.response_length)
        run.critic_sched.step()
    if step >= cfg.trainer.critic_warmup:
        with timer(metrics, "update_actor", device):
            actor_update, first_pass_entropy = workers.update_actor(
                run.actor, run.actor_opt, batch, a, ro.temperature, mini_size=a.ppo_mini_batch_size * ro.n // W,
                spec=run.specs["actor"], generator=shuffle, horizon=ro.response_length,
                kl_loss_coef=run.kl_loss_ctrl.value, ref=run.ref, record_entropy=entropy is None, watch=watch_ratio)
        update |= actor_update
        entropy = first_pass_entropy if entropy is None else entropy  # bypass: the update recorded pi_old's
        run.actor_sched.step()
        shard.sync_rollout_weights(run.rollout_model, run.actor)  # in place: its CUDA graphs see new weights

    # 7. metrics (verl's names), every one reduced over all ranks; then the KL loss's weight moves, when
    #    adaptive, toward its target from this step's KL loss, as beta did in step 4
    metrics.update(step_metrics(run, step, out, batch, update=update, entropy=entropy, t_step=t_step, phases=metrics,
                                scores=seq_scores, rule_scores=rule_scores, rewards=rewards))
    steer_kl_loss(run, metrics)
    return metrics


def before_update(run, batch, out, metrics):
    """Step 3, the passes before the update; fills batch's old_log_probs, ref_log_probs, values (None without a
    critic), is_weights and the response_mask rejection left. Returns (pi_old's entropy, or None when the update
    records it, the exact per-token KL or None). pi_old's log-probs are the actor's forward (verl's
    compute_log_prob, its largest gap to the rollout's own logged online: the sampler's numerics), or, when the
    sampler is the fp32 actor itself (run.bypass: forwards.rollout_log_probs_are_old), the rollout's."""
    device, T, alg = run.device, run.cfg.actor_rollout_ref.rollout.temperature, run.cfg.algorithm
    batch["old_log_probs"], entropy = out.log_probs, None
    if not run.bypass:
        with timer(metrics, "old_log_prob", device):
            batch["old_log_probs"], entropy = forwards.compute_log_probs(run.actor, batch, T, spec=run.specs["old"],
                                                                         with_entropy=True)
        if run.cfg.data.offline_files is None:
            gap = (out.log_probs - batch["old_log_probs"]).abs()
            metrics["rollout/log_prob_max_diff"] = dist.global_stats(gap, out.response_mask)[1]
    with timer(metrics, "ref", device):
        batch["ref_log_probs"], _ = forwards.compute_log_probs(run.ref, batch, T, spec=run.specs["ref"])
    batch["values"] = None
    if run.critic is not None:
        with timer(metrics, "values", device):
            batch["values"] = forwards.compute_values(run.critic, batch, spec=run.specs["values"])
    # importance weights min(pi_old/mu, C) and rejection: tokens far off pi_old leave the mask the losses read
    batch["is_weights"], batch["response_mask"], is_metrics = run.rollout_correction(run, batch, out.log_probs)
    metrics.update(is_metrics)
    full = alg.use_kl_in_reward and alg.kl_penalty == "full"  # both models' whole distributions
    return entropy, exact_kl(run, batch, metrics) if full else None


def steer_kl_loss(run, metrics) -> None:
    """An adaptive KL-loss coefficient (actor.kl_loss_ctrl) moves toward its target from this step's
    KL loss, actor/kl_loss, over the step's responses (kl_ctrl.py); with the on-policy probe
    (algorithm.kl_probe, nanokl/kl_probe.py) from the corrected KL instead, as beta's reading does.
    A step without a KL loss (critic warm-up, a skipped non-finite update) leaves it where it is."""
    kl = float(metrics.get("actor/kl_loss", math.nan))
    kl = float(metrics.get("kl_probe/kl_corrected", kl)) if math.isfinite(kl) else kl
    if run.kl_loss_ctrl.kind == "adaptive" and math.isfinite(kl):
        run.kl_loss_ctrl.update(kl, n_steps=run.cfg.data.train_batch_size * run.cfg.actor_rollout_ref.rollout.n)
        metrics["actor/kl_loss_target"] = run.kl_loss_ctrl.target


def dpo_step(run, step) -> dict:
    """One DPO step (actor.loss_mode dpo / ipo) on logged pairs: the chosen and the rejected response
    of each prompt, in that order. No score and no advantages: the ranking that ordered each pair is
    the signal, and the pair loss of nanokl/dpo.py the update. beta is the KL controller's value."""
    cfg, device = run.cfg, run.device
    a, ro, alg = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.algorithm
    metrics, t_step = {}, time.perf_counter()
    rows, gen, shuffle = step_seeds(run, step)
    with timer(metrics, "gen", device):
        out, _ = run.respond(run, rows=rows, step=step, generator=gen, metrics=metrics)
    batch = forwards.rollout_batch(out)
    entropy, exact = before_update(run, batch, out, metrics)
    with timer(metrics, "adv", device):  # the policy's KL, for the controller and the monitor: no reward to pay it
        if alg.use_kl_in_reward:
            beta, mask = run.kl_ctrl.value, batch["response_mask"]
            _, kl, current = apply_kl_penalty(torch.zeros_like(batch["old_log_probs"]), batch["old_log_probs"],
                                              batch["ref_log_probs"], mask, beta, alg.kl_penalty,
                                              reduce=dist.all_reduce, kl=exact)
            current = run.read_kl(run, batch, kl, current, metrics)
            run.kl_ctrl.update(current, n_steps=len(mask) * run.world)
            metrics.update(reward_kl_metrics(run, kl, mask, current, beta))
    with timer(metrics, "update_actor", device):
        update = dpo.update_policy(run.actor, run.actor_opt, batch, a, ro.temperature,
                                   mini_size=a.ppo_mini_batch_size * ro.n // run.world, spec=run.specs["actor"],
                                   generator=shuffle, beta=run.kl_ctrl.value)
    run.actor_sched.step()
    shard.sync_rollout_weights(run.rollout_model, run.actor)
    metrics.update(step_metrics(run, step, out, batch, update=update, entropy=entropy, t_step=t_step,
                                phases=metrics))
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

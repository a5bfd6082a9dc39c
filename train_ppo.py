"""KL-regularised PPO for a language model: one step, top to bottom (the lesson that ties nanokl together).

    python train_ppo.py                                        # CPU: the arithmetic task (configs/arith_tiny.yaml)
    python train_ppo.py --config configs/grpo_arith.yaml       # GRPO with a KL loss instead of a critic
    torchrun --nproc_per_node=8 train_ppo.py --config configs/gsm8k_qwen2.5_0.5b.yaml actor_rollout_ref.model.path=...

`ppo_step` is one step of verl's RayPPOTrainer.fit, in the order the data flows:
  1. rollout     sample `rollout.n` responses per prompt from the current policy        nanokl/rollout.py
                 (offline, data.offline_files: draw that many logged responses instead;
                 truncated importance weights correct for who sampled them)            nanokl/offline.py
  2. score       the task's rule (or a learned reward model) scores each response; the
                 scalar sits on the response's last token                              harness/scoring.py
  3. forwards    old log-probs + entropy (policy; taken from the rollout when the sampler
                 is the fp32 actor itself), reference log-probs, values (critic)        nanokl/workers.py
  4. KL          in the reward: r_t = score_t - beta * KL_t, beta steered toward
                 target_kl; and/or in the loss: + kl_loss_coef * KL (actor.use_kl_loss)  nanokl/kl.py, kl_ctrl.py
  5. advantages  GAE with the critic, or a group baseline (GRPO, RLOO)                   nanokl/advantages.py
  6. update      ppo_epochs x mini-batches x micro-batches of the clipped policy and
                 value losses (or DPO's loss on logged pairs: actor.loss_mode)          nanokl/workers.py, ppo.py, dpo.py
  7. metrics     verl's names, reduced over all ranks                                  harness/metrics.py
`main` is the loop around it. Everything that is not the step (models, resume, checkpoints,
validation, the KL monitor's warn/stop/rollback, logging) is the harness: nanokl/harness/run.py.
Under torchrun each process takes a slice of the prompts and the reductions are global
(nanokl/dist.py), so the logged numbers do not depend on the number of processes.
"""

import sys
import time

import torch

from nanokl import dist
from nanokl import workers
from nanokl.harness.config import parse_cli, run_cli
from nanokl.harness.data import batch_indices, build_prompts, steps_per_epoch
from nanokl.harness.logged import draw_responses, logged_batch
from nanokl.harness.metrics import add_stats, explained_variance, global_var, timer
from nanokl.harness.run import TrainingStopped, end_step, setup, steps
from nanokl.harness.scoring import score_batch
from nanokl.kl import kl_penalty
from nanokl.masked import masked_mean, zero_masked
from nanokl.offline import is_metrics_from_sums, is_sums, truncated_is_weights, weighted_kl
from nanokl.rollout import generate


def ppo_step(run, step) -> dict:
    """One PPO step on this rank's share of the prompts of global step `step`; returns its metrics."""
    cfg, device, W, rank = run.cfg, run.device, run.world, run.rank
    d, alg, t = cfg.data, cfg.algorithm, cfg.trainer
    a, ro, c = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.critic
    n, R, specs = ro.n, ro.response_length, run.specs
    metrics, t_step = {}, time.perf_counter()
    # stateless per-step seeds: resume needs only `step`; each rank samples differently
    gen = torch.Generator(device).manual_seed(t.seed * 1_000_003 + step * 8191 + rank)
    shuffle = torch.Generator().manual_seed(t.seed + step)
    per_rank = d.train_batch_size // W
    batch_idx = batch_indices(len(run.train), d.train_batch_size, step, d.seed, d.shuffle)
    mine = batch_idx[rank * per_rank:(rank + 1) * per_rank]
    examples = [run.train[i] for i in mine]  # this rank's prompts
    offline, pairs = d.offline_files is not None, a.loss_mode != "ppo"  # pairs: DPO / IPO

    # 1. rollout: n responses per prompt from the current policy. Offline, n of each prompt's logged
    # responses instead, sampled earlier by a behaviour policy mu: nothing is generated
    with timer(metrics, "gen", device):
        if offline:
            picks = [draw_responses(run.train[i], n, d.seed, step, i) for i in mine]
            out, logged = logged_batch(examples, picks, run.tok, d.prompt_template, d.max_prompt_length,
                                       d.truncation, device)
            mask = out.attention_mask[::n, :out.prompt_length]
        else:
            ids, mask = build_prompts(examples, run.tok, d.prompt_template, d.max_prompt_length, d.truncation,
                                      device=device)
            out = generate(dist.unwrap(run.rollout_model), ids, mask, R, temperature=ro.temperature, top_k=ro.top_k,
                           top_p=ro.top_p, do_sample=ro.do_sample, eos_token_id=run.tok.eos_token_ids,
                           pad_token_id=run.tok.pad_token_id, generator=gen, use_cuda_graph=ro.use_cuda_graph, n=n)
    examples_n = [ex for ex in examples for _ in range(n)]
    batch = {"sequences": out.sequences, "attention_mask": out.attention_mask, "position_ids": out.position_ids,
             "responses": out.responses, "response_mask": out.response_mask}
    rmask = out.response_mask

    # 2. score each response (the task's rule, or the reward model); the score sits on its last token.
    # DPO needs no score: the ranking that ordered each pair is its signal
    if not pairs:
        with timer(metrics, "reward", device):
            scores, seq_scores, rule_scores = score_batch(run.tok, out, examples_n, cfg, run.rm)

    # 3. forwards: old log-probs + entropy, reference log-probs, values. When the sampler *is* the
    # actor at the same weights and precision, the rollout's log-probs already are pi_old's (verl's
    # bypass mode): no forward, and the entropy comes from the update's own logits (step 6)
    bypass = not offline and step >= t.critic_warmup and workers.rollout_log_probs_are_old(
        alg.rollout_correction.bypass_mode, same_numerics=not run.rollout_copy and device.type == "cpu",
        do_sample=ro.do_sample, temperature=ro.temperature)
    if bypass:
        old_logp, entropy = out.log_probs, torch.zeros_like(out.log_probs)
    else:
        with timer(metrics, "old_log_prob", device):
            old_logp, entropy = workers.compute_log_probs(run.actor, batch, ro.temperature, specs["old"],
                                                          with_entropy=True)
    batch["old_log_probs"] = old_logp
    with timer(metrics, "ref", device):
        batch["ref_log_probs"], _ = workers.compute_log_probs(run.ref, batch, ro.temperature, specs["ref"])
    if run.critic is not None:
        with timer(metrics, "values", device):
            batch["values"] = workers.compute_values(run.critic, batch, specs["values"])
    # who sampled the responses, mu: the rollout; offline, the logged log-probs, or the reference where
    # none were logged. rollout_is weighs each token by min(pi_old / mu, C) (nanokl/offline.py)
    mu = torch.where(logged[:, None], out.log_probs, batch["ref_log_probs"]) if offline else out.log_probs
    if alg.rollout_correction.rollout_is == "token":
        batch["is_weights"] = is_w = truncated_is_weights(old_logp, mu, rmask, alg.rollout_correction.rollout_is_threshold)
        sums = dist.all_reduce(is_sums(is_w, rmask, alg.rollout_correction.rollout_is_threshold))
        metrics.update({f"rollout_corr/{k}": v for k, v in is_metrics_from_sums(sums).items()})

    # 4. KL in the reward: r_t = score_t - beta * KL_t, and the controller moves beta
    with timer(metrics, "adv", device):
        rewards = None if pairs else scores
        if alg.use_kl_in_reward:
            if alg.kl_penalty == "full":  # exact, over the vocabulary: both models' logits, micro-batch by micro-batch
                kld = zero_masked(workers.compute_full_kl(run.actor, run.ref, batch, ro.temperature, specs["old"]), rmask)
                for k in ("k1", "k3"):  # the estimators on the same tokens, beside the exact value
                    est = kl_penalty(old_logp, batch["ref_log_probs"], k)
                    metrics[f"actor/reward_kl_{k}"] = dist.global_stats(masked_mean(est, rmask, dim=-1))[0]
            else:
                kld = zero_masked(kl_penalty(old_logp, batch["ref_log_probs"], alg.kl_penalty), rmask)
            beta = run.kl_ctrl.value
            rewards = None if pairs else scores - beta * kld
            # per-token mean of each response, averaged over all ranks' responses. On responses mu
            # sampled, that is a KL under mu: weighted by the same truncated weights, it estimates
            # the KL of pi (self-normalised importance sampling; its bias: nanokl/offline.py)
            kl_per_response = masked_mean(kld, rmask, dim=-1)
            current_kl = dist.global_stats(kl_per_response)[0]
            if "is_weights" in batch:
                metrics["rollout_corr/kl_unweighted"] = current_kl
                w = torch.where(rmask.bool(), 1.0, 0.0) if alg.kl_penalty == "full" else batch["is_weights"]
                current_kl = weighted_kl(kld, w, rmask, reduce=dist.all_reduce).item()
            run.kl_ctrl.update(current_kl, n_steps=len(examples_n) * W)
            metrics.update({"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta,
                            "actor/reward_kl_var": global_var(kl_per_response)})  # for the KL monitor

        # 5. advantages: GAE with the critic (whitened over all ranks), or a group baseline (DPO: none)
        if not pairs:
            index = torch.arange(len(examples)).repeat_interleave(n)  # the prompt of each response
            adv, ret = run.estimator.fn(rewards, rmask, batch.get("values"), index, alg, dist.all_reduce_moments)
            batch.update(advantages=adv, returns=ret)

    # 6. update: critic first (verl's order), then the actor once critic_warmup has passed
    upd = {}
    if run.critic is not None:
        with timer(metrics, "update_critic", device):
            upd.update(workers.update_critic(run.critic, run.critic_opt, batch, c, c.ppo_mini_batch_size * n // W,
                                             specs["critic"], shuffle, R))
        run.critic_sched.step()
    if step >= t.critic_warmup:
        with timer(metrics, "update_actor", device):
            upd.update(workers.update_actor(run.actor, run.actor_opt, batch, a, ro.temperature,
                                            a.ppo_mini_batch_size * n // W, specs["actor"], shuffle, R,
                                            kl_loss_coef=run.kl_loss_ctrl.value, ref=run.ref,
                                            entropy_out=entropy if bypass else None, beta=run.kl_ctrl.value))
        run.actor_sched.step()
        if run.rollout_copy:  # refresh the rollout copy in place: its graphs see new weights
            dist.sync_rollout_weights(run.rollout_model, run.actor)
    metrics.update({k: sum(v) / len(v) for k, v in upd.items() if v})
    metrics["actor/nan_skipped"] = sum(upd.get("actor/nan_skipped", [])) + sum(upd.get("critic/nan_skipped", []))

    # 7. metrics (verl's names), every one reduced over all ranks
    metrics["actor/entropy"] = dist.global_stats(entropy, rmask)[0]
    metrics["actor/lr"] = run.actor_sched.get_last_lr()[0]
    metrics["rollout/bypass"] = float(bypass)
    if not bypass and not offline:  # with bypass they are the same tensor: nothing to compare
        metrics["rollout/log_prob_max_diff"] = dist.global_stats((out.log_probs - old_logp).abs(), rmask)[1]
    if not pairs:
        add_stats(metrics, "critic/score", seq_scores)
        metrics["critic/score/var"] = global_var(seq_scores)
        if run.rm is not None:  # the rule's verdict on the same responses: the RM's score is only a proxy
            add_stats(metrics, "critic/rule_score", rule_scores)
        add_stats(metrics, "critic/rewards", rewards.sum(-1))
        add_stats(metrics, "critic/advantages", batch["advantages"], rmask)
        add_stats(metrics, "critic/returns", batch["returns"], rmask)
    if run.critic is not None:
        add_stats(metrics, "critic/values", batch["values"], rmask)
        metrics["critic/vf_explained_var"] = explained_variance(batch["values"], batch["returns"], rmask)
    add_stats(metrics, "response_length", rmask.sum(-1).float())
    metrics["response_length/clip_ratio"] = dist.global_stats((rmask.sum(-1) == R).float())[0]
    add_stats(metrics, "prompt_length", mask.sum(-1).float())
    tokens = dist.all_reduce(out.attention_mask.sum().float()).item()
    metrics["timing_s/step"] = time.perf_counter() - t_step
    metrics.update({"perf/total_num_tokens": tokens, "perf/throughput": tokens / metrics["timing_s/step"] / W,
                    "training/epoch": step // steps_per_epoch(len(run.train), d.train_batch_size)})
    return metrics


def main(argv=None):
    run = setup(parse_cli(argv))  # models, optimizers, KL controllers, data; resumes a checkpoint if any
    for step in steps(run):
        metrics = ppo_step(run, step)
        if not end_step(run, step, metrics):  # validate, guard, monitor, checkpoint, log
            break
    run.tracker.close()


def cli():
    status = 0
    try:
        run_cli(main)
    except TrainingStopped as e:  # every rank stops; one says why
        if dist.rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        status = 1
    dist.destroy()  # after main returned, so its DDP/FSDP models are already released
    sys.exit(status)


if __name__ == "__main__":
    cli()

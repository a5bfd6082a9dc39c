"""The interchangeable parts of a PPO step, and which ones a config gets (chosen once, in setup).

train_ppo.py's `ppo_step` is one path. Where configs differ, a step is *replaced*, never branched
inside: `choose(cfg, ...)` picks one function for each part below, and the step calls it. Each part
is a few lines of plumbing (the run's models, config and timers) around a lesson function:

    part            choices                                                 lesson
    respond         sample_responses (online) | logged_responses (offline)  rollout.py / harness/logged.py
    old_log_probs   recompute_old (+ compare with the rollout's, online) |  workers.py
                    rollout_old (the sampler is the fp32 actor: bypass)
    values          critic_values | no_values (GRPO, RLOO: no critic)       workers.py
    correct         no_correction | token_is (truncated per-token weights)  offline.py
    kl_reward       kl_in_reward (an estimator) | exact_kl_in_reward         rewards.py
                    (`full`) | scores_only (KL in the loss, or nowhere)
    update_critic   critic_update | no_critic_update                        workers.py

Every part returns what it makes; a part that times itself writes `timing_s/<name>` into the
step's metrics (only parts that do work time themselves, so a run without a critic logs no
critic timings).
"""

import torch

from nanokl import dist, workers
from nanokl.graphs import generate
from nanokl.harness.data import build_prompts
from nanokl.harness.logged import draw_responses, logged_batch
from nanokl.harness.metrics import global_var, timer
from nanokl.kl import kl_penalty
from nanokl.masked import masked_mean
from nanokl.offline import behaviour_log_probs, is_metrics_from_sums, is_sums, truncated_is_weights, weighted_kl
from nanokl.rewards import apply_exact_kl_penalty, apply_kl_penalty


# 1. respond: n responses per prompt in a rollout's layout; out.log_probs are the sampler's (μ's)

def sample_responses(run, rows, step, generator):
    """n responses per prompt from the current policy; returns (out, each response's example)."""
    d, ro = run.cfg.data, run.cfg.actor_rollout_ref.rollout
    examples = [run.train[i] for i in rows]
    ids, mask = build_prompts(examples, run.tok, d.prompt_template, d.max_prompt_length, d.truncation,
                              device=run.device)
    out = generate(dist.unwrap(run.rollout_model), ids, mask, ro.response_length, temperature=ro.temperature,
                   top_k=ro.top_k, top_p=ro.top_p, do_sample=ro.do_sample, eos_token_id=run.tok.eos_token_ids,
                   pad_token_id=run.tok.pad_token_id, generator=generator, use_cuda_graph=ro.use_cuda_graph, n=ro.n)
    return out, [ex for ex in examples for _ in range(ro.n)]


def logged_responses(run, rows, step, generator):
    """Offline: n of each prompt's logged responses, drawn by (seed, step, row) alone; nothing is
    generated. out.log_probs: μ's where logged, NaN where not (nanokl/harness/logged.py)."""
    d, n = run.cfg.data, run.cfg.actor_rollout_ref.rollout.n
    examples = [run.train[i] for i in rows]
    picks = [draw_responses(run.train[i], n, d.seed, step, i) for i in rows]
    out = logged_batch(examples, picks, run.tok, d.prompt_template, d.max_prompt_length, d.truncation, run.device)
    return out, [ex for ex in examples for _ in range(n)]


# 3a. old_log_probs: π_old's log-prob of each token and the entropy (None: the update records it)

def recompute_old(run, batch, out, metrics):
    """The actor's forward on the batch (verl's compute_log_prob)."""
    with timer(metrics, "old_log_prob", run.device):
        return workers.compute_log_probs(run.actor, batch, run.cfg.actor_rollout_ref.rollout.temperature,
                                         spec=run.specs["old"], with_entropy=True)


def recompute_old_and_compare(run, batch, out, metrics):
    """recompute_old, and the largest gap to the rollout's own log-probs: the sampler's numerics."""
    old, entropy = recompute_old(run, batch, out, metrics)
    gap = (out.log_probs - old).abs()
    metrics["rollout/log_prob_max_diff"] = dist.global_stats(gap, out.response_mask)[1]
    return old, entropy


def rollout_old(run, batch, out, metrics):
    """The sampler *is* the actor at the same weights and precision: its log-probs are π_old's
    (verl's bypass mode; workers.rollout_log_probs_are_old says when). No forward."""
    return out.log_probs, None


# 3b. values

def critic_values(run, batch, metrics):
    with timer(metrics, "values", run.device):
        return workers.compute_values(run.critic, batch, spec=run.specs["values"])


def no_values(run, batch, metrics):
    return None


# 3c. correct: importance weights for responses μ sampled, and their metrics

def no_correction(run, batch, rollout_log_probs):
    return None, {}


def token_is(run, batch, rollout_log_probs):
    """Truncated per-token weights min(π_old/μ, C) (verl's rollout_is=token; nanokl/offline.py)."""
    rc = run.cfg.algorithm.rollout_correction
    mu = behaviour_log_probs(rollout_log_probs, batch["ref_log_probs"])
    w = truncated_is_weights(batch["old_log_probs"], mu, batch["response_mask"], rc.rollout_is_threshold)
    sums = dist.all_reduce(is_sums(w, batch["response_mask"], rc.rollout_is_threshold))
    return w, {f"rollout_corr/{k}": v for k, v in is_metrics_from_sums(sums).items()}


# 4. kl_reward: r_t = score_t - beta * KL_t; the controller reads the step's KL and moves beta

def kl_in_reward(run, batch, scores):
    """A sampled-token estimator (algorithm.kl_penalty) in the reward (nanokl/rewards.py)."""
    beta = run.kl_ctrl.value
    rewards, kl, current = apply_kl_penalty(scores, batch["old_log_probs"], batch["ref_log_probs"],
                                            batch["response_mask"], beta, run.cfg.algorithm.kl_penalty,
                                            reduce=dist.all_reduce)
    return rewards, steer(run, batch, kl, current, beta, batch["is_weights"], {})


def exact_kl_in_reward(run, batch, scores):
    """The exact KL over the vocabulary (kl_penalty `full`) from both models' logits, with the k1 and
    k3 estimates on the same tokens logged beside it."""
    beta, mask = run.kl_ctrl.value, batch["response_mask"]
    exact = workers.compute_full_kl(run.actor, run.ref, batch, run.cfg.actor_rollout_ref.rollout.temperature,
                                    spec=run.specs["old"])
    rewards, kl, current = apply_exact_kl_penalty(scores, exact, mask, beta, reduce=dist.all_reduce)
    metrics = {f"actor/reward_kl_{k}": dist.global_stats(masked_mean(kl_penalty(
        batch["old_log_probs"], batch["ref_log_probs"], k), mask, dim=-1))[0] for k in ("k1", "k3")}
    # no token was sampled for the exact KL: weights of 1 on real tokens (nanokl/offline.py)
    ones = None if batch["is_weights"] is None else torch.where(mask.bool(), 1.0, 0.0)
    return rewards, steer(run, batch, kl, current, beta, ones, metrics)


def steer(run, batch, kl, current, beta, weights, metrics):
    """Move beta with the step's KL. On responses μ sampled (weights given) the controller reads the
    self-normalised importance-weighted estimate of the KL under π (nanokl/offline.py), and the
    plain mean stays as a metric."""
    mask = batch["response_mask"]
    if weights is not None:
        metrics["rollout_corr/kl_unweighted"] = current
        current = weighted_kl(kl, weights, mask, reduce=dist.all_reduce).item()
    run.kl_ctrl.update(current, n_steps=len(mask) * run.world)
    return {**metrics, "actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": beta,
            "actor/reward_kl_var": global_var(masked_mean(kl, mask, dim=-1))}  # for the KL monitor


def scores_only(run, batch, scores):
    """No KL in the reward (it is in the loss, or nowhere): the rewards are the scores."""
    return scores, {}


# 6. update_critic

def critic_update(run, batch, generator, metrics):
    c, n = run.cfg.critic, run.cfg.actor_rollout_ref.rollout.n
    with timer(metrics, "update_critic", run.device):
        upd = workers.update_critic(run.critic, run.critic_opt, batch, c, mini_size=c.ppo_mini_batch_size * n // run.world,
                                    spec=run.specs["critic"], generator=generator,
                                    horizon=run.cfg.actor_rollout_ref.rollout.response_length)
    run.critic_sched.step()
    return upd


def no_critic_update(run, batch, generator, metrics):
    return {}


def choose(cfg, *, critic: bool, bypass: bool) -> dict:
    """The part for each step of this config (the module docstring's table)."""
    offline, alg = cfg.data.offline_files is not None, cfg.algorithm
    if bypass:
        old = rollout_old
    else:
        old = recompute_old if offline else recompute_old_and_compare
    kl = scores_only
    if alg.use_kl_in_reward:
        kl = exact_kl_in_reward if alg.kl_penalty == "full" else kl_in_reward
    return dict(respond=logged_responses if offline else sample_responses, old_log_probs=old,
                values=critic_values if critic else no_values,
                correct=token_is if alg.rollout_correction.rollout_is == "token" else no_correction,
                kl_reward=kl, update_critic=critic_update if critic else no_critic_update)


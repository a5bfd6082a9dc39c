"""The interchangeable parts of a PPO step, and which ones a config gets (chosen once, in setup).

train_ppo.py's `ppo_step` is one path. Where configs differ, a step is *replaced*, never branched
inside: `choose(cfg, ...)` picks one function for each part below, and the step calls it. Each part
is a few lines of plumbing (the run's models, config and timers) around a lesson function:

    part            choices                                                 lesson
    respond         sample_responses (online) | logged_responses (offline)  rollout.py / harness/logged.py
                    | sample_kept_groups (DAPO's dynamic sampling:          sampling.py
                    algorithm.filter_groups)
    old_log_probs   recompute_old (+ compare with the rollout's, online) |  workers.py
                    rollout_old (the sampler is the fp32 actor: bypass)
    values          critic_values | no_values (GRPO, RLOO: no critic)       workers.py
    correct         no_correction | token_is (truncated per-token weights)  offline.py
                    | sequence_is (the response's truncated product), each
                    optionally followed by rejection (rollout_rs: tokens
                    leave response_mask)
    kl_reward       kl_in_reward (an estimator) | exact_kl_in_reward         rewards.py
                    (`full`) | scores_only (KL in the loss, or nowhere);
                    the KL the controller reads: logged_kl (the step's) | kl_probe.py
                    probed_kl (plus the smoothed gap to an on-policy
                    probe: algorithm.kl_probe)
    baselines       no_baselines | greedy_baselines (remax: the score of    advantages.py
                    each prompt's greedy response)
    update_critic   critic_update | no_critic_update                        workers.py

Every part returns what it makes; a part that times itself writes `timing_s/<name>` into the
step's metrics (only parts that do work time themselves, so a run without a critic logs no
critic timings).
"""

import functools
import itertools
import math

import torch
import torch.nn.functional as F

from nanokl import dist, workers
from nanokl.advantages import ESTIMATORS
from nanokl.graphs import generate
from nanokl.harness.data import build_prompts, rank_rows
from nanokl.harness.logged import draw_responses, logged_batch
from nanokl.harness.metrics import global_var, timer
from nanokl.harness.run_state import TrainingStopped
from nanokl.harness.scoring import score_batch
from nanokl.kl import kl_penalty
from nanokl.kl_probe import ProbeState, corrected_kl, probe_stats, probe_sums
from nanokl.masked import masked_mean
from nanokl.offline import (IS_LEVELS, behaviour_log_probs, is_metrics_from_sums, is_sums, rejection_mask,
                            rs_metrics_from_sums, rs_sums, weighted_kl)
from nanokl.rewards import apply_exact_kl_penalty, apply_kl_penalty
from nanokl.rollout import RolloutOutput
from nanokl.sampling import GroupBuffer, cat_rows


# 1. respond: n responses per prompt in a rollout's layout; out.log_probs are the sampler's (μ's)

def sample_responses(run, rows, step, generator, metrics):
    """n responses per prompt from the current policy; returns (out, each response's example)."""
    d, ro = run.cfg.data, run.cfg.actor_rollout_ref.rollout
    examples = [run.train[i] for i in rows]
    ids, mask = build_prompts(examples, run.tok, d.prompt_template, d.max_prompt_length, d.truncation,
                              device=run.device)
    out = generate(dist.unwrap(run.rollout_model), ids, mask, ro.response_length, temperature=ro.temperature,
                   top_k=ro.top_k, top_p=ro.top_p, do_sample=ro.do_sample, eos_token_id=run.tok.eos_token_ids,
                   pad_token_id=run.tok.pad_token_id, generator=generator, use_cuda_graph=ro.use_cuda_graph, n=ro.n)
    return out, [ex for ex in examples for _ in range(ro.n)]


def logged_responses(run, rows, step, generator, metrics):
    """Offline: n of each prompt's logged responses, drawn by (seed, step, row) alone; nothing is
    generated. out.log_probs: μ's where logged, NaN where not (nanokl/harness/logged.py)."""
    d, n = run.cfg.data, run.cfg.actor_rollout_ref.rollout.n
    examples = [run.train[i] for i in rows]
    picks = [draw_responses(run.train[i], n, d.seed, step, i) for i in rows]
    out = logged_batch(examples, picks, run.tok, d.prompt_template, d.max_prompt_length, d.truncation, run.device)
    return out, [ex for ex in examples for _ in range(n)]


def sample_kept_groups(run, rows, step, generator, metrics):
    """DAPO's dynamic sampling (algorithm.filter_groups; nanokl/sampling.py): sample and score this
    step's prompts, keep the groups whose filter_groups.metric is not all equal, and sample the next
    batches of prompts of the epoch (those of steps step+1, step+2, ...; the generator runs on) until
    data.train_batch_size prompts are kept; the first that many, in generation order, are the step's
    batch (scored again in step 2). One process: setup refuses torchrun. Logs train/num_gen_batches
    and train/num_dropped_groups (groups whose responses all agreed)."""
    d, n, fg = run.cfg.data, run.cfg.actor_rollout_ref.rollout.n, run.cfg.algorithm.filter_groups
    buffer, sampled = GroupBuffer(len(rows), fg.max_num_gen_batches), 0
    for k in itertools.count():
        if k:  # the next generation batch, as verl's DAPO trainer draws the dataloader's next one
            rows = rank_rows(len(run.train), d.train_batch_size, step + k, d.seed, d.shuffle, run.rank, run.world)
        out, examples = sample_responses(run, rows, step, generator, metrics)
        token_scores, scores, rule = score_batch(run.tok, out, examples, run.cfg, run.rm)
        metric = {"acc": rule, "score": scores, "seq_reward": token_scores.sum(-1)}[fg.metric]
        sampled += len(rows)
        try:
            if buffer.add(rollout_parts(out, examples), metric, torch.arange(len(rows)).repeat_interleave(n)):
                break
        except RuntimeError as e:  # max_num_gen_batches reached short of the batch (verl raises too)
            raise TrainingStopped(str(e)) from None
    parts, _ = buffer.take(cat=functools.partial(pad_cat, pad_token_id=run.tok.pad_token_id))
    metrics.update({"train/num_gen_batches": buffer.num_gen_batches,
                    "train/num_dropped_groups": sampled - buffer.num_prompts})
    return rollout_from_parts(parts), parts["examples"]


def rollout_parts(out, examples) -> dict:
    """A rollout as per-response entries (prompt and response apart, so rounds of different widths join)."""
    P = out.prompt_length
    return {"prompt_ids": out.sequences[:, :P], "prompt_mask": out.attention_mask[:, :P], "responses": out.responses,
            "response_mask": out.response_mask, "log_probs": out.log_probs, "examples": examples}


def pad_cat(key, parts, pad_token_id):
    """Join one entry's rounds: prompts left-padded, responses right-padded to the widest round."""
    if key == "examples":
        return cat_rows(parts)
    width, left = max(p.shape[1] for p in parts), key.startswith("prompt")
    fill = pad_token_id if key in ("prompt_ids", "responses") else 0
    return torch.cat([F.pad(p, (width - p.shape[1], 0) if left else (0, width - p.shape[1]), value=fill)
                      for p in parts])


def rollout_from_parts(parts) -> RolloutOutput:
    """rollout_parts' inverse: the training layout of nanokl/rollout.py (positions from the masks)."""
    mask, responses = parts["prompt_mask"], parts["responses"]
    resp_pos = mask.sum(-1, keepdim=True) + torch.arange(responses.shape[1], device=mask.device)
    return RolloutOutput(sequences=torch.cat([parts["prompt_ids"], responses], 1),
                         attention_mask=torch.cat([mask, parts["response_mask"]], 1),
                         position_ids=torch.cat([(mask.cumsum(-1) - 1).clamp(min=0), resp_pos], 1),
                         responses=responses, response_mask=parts["response_mask"], log_probs=parts["log_probs"],
                         prompt_length=mask.shape[1])


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


# 3c. correct: importance weights and rejection for responses μ sampled -> (weights, response_mask, metrics)

def no_correction(run, batch, rollout_log_probs):
    return None, batch["response_mask"], {}


def token_is(run, batch, rollout_log_probs):
    """Truncated per-token weights min(π_old/μ, C) (verl's rollout_is=token; nanokl/offline.py)."""
    return _is_weights(run, batch, rollout_log_probs, "token")


def sequence_is(run, batch, rollout_log_probs):
    """The response's truncated product min(Π_t π_old/μ, C) on each of its tokens (verl's rollout_is=sequence)."""
    return _is_weights(run, batch, rollout_log_probs, "sequence")


def _is_weights(run, batch, rollout_log_probs, level):
    rc, mask = run.cfg.algorithm.rollout_correction, batch["response_mask"]
    mu = behaviour_log_probs(rollout_log_probs, batch["ref_log_probs"])
    w = IS_LEVELS[level](batch["old_log_probs"], mu, mask, rc.rollout_is_threshold)
    sums = dist.all_reduce(is_sums(w, mask, rc.rollout_is_threshold))
    return w, mask, {f"rollout_corr/{k}": v for k, v in is_metrics_from_sums(sums).items()}


def rejection(run, batch, rollout_log_probs, weigh=no_correction):
    """`weigh` (one of the three above), then verl's rejection sampling (rollout_rs): every token whose
    statistic of log π_old/μ leaves its bounds, or whose response's does, leaves response_mask
    (nanokl/offline.py's rejection_mask): it weighs nothing in the losses, as in verl, nor in the KL
    penalty and the KL its controller reads (verl applies the KL penalty before rejection: README,
    'Where nanokl differs from verl'). Step 5 places the advantages on the kept tokens, but the
    outcome estimators (grpo, rloo, reinforce_plus_plus_baseline, grpo_passk) still sum each
    response's score over the rollout's mask (`score_mask`), as verl sums the whole row, so a
    rejected last token takes no score away; GAE, REINFORCE++ and ReMax run over the kept tokens
    alone and, as in verl, drop the reward on a rejected token (nanokl/advantages.py, 'Two masks')."""
    rc = run.cfg.algorithm.rollout_correction
    w, mask, metrics = weigh(run, batch, rollout_log_probs)
    mu = behaviour_log_probs(rollout_log_probs, batch["ref_log_probs"])
    kept = rejection_mask(batch["old_log_probs"], mu, mask, rc.rollout_rs, rc.rollout_rs_threshold)
    sums = dist.all_reduce(rs_sums(kept, mask))
    return w, kept, {**metrics, **{f"rollout_corr/rollout_{k}": v for k, v in rs_metrics_from_sums(sums).items()}}


# 4. kl_reward: r_t = score_t - beta * KL_t; the controller reads the step's KL and moves beta

def kl_in_reward(run, batch, scores, read=None):
    """A sampled-token estimator (algorithm.kl_penalty) in the reward (nanokl/rewards.py); `read`:
    the KL the controller reads (logged_kl when None)."""
    beta = run.kl_ctrl.value
    rewards, kl, current = apply_kl_penalty(scores, batch["old_log_probs"], batch["ref_log_probs"],
                                            batch["response_mask"], beta, run.cfg.algorithm.kl_penalty,
                                            reduce=dist.all_reduce)
    return rewards, steer(run, batch, kl, current, beta, batch["is_weights"], {}, read or logged_kl)


def exact_kl_in_reward(run, batch, scores, read=None):
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
    return rewards, steer(run, batch, kl, current, beta, ones, metrics, read or logged_kl)


def steer(run, batch, kl, current, beta, weights, metrics, read):
    """Move beta with the KL `read` gives (logged_kl or probed_kl); actor/reward_kl_penalty is always
    the number the controller read, so the KL monitor reads it too."""
    mask = batch["response_mask"]
    current = read(run, batch, kl, current, weights, metrics)
    run.kl_ctrl.update(current, n_steps=len(mask) * run.world)
    if getattr(run.kl_ctrl, "hold", 0):  # kl_ctrl.hold: the monitor's low side waits while beta does
        metrics["actor/kl_ctrl_holding"] = float(not run.kl_ctrl.reached)
    return {**metrics, "actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": beta,
            "actor/reward_kl_var": global_var(masked_mean(kl, mask, dim=-1))}  # for the KL monitor


def logged_kl(run, batch, kl, current, weights, metrics):
    """The step's own KL: the plain mean over its responses, or, on responses μ sampled (weights
    given), the self-normalised importance-weighted estimate of the KL under π (nanokl/offline.py),
    with the plain mean kept as a metric."""
    if weights is None:
        return current
    metrics["rollout_corr/kl_unweighted"] = current
    return weighted_kl(kl, weights, batch["response_mask"], reduce=dist.all_reduce).item()


def probed_kl(run, batch, kl, current, weights, metrics, state):
    """logged_kl plus the smoothed gap to an on-policy probe (algorithm.kl_probe; nanokl/kl_probe.py):
    every `every` steps the policy samples `prompts` of the step's prompts (one response each), before
    the controller moves. Logs the step's estimate (rollout_corr/kl_logged), the probe (kl_probe/kl, its
    standard error), the gap, what the controller reads (kl_probe/kl_corrected) and the responses and
    tokens the probe generated so far (kl_probe/responses, kl_probe/tokens)."""
    cfg, kp = run.cfg, run.cfg.algorithm.kl_probe
    logged, step, probe = logged_kl(run, batch, kl, current, weights, metrics), run.start + state.steps, None
    state.steps += 1
    if step % kp.every == 0:
        d, ro = cfg.data, cfg.actor_rollout_ref.rollout
        rows = rank_rows(len(run.train), d.train_batch_size, step, d.seed, d.shuffle, run.rank, run.world)
        rows = rows[:math.ceil(kp.prompts / run.world)]
        with timer(metrics, "kl_probe", run.device):
            ids, mask = build_prompts([run.train[i] for i in rows], run.tok, d.prompt_template, d.max_prompt_length,
                                      d.truncation, device=run.device)
            gen = torch.Generator(run.device).manual_seed(cfg.trainer.seed * 1_000_003 + step * 8191 + run.rank + 104729)
            sums = dist.all_reduce(probe_sums(run.actor, run.ref, dist.unwrap(run.rollout_model), ids, mask, ro,
                                              cfg.algorithm.kl_penalty, run.tok.eos_token_ids, run.tok.pad_token_id,
                                              gen, spec=run.specs["old"]).to(run.device)).cpu()
        probe, se = probe_stats(sums)
        state.responses, state.tokens = state.responses + int(sums[2]), state.tokens + int(sums[3])
        metrics.update({"kl_probe/kl": probe, "kl_probe/kl_se": se})
    read = corrected_kl(state, logged, probe, kp.ema)
    metrics.update({"rollout_corr/kl_logged": logged, "kl_probe/gap": state.gap, "kl_probe/kl_corrected": read,
                    "kl_probe/responses": state.responses, "kl_probe/tokens": state.tokens})
    return read


def scores_only(run, batch, scores):
    """No KL in the reward (it is in the loss, or nowhere): the rewards are the scores."""
    return scores, {}


# 5. baselines: what an estimator compares each response with beyond its own group (remax)

def no_baselines(run, examples, metrics):
    return None


def greedy_baselines(run, examples, metrics):
    """ReMax's baseline (adv_estimator=remax, advantages.py): each prompt's greedy response (n=1, the
    same sampler), scored as the step's responses are (score_batch: the rule or the reward model, the
    missing-EOS and overlong penalties); its score repeated over the prompt's rollout.n rows. Timed as
    verl's timing_s/gen_max. `examples`: the step's examples, one per response (n per prompt, in order)."""
    d, ro = run.cfg.data, run.cfg.actor_rollout_ref.rollout
    prompts = examples[::ro.n]
    with timer(metrics, "gen_max", run.device):
        ids, mask = build_prompts(prompts, run.tok, d.prompt_template, d.max_prompt_length, d.truncation,
                                  device=run.device)
        out = generate(dist.unwrap(run.rollout_model), ids, mask, ro.response_length, temperature=ro.temperature,
                       do_sample=False, eos_token_id=run.tok.eos_token_ids, pad_token_id=run.tok.pad_token_id,
                       use_cuda_graph=ro.use_cuda_graph)
        token_scores, _, _ = score_batch(run.tok, out, prompts, run.cfg, run.rm)
    return token_scores.sum(-1).repeat_interleave(ro.n)


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
        if alg.kl_probe.enable:  # its state (the smoothed gap, the cost so far) lives with the part
            kl = functools.partial(kl, read=functools.partial(probed_kl, state=ProbeState()))
    rc = alg.rollout_correction
    correct = {None: no_correction, "token": token_is, "sequence": sequence_is}[rc.rollout_is]
    if rc.rollout_rs:
        correct = functools.partial(rejection, weigh=correct)
    respond = sample_kept_groups if alg.filter_groups.enable else sample_responses
    return dict(respond=logged_responses if offline else respond, old_log_probs=old,
                values=critic_values if critic else no_values, correct=correct, kl_reward=kl,
                baselines=greedy_baselines if ESTIMATORS[alg.adv_estimator].needs_greedy_baseline else no_baselines,
                update_critic=critic_update if critic else no_critic_update)


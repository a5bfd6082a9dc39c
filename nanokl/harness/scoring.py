"""Scoring a step's rollouts and the held-out set: the rule, the learned reward model, accuracy.

Training reward. Each response is decoded and judged by the run's score function, called once per
response by verl's `naive` reward manager (nanokl/harness/reward_fn.py): the user's
custom_reward_function, or the rule of the task data.task names (its `score`, nanokl/tasks/: the
arithmetic answer check, GSM8K's strict / flexible `#### N` match), or, with data files and no
data.task, the rule each row's data_source names (verl's default_compute_score). With
`reward_model.enable` a learned reward model scores the same `[prompt | response]` token sequences
instead (nanokl/supervised/reward_model.py, normalised to mean 0 and std 1 on
reference-policy samples), and the rule's verdict is still computed and logged
(`critic/rule_score/*`): the learned reward is a proxy, and a rising RM score with a flat or
falling rule score is reward hacking made visible (Gao et al. 2023).

Either way one scalar per response becomes the `[N, R]` tensor PPO adds the KL penalty to:
`token_level_scores` (nanokl/rewards.py) puts it on the response's last real token. A score function
that raises, returns no number or a non-finite one stops the step (reward_fn.RewardError, on every
rank), and train_ppo.main saves the steps done before it exits. A response
cut off by the length limit before its EOS gets `missing_eos_penalty` subtracted. With
trainer.rollout_data_dir, each step's prompts, responses and scores are written there as JSONL, and
with trainer.log_val_generations validation hands its (input, output, score) samples to the
caller (nanokl/harness/generations.py).

On-policy KL (`on_policy_kl`, trainer.val_kl_prompts > 0). At each validation the first
val_kl_prompts held-out prompts are sampled once each at the rollout temperature, and the KL
estimator of the reward (algorithm.kl_penalty; k1 for `full`) is averaged as the trainer averages
it: per token within a response, then over responses: `val-aux/kl_on_policy`, with its standard
error over responses (`val-aux/kl_on_policy_se`). Online it measures again what
actor/reward_kl_penalty measures; offline, where the training KL is an importance-weighted
estimate from responses another policy sampled (nanokl/offline.py), it is the check.

Validation always uses the score function, never the reward model
(`val-core/<data_source>/acc/mean@n`, greedy by default): it is the ground truth the reward model
is trying to learn. Under torchrun rank r takes every W-th held-out prompt and the sums are
all-reduced, so the accuracy is over the whole held-out set.

tests/test_scoring.py checks that reward_model.max_length keeps each row's last real tokens;
tests/test_reward_fn.py, each score against a hand loop over the score function, on its last token.
"""

import math

import torch

from nanokl import dist
from nanokl.kl import kl_penalty
from nanokl.kl_probe import probe_stats
from nanokl.masked import masked_mean
from nanokl.rewards import overlong_penalty, token_level_scores
from nanokl.workers import compute_log_probs
from nanokl.harness import reward_fn
from nanokl.harness.data import build_prompts
from nanokl.harness.generations import dump_rollout, prompt_texts
from nanokl.harness.metrics import add_stats
from nanokl.harness.val_metrics import metric_key, metric_names, prompt_metrics
from nanokl.graphs import generate
from nanokl.supervised.reward_model import keep_last_tokens, score_with_rm


def score_batch(tok, out, examples, cfg, rm=None, global_step=None, metrics=None):
    """Decode and score by rule; with a reward model (reward_model.enable) the RM's normalised
    score is the reward instead, and the rule score is kept to be logged beside it (a growing gap
    between the two is reward hacking). With reward_model.overlong_buffer.enable, DAPO's soft
    length penalty is added to the reward (into `metrics`, when given: critic/overlong_penalty/*
    and critic/overlong_fraction). Each score sits on its response's last token.
    With trainer.rollout_data_dir and the step's `global_step`, the batch is written there.
    Returns (token-level scores, reward per response, rule score per response)."""
    texts = tok.batch_decode(out.responses, out.response_mask)
    # (logged rows scored by a reward model may carry no ground truth: their rule score is nan, not logged)
    score, failed = reward_fn.scorer(cfg), None
    try:  # a raising, non-numeric or non-finite reward stops every rank here (RewardError: train_ppo.main saves)
        rule = torch.tensor(reward_fn.manager(cfg)(score, texts, examples))
    except reward_fn.RewardError as e:
        failed = e
    reward_fn.agree(failed)
    scores = rule
    if rm is not None:
        mask = keep_last_tokens(out.attention_mask, cfg.reward_model.max_length)
        scores = score_with_rm(rm, out.sequences, mask, cfg.reward_model.micro_batch_size_per_gpu).cpu()
    ob = cfg.reward_model.overlong_buffer
    if ob.enable:  # 0 up to response_length - len tokens (EOS included), then down to -penalty_factor at the limit
        penalty = overlong_penalty(out.response_mask.sum(-1).cpu(), cfg.actor_rollout_ref.rollout.response_length,
                                   ob.len, ob.penalty_factor)
        scores = scores + penalty.to(scores.dtype)  # the rule score stays unshaped (filter_groups' "acc")
        if metrics is not None:
            add_stats(metrics, "critic/overlong_penalty", penalty.float())
            metrics["critic/overlong_fraction"] = dist.global_stats((penalty < 0).float())[0]
    last = (out.response_mask.sum(-1) - 1).clamp(min=0)
    ended = torch.isin(out.responses.gather(1, last[:, None])[:, 0], torch.tensor(tok.eos_token_ids, device=last.device))
    missing_eos = ~ended | (out.response_mask.sum(-1) == 0)
    token_scores = token_level_scores(scores.tolist(), out.response_mask, missing_eos,
                                      cfg.reward_model.missing_eos_penalty)
    if global_step is not None and cfg.trainer.rollout_data_dir:
        dump_rollout(cfg.trainer.rollout_data_dir, global_step, prompt_texts(tok, out), texts,
                     [ex.get("ground_truth") for ex in examples], token_scores.sum(-1).tolist())
    return token_scores, scores, rule


@torch.no_grad()
def validate(model, tok, val, cfg, device, ref=None, samples=None):
    """Greedy (val_kwargs) accuracy on the held-out prompts, per data source: val-core/<src>/acc/mean@n.
    Rank r scores prompts r, r+W, r+2W, ...; the sums are reduced over ranks. With val_kwargs.n > 1,
    also verl's best@k / worst@k / maj@k (`at_k`). Given the reference `ref` and
    trainer.val_kl_prompts > 0, also the on-policy KL (`on_policy_kl`). Given a list `samples`, this
    rank's (input, output, score, ground truth) of every response are appended to it."""
    vk = cfg.actor_rollout_ref.rollout.val_kwargs
    score, answer = reward_fn.scorer(cfg), reward_fn.answerer(cfg)
    sources = sorted({ex["data_source"] for ex in val})
    totals = torch.zeros(len(sources) + 1, 2)  # (sum, count) per source, then response lengths
    names = metric_names(vk.n, with_maj=answer is not None)[1:]  # mean@n is the totals' (the same number)
    at_k = torch.zeros(len(sources), len(names) + 1, dtype=torch.float64)  # per source: sums over prompts, prompts
    mine = val[dist.rank()::dist.world()]
    try:  # a failing reward function (reward_fn.call) stops every rank after its loop: no collective inside
        _validate_chunks(model, tok, mine, cfg, device, score, answer, sources, totals, names, at_k, samples)
        failed = None
    except reward_fn.RewardError as e:
        failed = e
    reward_fn.agree(failed)
    totals = dist.all_reduce(totals)
    metrics = {f"val-core/{src}/acc/mean@{vk.n}": (s / n).item() for src, (s, n) in zip(sources, totals) if n > 0}
    if names:  # verl's names: val-core for best / maj at k = n, val-aux for the rest (harness/val_metrics.py)
        at_k = dist.all_reduce(at_k)
        metrics.update({metric_key(src, "acc", name, vk.n, "acc"): (row[i] / row[-1]).item()
                        for src, row in zip(sources, at_k) if row[-1] > 0 for i, name in enumerate(names)})
    if totals[-1, 1] > 0:
        metrics["val-aux/response_length/mean"] = (totals[-1, 0] / totals[-1, 1]).item()
    if ref is not None and cfg.trainer.val_kl_prompts:
        metrics.update(on_policy_kl(dist.unwrap(model), ref, tok, val, cfg, device))
    return metrics


def _validate_chunks(model, tok, mine, cfg, device, score, answer, sources, totals, names, at_k, samples):
    """validate's loop over this rank's held-out prompts, val_batch_size at a time: adds to `totals`,
    `at_k` and `samples` in place."""
    d, vk = cfg.data, cfg.actor_rollout_ref.rollout.val_kwargs
    for i in range(0, len(mine), d.val_batch_size):
        chunk = mine[i:i + d.val_batch_size]
        ids, mask = build_prompts(chunk, tok, d.prompt_template, d.max_prompt_length, d.truncation, device=device)
        out = generate(model, ids, mask, cfg.actor_rollout_ref.rollout.response_length, temperature=vk.temperature,
                       top_k=vk.top_k, top_p=vk.top_p, do_sample=vk.do_sample and vk.temperature > 0,
                       eos_token_id=tok.eos_token_ids, pad_token_id=tok.pad_token_id, n=vk.n,
                       generator=torch.Generator(device).manual_seed(cfg.trainer.seed + dist.rank()))
        texts = tok.batch_decode(out.responses, out.response_mask)
        hits = [reward_fn.call(score, text, chunk[j // vk.n], f"validation response {i * vk.n + j} of this rank")
                for j, text in enumerate(texts)]
        for j, hit in enumerate(hits):
            totals[sources.index(chunk[j // vk.n]["data_source"])] += torch.tensor([hit, 1.0])
        for p in range(len(chunk) if names else 0):  # val_kwargs.n > 1: each prompt's bootstrap over its n
            mine_n = slice(p * vk.n, (p + 1) * vk.n)
            votes = None if answer is None else [answer(t, chunk[p]) for t in texts[mine_n]]
            per = prompt_metrics(hits[mine_n], votes)
            at_k[sources.index(chunk[p]["data_source"])] += torch.tensor([per[k] for k in names] + [1.0],
                                                                         dtype=torch.float64)
        if samples is not None:
            samples.extend(zip(prompt_texts(tok, out), texts, hits,
                               [chunk[j // vk.n].get("ground_truth") for j in range(len(texts))]))
        totals[-1] += torch.tensor([out.response_mask.sum().item(), float(len(texts))])


@torch.no_grad()
def on_policy_kl(model, ref, tok, val, cfg, device) -> dict:
    """Per-token KL(pi || pi_ref) on fresh samples of the first trainer.val_kl_prompts held-out prompts
    (the module docstring): val-aux/kl_on_policy and its standard error over responses."""
    d, ro, kind = cfg.data, cfg.actor_rollout_ref.rollout, cfg.algorithm.kl_penalty
    kind = "k1" if kind == "full" else kind  # `full` needs both models' logits; k1 is its unbiased estimate
    mine = val[:cfg.trainer.val_kl_prompts][dist.rank()::dist.world()]
    gen = torch.Generator(device).manual_seed(cfg.trainer.seed + 7919 + dist.rank())
    moments = torch.zeros(3, dtype=torch.float64)  # sum, sum of squares, count of per-response KLs
    for i in range(0, len(mine), d.val_batch_size):
        ids, mask = build_prompts(mine[i:i + d.val_batch_size], tok, d.prompt_template, d.max_prompt_length,
                                  d.truncation, device=device)
        out = generate(model, ids, mask, ro.response_length, temperature=ro.temperature, top_k=ro.top_k,
                       top_p=ro.top_p, do_sample=ro.do_sample, eos_token_id=tok.eos_token_ids,
                       pad_token_id=tok.pad_token_id, generator=gen)
        batch = {"sequences": out.sequences, "attention_mask": out.attention_mask, "position_ids": out.position_ids,
                 "responses": out.responses, "response_mask": out.response_mask}
        ref_logp, _ = compute_log_probs(ref, batch, ro.temperature)
        per_response = masked_mean(kl_penalty(out.log_probs, ref_logp, kind), out.response_mask, dim=-1).double().cpu()
        moments += torch.stack([per_response.sum(), (per_response ** 2).sum(), torch.tensor(float(len(per_response)))])
    kl, se = probe_stats(dist.all_reduce(moments))
    return {} if math.isnan(kl) else {"val-aux/kl_on_policy": kl, "val-aux/kl_on_policy_se": se}

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
that raises or exits, runs past custom_reward_function.timeout, or returns no number or one not finite
in float32 stops the step (reward_fn.RewardError, on every rank), and harness/after_step.py saves the
steps done before it exits. A response
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
all-reduced, so the accuracy is over the whole held-out set. A score function that returns verl's
dict ({"score", "acc", "pred", ...}; reward_fn.Reward) is read as verl reads it: the reward is
"score", the accuracy (val-core, and the rule's accuracy a step returns) is "acc" when present, and
validation averages every numeric key under verl's names (val-aux/<data_source>/<key>/mean@n, the
score as .../reward/...); a training step logs none of them, as verl's does not.

tests/test_scoring.py checks that reward_model.max_length keeps each row's last real tokens;
tests/test_reward_fn.py, each score against a hand loop over the score function, on its last token;
tests/test_dict_rewards.py, dict rewards in the step and in validation against verl's loop.
"""

import math
import numbers
from pathlib import Path

import torch

from nanokl.engine import dist, shard
from nanokl.tasks.rows import UserError
from nanokl.kl import kl_penalty
from nanokl.kl_probe import probe_stats
from nanokl.masked import masked_mean
from nanokl.rewards import overlong_penalty, token_level_scores
from nanokl.forwards import compute_log_probs
from nanokl.harness import call_limit, reward_fn
from nanokl.harness.data import encode_prompts
from nanokl.harness.generations import dump_rollout, gather, prompt_texts
from nanokl.harness.hf_format import load_reward_model, read_config
from nanokl.harness.metrics import add_stats
from nanokl.harness.val_metrics import prompt_metrics, source_metrics
from nanokl.rollout import generate


def sampling_settings(cfg, tok) -> dict:
    """generate's keyword arguments for the rollout's sampling (actor_rollout_ref.rollout) and the
    tokenizer's end and pad tokens."""
    ro = cfg.actor_rollout_ref.rollout
    return dict(eos_token_id=tok.eos_token_ids, pad_token_id=tok.pad_token_id, temperature=ro.temperature,
                top_k=ro.top_k, top_p=ro.top_p, do_sample=ro.do_sample, use_cuda_graph=ro.use_cuda_graph)


def sample(model, tok, examples, cfg, device, *, n=1, generator=None, **sampling):
    """n responses to each example's prompt (encoded as data.* asks) from `model`, with the rollout's
    sampling settings unless `sampling` overrides them (validation's val_kwargs, ReMax's greedy pass)."""
    ids, mask = encode_prompts(examples, tok, cfg.data, device)
    return generate(shard.unwrap(model), ids, mask, cfg.actor_rollout_ref.rollout.response_length,
                    generator=generator, n=n, **(sampling_settings(cfg, tok) | sampling))


def score_batch(tok, out, examples, cfg, rm=None, global_step=None, metrics=None):
    """Decode and score by rule; with a reward model (reward_model.enable) the RM's normalised
    score is the reward instead, and the rule score is kept to be logged beside it (a growing gap
    between the two is reward hacking). With reward_model.overlong_buffer.enable, DAPO's soft
    length penalty is added to the reward (into `metrics`, when given: critic/overlong_penalty/*
    and critic/overlong_fraction). Each score sits on its response's last token.
    With trainer.rollout_data_dir and the step's `global_step`, the batch is written there.
    Returns (token-level scores, reward per response, the rule's accuracy per response: the "acc" of a
    dict reward (verl's, e.g. tasks/math_dapo.py's 0/1 beside its +-1 score), else its score; what
    critic/rule_score logs and algorithm.filter_groups.metric=acc reads, as verl's DAPO trainer reads the
    "acc" of reward_extra_info). verl logs no other key of a dict reward per training step: none is here.
    """
    texts = tok.batch_decode(out.responses, out.response_mask)
    # (logged rows scored by a reward model may carry no ground truth: their rule score is nan, not logged)
    score, failed = reward_fn.scorer(cfg), None
    try:  # a raising, non-numeric or non-finite reward stops every rank here (RewardError: after_step.take_step saves)
        rewards = reward_fn.manager(cfg)(score, texts, examples)
    except reward_fn.RewardError as e:
        failed = e
    reward_fn.agree(failed)
    scores = torch.tensor(rewards)
    rule = torch.tensor([reward_fn.accuracy(r) for r in rewards])
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
def evaluate(model, tok, val, cfg, device, ref=None, samples=None):
    """Greedy (val_kwargs) accuracy on the held-out prompts, per data source: val-core/<src>/acc/mean@n,
    the "acc" of a dict reward (verl's core variable), else the score. Rank r scores prompts r, r+W,
    r+2W, ...; the sums are reduced over ranks. With val_kwargs.n > 1, also verl's best@k / worst@k /
    maj@k (harness/val_metrics.py). A dict reward's other numbers are averaged too, as verl's
    _validate does: val-aux/<src>/reward/... (the score), val-aux/<src>/<key>/... (every numeric key,
    "score" included); maj@k votes on the task's answers, else on the dict's "pred". Given the reference
    `ref` and trainer.val_kl_prompts > 0, also the on-policy KL (`on_policy_kl`). Given a list
    `samples`, this rank's (input, output, score, ground truth) of every response are appended to it."""
    vk = cfg.actor_rollout_ref.rollout.val_kwargs
    score, answer = reward_fn.scorer(cfg), reward_fn.answerer(cfg)
    sources = sorted({ex["data_source"] for ex in val})
    totals = torch.zeros(len(sources) + 1, 2)  # (sum, count) of the accuracy per source, then response lengths
    prompts = []  # this rank's prompts: (source, what its responses returned, {variable: prompt_metrics})
    mine = val[dist.rank()::dist.world()]
    try:  # a failing reward function (reward_fn.call) stops every rank after its loop: no collective inside
        _validate_chunks(model, tok, mine, cfg, device, score, answer, sources, totals, prompts, samples)
        failed = None
    except reward_fn.RewardError as e:
        failed = e
    reward_fn.agree(failed)
    totals = dist.all_reduce(totals)
    metrics = {f"val-core/{src}/acc/mean@{vk.n}": (s / n).item() for src, (s, n) in zip(sources, totals) if n > 0}
    prompts, shapes = gather(prompts), {}  # every rank's, in rank order: the same list, and metrics, on each
    for src, shape, _ in prompts:  # (each rank has checked its own; this, the ranks against each other)
        _same_shape(shapes, src, shape, reward_fn.named(score), "on another rank")
    for key, value in source_metrics([(src, variables) for src, _, variables in prompts]).items():
        metrics.setdefault(key, value)  # acc's mean@n is the totals' (the same number, summed per response)
    if totals[-1, 1] > 0:
        metrics["val-aux/response_length/mean"] = (totals[-1, 0] / totals[-1, 1]).item()
    if ref is not None and cfg.trainer.val_kl_prompts:
        metrics.update(on_policy_kl(shard.unwrap(model), ref, tok, val, cfg, device))
    return metrics


def _validate_chunks(model, tok, mine, cfg, device, score, answer, sources, totals, prompts, samples):
    """evaluate's loop over this rank's held-out prompts, val_batch_size at a time: adds to `totals`,
    `prompts` and `samples` in place."""
    d, vk, ob = cfg.data, cfg.actor_rollout_ref.rollout.val_kwargs, cfg.reward_model.overlong_buffer
    shapes = {}  # data source -> what its first response returned (_shape)
    gen = torch.Generator(device).manual_seed(cfg.trainer.seed + dist.rank())  # once: each chunk draws anew
    for i in range(0, len(mine), d.val_batch_size):
        chunk = mine[i:i + d.val_batch_size]
        out = sample(model, tok, chunk, cfg, device, n=vk.n, temperature=vk.temperature, top_k=vk.top_k,
                     top_p=vk.top_p, do_sample=vk.do_sample and vk.temperature > 0, use_cuda_graph=None,
                     generator=gen)
        texts = tok.batch_decode(out.responses, out.response_mask)
        which = [f"validation response {i * vk.n + j} of this rank" for j in range(len(texts))]
        if getattr(score, "batch", None) is not None:  # reward_manager=batch: one call for the chunk (reward_fn.batched)
            rewards = reward_fn.batched(score, texts, [chunk[j // vk.n] for j in range(len(texts))], which)
        else:
            with call_limit.handler():  # as reward_fn.naive: SIGALRM's handler once for the chunk's calls
                rewards = [reward_fn.call(score, text, chunk[j // vk.n], which[j]) for j, text in enumerate(texts)]
        # DAPO's overlong penalty shapes the reward in validation too, as verl's reward manager adds it there
        # (acc and a dict's score stay unshaped)
        shaping = [0.0] * len(texts) if not ob.enable else overlong_penalty(
            out.response_mask.sum(-1).cpu(), cfg.actor_rollout_ref.rollout.response_length, ob.len,
            ob.penalty_factor).tolist()
        for j, reward in enumerate(rewards):
            totals[sources.index(chunk[j // vk.n]["data_source"])] += torch.tensor([reward.acc, 1.0])
            _same_shape(shapes, chunk[j // vk.n]["data_source"], _shape(reward), reward_fn.named(score),
                        f"for {which[j]}")
        for p, ex in enumerate(chunk):  # each prompt's numbers over its n responses (val_metrics.prompt_metrics)
            mine_n = slice(p * vk.n, (p + 1) * vk.n)
            votes = None
            if vk.n > 1 and answer is not None:  # maj@k: the task's answers, else verl's "pred" of a dict reward
                votes = [answer(t, ex) for t in texts[mine_n]]
            elif vk.n > 1 and all("pred" in r.info for r in rewards[mine_n]):
                votes = [r.info["pred"] for r in rewards[mine_n]]
            per_response = [_variables(r, pen) for r, pen in zip(rewards[mine_n], shaping[mine_n])]
            prompts.append((ex["data_source"], _shape(rewards[p * vk.n]),
                            {var: prompt_metrics([v[var] for v in per_response], votes) for var in per_response[0]}))
        if samples is not None:
            samples.extend(zip(prompt_texts(tok, out), texts, [float(r) + pen for r, pen in zip(rewards, shaping)],
                               [chunk[j // vk.n].get("ground_truth") for j in range(len(texts))]))
        totals[-1] += torch.tensor([out.response_mask.sum().item(), float(len(texts))])


def _variables(reward, shaping=0.0) -> dict:
    """What validation averages of one response (verl's reward_extra_infos_dict entry): "acc" (the dict's,
    else the score); for a dict reward also "reward" (the score plus the overlong `shaping`) and each of its
    numeric or bool keys."""
    out = {"acc": reward.acc}
    if reward.info:
        out["reward"] = float(reward) + shaping
        out.update({k: float(v) for k, v in reward.info.items() if k != "acc" and isinstance(v, numbers.Real)})
    return out


def _shape(reward) -> str:
    """What a reward function returned, as far as validation's variables go: "a number", or "a dict with
    <its numeric keys>"."""
    keys = sorted(k for k, v in reward.info.items() if isinstance(v, numbers.Real))
    return f"a dict with {', '.join(map(repr, keys))}" if reward.info else "a number"


def _same_shape(shapes, source, shape, what, where):
    """A response of `source` returned the same shape (_shape) as the first of its source did (`shapes`:
    source -> that shape, filled here), else a RewardError: verl's validation averages each key over all
    of a source's responses (its _validate asserts one value per response)."""
    first = shapes.setdefault(source, shape)
    if shape != first:
        raise reward_fn.RewardError(
            f"{what} returned {shape} {where} (data_source {source!r}) but {first} for another of its "
            "validation responses: every response of a data source must return the same keys "
            "(verl's validation averages each key over all of them)")


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
        out = sample(model, tok, mine[i:i + d.val_batch_size], cfg, device, generator=gen, use_cuda_graph=None)
        batch = {"sequences": out.sequences, "attention_mask": out.attention_mask, "position_ids": out.position_ids,
                 "responses": out.responses, "response_mask": out.response_mask}
        ref_logp, _ = compute_log_probs(ref, batch, ro.temperature)
        per_response = masked_mean(kl_penalty(out.log_probs, ref_logp, kind), out.response_mask, dim=-1).double().cpu()
        moments += torch.stack([per_response.sum(), (per_response ** 2).sum(), torch.tensor(float(len(per_response)))])
    kl, se = probe_stats(dist.all_reduce(moments))
    return {} if math.isnan(kl) else {"val-aux/kl_on_policy": kl, "val-aux/kl_on_policy_se": se}


# The learned reward model at work (trained by nanokl/supervised/reward_model.py)

def load_rm(cfg, device):
    """The learned reward model a run scores with (reward_model.enable): *ForSequenceClassification or
    *ForTokenClassification (verl's class) with one label. Refused in one line: a causal LM (no reward
    head: verl's AutoModelForTokenClassification would draw a random one), and a reward model whose
    vocabulary is not the policy's: it reads the policy's token ids as they are (no decode and
    re-tokenize), so what must agree is each id's token, not the tokenizer files' bytes."""
    rm_path = cfg.reward_model.model.path
    cfg_json, head = read_config(rm_path)
    if head == "lm":
        raise UserError(f"reward_model.model.path={rm_path}: a causal LM ({cfg_json['model_type']}, *ForCausalLM) "
                        "has no reward head (verl's AutoModelForTokenClassification would give it a random one); "
                        "give a trained reward model (*ForSequenceClassification or *ForTokenClassification, "
                        "num_labels=1), e.g. python -m nanokl.supervised.reward_model --config ...")
    rm = load_reward_model(rm_path, device=device).eval()
    if (Path(rm_path) / "tokenizer.json").is_file():
        check_same_vocab(rm_path, cfg.actor_rollout_ref.model.tokenizer_path)
    return rm


def check_same_vocab(rm_path, policy_path) -> None:
    """A UserError naming the first id on which the two tokenizers' vocabularies (added tokens included)
    disagree: the reward model would read the policy's ids as other tokens."""
    from nanokl.harness.tokenizer import load_tokenizer
    rm_vocab, policy_vocab = (load_tokenizer(p).tok.get_vocab(with_added_tokens=True) for p in (rm_path, policy_path))
    if rm_vocab == policy_vocab:
        return
    rm_ids, policy_ids = ({i: t for t, i in v.items()} for v in (rm_vocab, policy_vocab))
    i = min(set(rm_ids) ^ set(policy_ids) | {i for i in rm_ids.keys() & policy_ids.keys() if rm_ids[i] != policy_ids[i]})
    raise UserError(f"the reward model at {rm_path} has another vocabulary than the policy's ({policy_path}): "
                    f"id {i} is {rm_ids.get(i, '<none>')!r} to it, {policy_ids.get(i, '<none>')!r} to the policy; it "
                    "reads the policy's token ids, so retrain it on the policy's tokenizer: "
                    "python -m nanokl.supervised.reward_model --config ...")


@torch.no_grad()
def raw_rewards(rm, sequences, attention_mask, micro_batch_size=None) -> torch.Tensor:
    """[N] un-normalised rewards, `micro_batch_size` rows per forward (None: all at once)."""
    step = micro_batch_size or len(sequences)
    return torch.cat([rm(sequences[i:i + step], attention_mask[i:i + step]).float()
                      for i in range(0, len(sequences), step)])


def keep_last_tokens(attention_mask, max_length=None):
    """The mask with only each row's last `max_length` real tokens kept (reward_model.max_length):
    the reward model reads the end of the response, so a long prompt loses its beginning. Masked
    tokens count as padding, and position ids restart from the first kept token."""
    if max_length is None:
        return attention_mask
    from_end = attention_mask.flip(-1).cumsum(-1).flip(-1)  # real tokens at or after each position
    return attention_mask * (from_end <= max_length)


def score_with_rm(rm, sequences, attention_mask, micro_batch_size=None) -> torch.Tensor:
    """[N] normalised rewards (r - mean) / std of the rollout's [prompt | response] sequences; PPO
    puts each on its response's last token (harness/scoring.token_level_scores)."""
    return (raw_rewards(rm, sequences, attention_mask, micro_batch_size) - rm.reward_mean) / rm.reward_std

"""The parts of a PPO step that really vary between configs, each chosen once in setup.

train_ppo.py's `ppo_step` is one path, with a plain named `if` where a config turns a step on or
off (a critic, the KL in the reward, critic warm-up). Four steps have real alternatives; `choose`
picks one function for each, bound to the run, and the step calls `run.<part>(...)`. Each part's
type below (a Protocol: its call signature) names the choices:

    part                step  choices                                               lesson
    respond             1     sample_responses (online) | logged_responses          rollout.py
                              (offline: nothing is generated) | sample_kept_groups  sampling.py
                              (DAPO's dynamic sampling: algorithm.filter_groups)
    rollout_correction  3     offline.no_correction | token_weights (truncated      offline.py
                              per-token weights) | sequence_weights (the response's
                              truncated product), each optionally followed by
                              offline.rejection (rollout_rs: tokens leave the mask)
    read_kl             4     offline.logged_kl (the step's own KL; importance-     offline.py
                              weighted on responses another policy sampled) |       kl_probe.py
                              probed_kl (plus the smoothed gap to an on-policy
                              probe: algorithm.kl_probe)
    baselines           5     no_baselines | greedy_baselines (remax: the score of  advantages.py
                              each prompt's greedy response)

The corrections and the KL the controller reads are the lessons' own functions (offline.py,
kl_probe.py), bound here to the config and to a sum over ranks; what needs the run (its prompts,
models, tokenizer) stays here. Beside them, what the step calls for its optional work: `exact_kl`
(kl_penalty `full`: the KL over the vocabulary from both models' logits) and `reward_kl_metrics`
(what the KL monitor reads of the reward's KL). A part that does work times itself as
`timing_s/<name>` in the step's metrics.
"""

import functools
import itertools
import math
from typing import Protocol

import torch
import torch.nn.functional as F

from nanokl import forwards, offline
from nanokl.advantages import ESTIMATORS
from nanokl.engine import dist, shard
from nanokl.harness.data import encode_prompts, rank_rows, step_seed
from nanokl.harness.logged import draw_responses, logged_batch
from nanokl.harness.metrics import global_var, timer
from nanokl.harness.run_state import TrainingStopped
from nanokl.harness.scoring import sample, sampling_settings, score_batch
from nanokl.kl import kl_penalty
from nanokl.kl_probe import ProbeState, corrected_kl, probe_stats, probe_sums
from nanokl.masked import masked_mean, zero_masked
from nanokl.rollout import RolloutOutput, generate
from nanokl.sampling import GroupBuffer, cat_rows


class Respond(Protocol):
    """Step 1: n responses per prompt of `rows` in a rollout's layout, their log-probs the
    sampler's (μ's), and each response's example. Choices: sample_responses, logged_responses,
    sample_kept_groups (below)."""
    def __call__(self, rows: list[int], step: int, generator: torch.Generator,
                 metrics: dict) -> tuple[RolloutOutput, list[dict]]: ...


class Correct(Protocol):
    """Step 3: (importance weights or None, the response_mask left after rejection, metrics) of
    tokens μ sampled. Choices: nanokl/offline.py's no_correction, token_weights,
    sequence_weights, rejection."""
    def __call__(self, batch: dict, rollout_log_probs: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor, dict]: ...


class ReadKL(Protocol):
    """Step 4: the KL the controller reads, from the per-token KL and the step's plain mean
    `current`. Choices: nanokl/offline.py's logged_kl, probed_kl (below)."""
    def __call__(self, batch: dict, kl: torch.Tensor, current: float, metrics: dict) -> float: ...


class Baselines(Protocol):
    """Step 5: a baseline score per response beyond its group's, or None. Choices: no_baselines,
    greedy_baselines (below)."""
    def __call__(self, examples: list[dict], metrics: dict) -> torch.Tensor | None: ...


# 1. respond: n responses per prompt in a rollout's layout; out.log_probs are the sampler's (μ's)

def sample_responses(run, rows, step, generator, metrics):
    """n responses per prompt from the current policy (nanokl/rollout.py's generate, with the
    rollout's sampling settings); returns (out, each response's example)."""
    ro = run.cfg.actor_rollout_ref.rollout
    examples = [run.train[i] for i in rows]
    ids, mask = encode_prompts(examples, run.tok, run.cfg.data, run.device)
    out = generate(shard.unwrap(run.rollout_model), ids, mask, ro.response_length, generator=generator,
                   n=ro.n, **sampling_settings(run.cfg, run.tok))
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
        if k or d.gen_batch_size != d.train_batch_size:  # each round draws data.gen_batch_size prompts, as
            # verl's DAPO trainer draws its dataloader's next batch
            rows = rank_rows(len(run.train), d.gen_batch_size, step + k, d.seed, d.shuffle, run.rank, run.world)
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


# 3 and 4: the corrections and the KL the controller reads are nanokl/offline.py's; the probe's
# reading is nanokl/kl_probe.py's, given the probe this run takes

def probed_kl(run, state, batch, kl, current, metrics):
    """offline.logged_kl plus the smoothed gap to an on-policy probe (algorithm.kl_probe;
    nanokl/kl_probe.py): every `every` steps the policy samples `prompts` of the step's prompts
    (one response each), before the controller moves. Logs the step's estimate
    (rollout_corr/kl_logged), the probe (kl_probe/kl, its standard error), the gap, what the
    controller reads (kl_probe/kl_corrected) and the responses and tokens the probe generated so
    far (kl_probe/responses, kl_probe/tokens)."""
    cfg, kp = run.cfg, run.cfg.algorithm.kl_probe
    logged = offline.logged_kl(batch, kl, current, metrics, exact=cfg.algorithm.kl_penalty == "full",
                               reduce=dist.all_reduce)
    step, probe = run.start + state.steps, None
    state.steps += 1
    if step % kp.every == 0:
        d, ro = cfg.data, cfg.actor_rollout_ref.rollout
        rows = rank_rows(len(run.train), d.train_batch_size, step, d.seed, d.shuffle, run.rank, run.world)
        rows = rows[:math.ceil(kp.prompts / run.world)]
        with timer(metrics, "kl_probe", run.device):
            ids, mask = encode_prompts([run.train[i] for i in rows], run.tok, d, device=run.device)
            gen = torch.Generator(run.device).manual_seed(step_seed(cfg.trainer.seed, step, run.rank + 104729))
            sums = dist.all_reduce(probe_sums(run.actor, run.ref, shard.unwrap(run.rollout_model), ids, mask, ro,
                                              cfg.algorithm.kl_penalty, run.tok.eos_token_ids, run.tok.pad_token_id,
                                              gen, spec=run.specs["old"]).to(run.device)).cpu()
        probe, se = probe_stats(sums)
        state.responses, state.tokens = state.responses + int(sums[2]), state.tokens + int(sums[3])
        metrics.update({"kl_probe/kl": probe, "kl_probe/kl_se": se})
    read = corrected_kl(state, logged, probe, kp.ema)  # KL_read = l + the smoothed gap (nanokl/kl_probe.py)
    metrics.update({"rollout_corr/kl_logged": logged, "kl_probe/gap": state.gap, "kl_probe/kl_corrected": read,
                    "kl_probe/responses": state.responses, "kl_probe/tokens": state.tokens})
    return read


# the KL in the reward (the step computes r_t = score_t - beta * KL_t and moves beta with what read_kl reads)

def reward_kl(run, batch, metrics):
    """KL_t of step 4, [N, R], 0 past the response_mask: the estimator algorithm.kl_penalty names on
    the sampled tokens (nanokl/kl.py), or with `full` the exact KL over the vocabulary (exact_kl)."""
    kind = run.cfg.algorithm.kl_penalty
    if kind == "full":  # both models' logits again
        kl = exact_kl(run, batch, metrics)
    else:
        kl = kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], kind)
    return zero_masked(kl, batch["response_mask"])


def exact_kl(run, batch, metrics):
    """The exact KL over the vocabulary (kl_penalty `full`) from both models' logits, [N, R]; the k1 and
    k3 estimates on the same tokens logged beside it."""
    mask = batch["response_mask"]
    exact = forwards.compute_full_kl(run.actor, run.ref, batch, run.cfg.actor_rollout_ref.rollout.temperature,
                                    spec=run.specs["old"])
    for k in ("k1", "k3"):
        metrics[f"actor/reward_kl_{k}"] = dist.global_stats(masked_mean(kl_penalty(
            batch["old_log_probs"], batch["ref_log_probs"], k), mask, dim=-1))[0]
    return exact


def reward_kl_metrics(run, kl, mask, current, beta) -> dict:
    """actor/reward_kl_penalty is always the number the controller read, so the KL monitor reads it too."""
    metrics = {}
    if getattr(run.kl_ctrl, "hold", 0):  # kl_ctrl.hold: the monitor's low side waits while beta does
        metrics["actor/kl_ctrl_holding"] = float(not run.kl_ctrl.reached)
    return {**metrics, "actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": beta,
            "actor/reward_kl_var": global_var(masked_mean(kl, mask, dim=-1))}


# baselines: what an estimator compares each response with beyond its own group (ReMax)

def no_baselines(examples, metrics):
    return None


def greedy_baselines(run, examples, metrics):
    """ReMax's baseline (adv_estimator=remax, advantages.py): each prompt's greedy response (n=1, the
    same sampler), scored as the step's responses are (score_batch: the rule or the reward model, the
    missing-EOS and overlong penalties); its score repeated over the prompt's rollout.n rows. Timed as
    verl's timing_s/gen_max. `examples`: the step's examples, one per response (n per prompt, in order)."""
    n = run.cfg.actor_rollout_ref.rollout.n
    prompts = examples[::n]
    with timer(metrics, "gen_max", run.device):
        out = sample(run.rollout_model, run.tok, prompts, run.cfg, run.device, do_sample=False, top_k=-1, top_p=1.0)
        token_scores, _, _ = score_batch(run.tok, out, prompts, run.cfg, run.rm)
    return token_scores.sum(-1).repeat_interleave(n)


def choose(run) -> tuple[Respond, Correct, ReadKL, Baselines]:
    """The part for each step of this run's config (the module docstring's table), bound to it."""
    cfg = run.cfg
    alg, rc = cfg.algorithm, cfg.algorithm.rollout_correction
    respond = sample_kept_groups if alg.filter_groups.enable else sample_responses
    respond = logged_responses if cfg.data.offline_files is not None else respond
    weigh = {None: offline.no_correction, "token": offline.token_weights,
             "sequence": offline.sequence_weights}[rc.rollout_is]
    correct = functools.partial(weigh, rc=rc, reduce=dist.all_reduce)
    if rc.rollout_rs:
        correct = functools.partial(offline.rejection, rc=rc, reduce=dist.all_reduce, weigh=weigh)
    read_kl = functools.partial(offline.logged_kl, exact=alg.kl_penalty == "full", reduce=dist.all_reduce)
    if alg.kl_probe.enable:
        read_kl = functools.partial(probed_kl, run, ProbeState())
    baselines = no_baselines
    if ESTIMATORS[alg.adv_estimator].needs_greedy_baseline:
        baselines = functools.partial(greedy_baselines, run)
    return functools.partial(respond, run), correct, read_kl, baselines

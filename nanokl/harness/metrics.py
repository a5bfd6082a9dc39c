"""Step metrics under verl's names, reduced over all ranks, and the timers of a step.

verl's `compute_data_metrics` reports, for each per-response or per-token quantity of a batch
(scores, rewards, advantages, returns, values, response lengths), its mean, max and min as
`<name>/mean`, `/max`, `/min`; `compute_timing_metrics` reports seconds per phase as
`timing_s/<phase>`; and, after the step's other numbers, prompt_length/clip_ratio,
response/aborted_ratio, perf/time_per_step (= timing_s/step) and timing_per_token_ms/<phase> (gen per
response token, ref, values, adv, update_critic, update_actor per prompt + response token). Under data parallelism each
rank holds a slice of the batch, so every statistic here is reduced over ranks (sums and counts for
means, max/min for extremes; nanokl/engine/dist.py): the logged numbers are those of the whole global
batch, whatever the world size.

The critic's explained variance, 1 - Var[R - V] / Var[R] over the response tokens, is 1 for a
critic that predicts the returns exactly, 0 for one that predicts their mean, and negative for a
worse one (verl's critic/vf_explained_var). Var[R] is floored at 1e-8, so constant returns give a
finite number. tests/test_metrics.py checks it against numpy at world size 1, padding included.

response_repetition (nanokl's, for the KL monitor's degenerate-text check, nanokl/harness/hacking.py):
each response's share of repeated 3-grams, 1 − distinct/total over its 3-grams (0 for a response
of fewer than 3 tokens; "7 7 7 7 7" has three 3-grams, one distinct: 2/3), mean/max/min over the
step's responses. A reward that pays for repetition drives it toward 1 (tests/test_hacking.py).
"""

import math
import time
from contextlib import contextmanager

import torch

from nanokl.engine import dist
from nanokl.harness.data import steps_per_epoch
from nanokl.masked import masked_moments


def add_stats(metrics, name, values, mask=None):
    """name/mean, /max, /min over the masked entries of all ranks (verl's compute_data_metrics)."""
    mean, hi, lo = dist.global_stats(values, mask)
    if math.isfinite(mean):
        metrics.update({f"{name}/mean": mean, f"{name}/max": hi, f"{name}/min": lo})


def global_var(values, mask=None):
    """Population variance of the masked entries of all ranks (e.g. over the step's responses)."""
    mask = torch.ones_like(values) if mask is None else mask
    s1, s2, n = dist.all_reduce_moments(masked_moments(values.float(), mask))
    return ((s2 / n - (s1 / n) ** 2).clamp(min=0)).item() if n > 0 else float("nan")


def explained_variance(values, returns, mask):
    """1 - Var[R - V] / Var[R] over all ranks' response tokens (critic/vf_explained_var); the
    n/(n-1) of unbiased variances cancels in the ratio."""
    return 1 - global_var(returns - values, mask) / max(global_var(returns, mask), 1e-8)


def repetition(responses, mask, n=3) -> torch.Tensor:
    """[N] share of each response's n-grams that repeat an earlier one (see the module docstring)."""
    out = []
    for row, length in zip(responses.tolist(), mask.sum(-1).long().tolist()):
        grams = [tuple(row[i:i + n]) for i in range(length - n + 1)]
        out.append(1 - len(set(grams)) / len(grams) if grams else 0.0)
    return torch.tensor(out, dtype=torch.float32, device=responses.device)


@contextmanager
def timer(metrics, name, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize()
    metrics[f"timing_s/{name}"] = time.perf_counter() - t


def step_metrics(run, step, out, batch, *, update, entropy, t_step, phases, scores=None, rule_scores=None,
                 rewards=None) -> dict:
    """Step 7: what one step logs beyond its parts' own metrics, under verl's names, every value reduced
    over all ranks. `update` holds the per-mini-batch lists of the updates; `entropy` the [N, R]
    entropy of π_old; `phases` the step's own metrics (its timing_s/*); scores, rule_scores and rewards are
    absent for DPO (no score)."""
    d, W, rmask = run.cfg.data, run.world, out.response_mask
    n, R = run.cfg.actor_rollout_ref.rollout.n, run.cfg.actor_rollout_ref.rollout.response_length
    m = {k: sum(v) / len(v) for k, v in update.items() if v}
    m["actor/nan_skipped"] = sum(update.get("actor/nan_skipped", [])) + sum(update.get("critic/nan_skipped", []))
    m["actor/entropy"] = dist.global_stats(entropy, rmask)[0]
    m["actor/lr"] = run.actor_sched.get_last_lr()[0]
    m["rollout/bypass"] = float(run.bypass)
    if scores is not None:
        add_stats(m, "critic/score", scores)
        m["critic/score/var"] = global_var(scores)
        if run.rm is not None:  # the rule's verdict on the same responses: the RM's score is only a proxy
            add_stats(m, "critic/rule_score", rule_scores)
        add_stats(m, "critic/rewards", rewards.sum(-1))
        add_stats(m, "critic/advantages", batch["advantages"], rmask)
        add_stats(m, "critic/returns", batch["returns"], rmask)
    if batch.get("values") is not None:
        add_stats(m, "critic/values", batch["values"], rmask)
        m["critic/vf_explained_var"] = explained_variance(batch["values"], batch["returns"], rmask)
    add_stats(m, "response_length", rmask.sum(-1).float())
    add_stats(m, "response_repetition", repetition(out.responses, rmask))
    m["response_length/clip_ratio"] = dist.global_stats((rmask.sum(-1) == R).float())[0]
    add_stats(m, "prompt_length", out.attention_mask[::n, :out.prompt_length].sum(-1).float())
    tokens = dist.all_reduce(out.attention_mask.sum().float()).item()
    m["timing_s/step"] = time.perf_counter() - t_step
    m.update({"perf/total_num_tokens": tokens, "perf/throughput": tokens / m["timing_s/step"] / W,
              "training/epoch": step // steps_per_epoch(len(run.train), d.gen_batch_size)})
    # verl's that nanokl logged without, after the others (the older keys keep their order); `tokens` counts
    # prompt + response tokens (the attention mask covers both)
    m.update(verl_data_metrics(out.attention_mask, rmask, out.prompt_length, d.max_prompt_length))
    m["perf/time_per_step"] = m["timing_s/step"]
    m.update(timing_per_token({**phases, **m}, {"gen": dist.all_reduce(rmask.sum().float()).item(), "all": tokens}))
    m.update(verl_dashboard_metrics(run, rmask, R))  # added last: every older key keeps its place in the row
    return m


def verl_dashboard_metrics(run, response_mask, max_response_length) -> dict:
    """What verl's dashboards plot that nanokl logged without; reads counters only (no RNG, no computation of
    the step changes):
    - critic/lr: the critic optimizer's learning rate after the step's scheduler step (actor/lr likewise, above);
    - perf/max_memory_allocated_gb, perf/max_memory_reserved_gb: torch.cuda.max_memory_* / 1024**3, the peak
      since the process started (verl does not reset it either); 0.0 on CPU, as verl logs there. Each is the
      mean over ranks, as verl's reduce_metrics averages its workers' values;
    - perf/cpu_memory_used_gb: the machine's used memory, verl's psutil.virtual_memory().used without psutil:
      psutil's own Linux formula on /proc/meminfo (MemTotal - MemFree - Buffers - Cached - SReclaimable);
      0.0 where /proc/meminfo is absent. Mean over ranks;
    - response_length_non_aborted/mean|max|min|clip_ratio: verl's response-length stats over the responses
      that were not aborted, i.e. of at least one token (verl: response_length == 0 is aborted,
      response/aborted_ratio). nanokl's rollout never aborts a response (each ends in EOS or at the length
      limit), so they equal response_length/* unless a response is empty."""
    m = {}
    if run.critic_sched is not None:
        m["critic/lr"] = run.critic_sched.get_last_lr()[0]
    cuda = run.device.type == "cuda"
    gb = [torch.cuda.max_memory_allocated(run.device) / 1024 ** 3 if cuda else 0.0,
          torch.cuda.max_memory_reserved(run.device) / 1024 ** 3 if cuda else 0.0, cpu_memory_used_gb()]
    gb = dist.all_reduce(torch.tensor(gb, dtype=torch.float64)) / run.world
    m.update(zip(("perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb", "perf/cpu_memory_used_gb"),
                 gb.tolist()))
    lengths = response_mask.sum(-1).float()
    kept = lengths > 0
    add_stats(m, "response_length_non_aborted", lengths, kept)
    if "response_length_non_aborted/mean" in m:
        m["response_length_non_aborted/clip_ratio"] = dist.global_stats((lengths == max_response_length).float(),
                                                                        kept)[0]
    return m


def cpu_memory_used_gb() -> float:
    """psutil.virtual_memory().used / 1024**3 on Linux, from /proc/meminfo (0.0 where it is absent)."""
    try:
        with open("/proc/meminfo") as f:
            kb = {line.split(":")[0]: int(line.split()[1]) for line in f if len(line.split()) >= 2}
        used = kb["MemTotal"] - kb["MemFree"] - sum(kb.get(k, 0) for k in ("Buffers", "Cached", "SReclaimable"))
        return (used if used >= 0 else kb["MemTotal"] - kb["MemFree"]) * 1024 / 1024 ** 3
    except (OSError, ValueError, KeyError, IndexError):
        return 0.0


def verl_data_metrics(attention_mask, response_mask, prompt_width, max_prompt_length) -> dict:
    """verl's compute_data_metrics entries nanokl lacked, over all ranks' responses: prompt_length/clip_ratio,
    the share of prompts of exactly data.max_prompt_length tokens (verl pads every prompt to that width and
    compares with it), and response/aborted_ratio, the share of responses of no token at all."""
    prompts = attention_mask[:, :prompt_width].sum(-1)
    return {"prompt_length/clip_ratio": dist.global_stats((prompts == max_prompt_length).float())[0],
            "response/aborted_ratio": dist.global_stats((response_mask.sum(-1) == 0).float())[0]}


PER_TOKEN = ("gen", "ref", "values", "adv", "update_critic", "update_actor")  # verl's, in its order


def timing_per_token(metrics, tokens) -> dict:
    """verl's timing_per_token_ms/<phase>: the phase's seconds x 1000 per token, response tokens for gen,
    prompt + response tokens for the others; for the phases the step timed."""
    return {f"timing_per_token_ms/{k}": metrics[f"timing_s/{k}"] * 1000 / tokens["gen" if k == "gen" else "all"]
            for k in PER_TOKEN if f"timing_s/{k}" in metrics and tokens["gen" if k == "gen" else "all"] > 0}

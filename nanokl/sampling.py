"""Dynamic sampling (DAPO): train only on prompts whose responses disagree, and sample until
enough.

Why
---
A group baseline (GRPO, RLOO: nanokl/advantages.py) scores each response against the other
responses to its prompt. When all of them score the same (all right, or all wrong) every advantage
is 0: the prompt costs a generation and a forward-backward and moves nothing, and the batch's
gradient comes from fewer prompts than it claims. Training makes it worse, as more prompts become
always right. DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale", arXiv:2503.14476, §3.2) drops those groups and samples more prompts until the batch is
full.

The rule (verl's DAPO trainer, `algorithm.filter_groups`: enable, metric, max_num_gen_batches)
-----------------------------------------------------------------------------------------------
Each response has one number, `metric`: "acc" (the rule's score, before any shaping),
"seq_reward" (Σ_t token_level_scores) or "seq_final_reward" (Σ_t token_level_rewards, after the
KL penalty, which almost never ties). A group g (the responses sharing a prompt id) is kept iff

    |g| = 1   or   std_g(metric) > 0,

read here exactly: not all equal (max > min). A group holding a NaN or ±inf has no std and is
dropped (verl's np.std gives NaN there, and NaN > 0 is false).

Rounds. Generate a batch of prompts (verl: `data.gen_batch_size`, by default the train batch),
score it, keep its kept groups and append them to those of earlier rounds. Once the kept prompts
reach the target (`data.train_batch_size`), the batch is the first `target` of them in generation
order; the surplus is discarded. Otherwise sample another round, unless `max_num_gen_batches` > 0
rounds have been made: then stop with an error (the data are too easy or too hard for this
batch). With a fraction p of the groups kept a step costs about 1/p rounds of generation.
`kept_groups` is the rule, `GroupBuffer` the rounds; the trainer calls them in place of its one
round of sampling.
"""

import torch


def kept_groups(scores, index):
    """(keep, n_prompts): a bool [N] tensor marking the responses of the kept groups, and how many
    groups (prompts) that is. scores: one number per response; index: one hashable prompt id per
    response (a list, numpy array or tensor), equal ids forming a group."""
    # the rule runs on the host
    values = torch.as_tensor(scores, dtype=torch.float64).reshape(-1).tolist()
    keys = index.tolist() if hasattr(index, "tolist") else list(index)
    if len(keys) != len(values):
        raise ValueError(f"index has {len(keys)} ids for {len(values)} scores")
    groups = {}
    for key, v in zip(keys, values):
        groups.setdefault(key, []).append(v)
    # max > min is False for a group holding a NaN, and inf − inf has no spread either: drop both
    kept = {k for k, g in groups.items()
            if len(g) == 1 or (all(abs(v) < float("inf") for v in g) and max(g) > min(g))}
    return torch.tensor([k in kept for k in keys], dtype=torch.bool), len(kept)


def take_rows(x, rows):
    """x[rows] for a tensor (rows along dim 0) or a list/tuple (one entry a response)."""
    if isinstance(x, torch.Tensor):
        return x[rows.to(x.device)]
    return [x[i] for i in rows.tolist()]


def cat_rows(parts):
    """Concatenate take_rows results of several rounds."""
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    return [v for p in parts for v in p]


class GroupBuffer:
    """The rounds of dynamic sampling: `add` each round's responses (a dict of per-response tensors
    or lists) with their metric and prompt ids until it returns True, then `take` the batch.

    target: prompts per batch (data.train_batch_size, or this rank's share of it);
    max_num_gen_batches: rounds allowed, <= 0 for no limit (verl's convention)."""

    def __init__(self, target, max_num_gen_batches=0):
        if target < 1:
            raise ValueError(f"the target batch needs at least one prompt, got {target}")
        self.target, self.max_num_gen_batches = target, max_num_gen_batches
        self.num_gen_batches, self.num_prompts = 0, 0
        self._parts, self._groups = [], []

    def add(self, responses, scores, index):
        """Keep this round's kept groups. True once `target` prompts are kept; raises when the
        round limit is reached short of it."""
        keep, n = kept_groups(scores, index)
        rows = keep.nonzero().squeeze(-1)
        self._parts.append({k: take_rows(v, rows) for k, v in responses.items()})
        keys = index.tolist() if hasattr(index, "tolist") else list(index)
        ordinal = {}  # each kept group's number, counting on from the earlier rounds' groups
        self._groups.append(torch.tensor(
            [self.num_prompts + ordinal.setdefault(keys[i], len(ordinal)) for i in rows.tolist()],
            dtype=torch.long))
        self.num_gen_batches += 1
        self.num_prompts += n
        if self.num_prompts >= self.target:
            return True
        if 0 < self.max_num_gen_batches <= self.num_gen_batches:
            raise RuntimeError(f"dynamic sampling kept {self.num_prompts} of {self.target} "
                               f"prompts in {self.num_gen_batches} rounds "
                               f"(algorithm.filter_groups.max_num_gen_batches="
                               f"{self.max_num_gen_batches}): the data may be too hard or too "
                               f"easy; 0 means no limit")
        return False

    def take(self, cat=None):
        """(responses, index): the responses of the first `target` kept prompts in generation
        order, and each one's prompt number 0..target−1 (the index the advantages group by).
        cat(key, parts) joins one entry's per-round parts (default `cat_rows`); pass one that pads
        when rounds differ in width (a rollout trims its padding per round)."""
        if self.num_prompts < self.target:
            raise RuntimeError(f"only {self.num_prompts} of {self.target} prompts kept so far")
        # whole groups; the surplus goes
        rows = [(g < self.target).nonzero().squeeze(-1) for g in self._groups]
        join = cat or (lambda key, parts: cat_rows(parts))
        out = {k: join(k, [take_rows(p[k], r) for p, r in zip(self._parts, rows)])
               for k in self._parts[0]}
        return out, torch.cat([g[r] for g, r in zip(self._groups, rows)])

"""Micro-batches under a token budget, and sequence packing (padding removal).

The idea
--------
Responses differ in length, so a fixed number of responses per micro-batch is either wasteful
(short ones) or out of memory (long ones). verl's `use_dynamic_bsz` instead gives each GPU a
*token* budget (`ppo_max_token_len_per_gpu`) and cuts a mini-batch into as few micro-batches as
fit it. Which sequences go together is a multiway number-partitioning problem: balance the token
sums of k bins. verl solves it with Karmarkar-Karp; nanokl uses the simpler LPT rule (Graham
1969: longest first, each into the currently lightest bin), whose largest bin is at most 4/3 of
the optimum. k starts at ceil(total / budget) and grows until every bin fits; a sequence longer
than the budget on its own gets a micro-batch to itself, with a warning. Under data parallelism
every rank must run the same number of micro-batches (DDP and FSDP synchronise on each
backward), so the count is the maximum over ranks (`min_count`). Which micro-batch a sequence
lands in does not change the gradient: every micro-batch's loss is aggregated with the whole
mini-batch's denominator (nanokl/workers.py), so the sum over micro-batches is the mini-batch loss.

Packing (verl's `use_remove_padding`). A padded micro-batch [n, P+R] spends compute on pad
tokens. Packing concatenates the *real* tokens of its sequences into one row, numbers them
1, 2, 3, ... in the attention mask and restarts position ids at 0 for each, so that RoPE sees the
same positions as in the padded layout and attention never crosses from one sequence into
another (nanokl/model.py builds the block-diagonal causal mask). The logits of the positions
that predict response tokens are gathered by `index` (`logits_to_keep` as an index tensor for
the LM head, a plain gather for the critic's values), which puts them back in [n, R]. Kernel: the
block-diagonal mask is never built (at verl's budgets of 16,384 tokens a row, an L^2 mask and the
fp32 scores a masked kernel falls back to would take tens of GiB). The sequence ids give the
cumulative lengths cu_seqlens = [0, l_1, l_1 + l_2, ...], and a varlen kernel attends within each
sequence: PyTorch's `varlen_attn` or flash-attention's `flash_attn_varlen_func` on GPU (verl's
choice), a FlexAttention document mask otherwise, and one causal SDPA per sequence on CPU
(nanokl/attention.py).

tests/test_batching.py checks that no micro-batch exceeds the budget unless it holds one
over-long sequence, that the partition is balanced, and that packed log-probs and values equal
the padded ones (<= 1e-5 fp32).
"""

import dataclasses
import math
import warnings

import torch


def balanced_partition(lengths, k):
    """LPT: indices into k bins, longest first, each into the currently lightest bin."""
    bins, loads = [[] for _ in range(k)], [0] * k
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        j = min(range(k), key=loads.__getitem__)
        bins[j].append(i)
        loads[j] += lengths[i]
    return [sorted(b) for b in bins]


def token_budget_micro_batches(lengths, budget, min_count=1):
    """The fewest (>= min_count) balanced micro-batches whose token sums fit `budget`."""
    lengths = [int(n) for n in lengths]
    k = max(min_count, math.ceil(sum(lengths) / budget), 1)
    while True:
        bins = balanced_partition(lengths, min(k, len(lengths)) if lengths else 1)
        if all(sum(lengths[i] for i in b) <= budget or len(b) == 1 for b in bins):
            break
        k += 1
    for b in bins:
        if len(b) == 1 and lengths[b[0]] > budget:
            warnings.warn(f"a sequence of {lengths[b[0]]} tokens exceeds the micro-batch budget of "
                          f"{budget} tokens (ppo_max_token_len_per_gpu); it runs alone")
    while len(bins) < k:  # a rank with fewer sequences than the agreed count runs empty micro-batches
        bins.append([])
    return bins


def sequence_lengths(batch, packed):
    """Tokens a sequence costs in a forward: its real tokens when packed, its padded row if not."""
    mask = batch["attention_mask"]
    return (mask.sum(-1) if packed else torch.full((len(mask),), mask.shape[1])).tolist()


def pack(mb):
    """One packed row of the real tokens of micro-batch `mb` (the padded [n, P+R] layout).

    Returns the model inputs (input_ids, attention_mask with sequence ids, position_ids, each
    [1, L]) and `index` [n, R]: the packed position whose output predicts each response token
    (0 where the response is padding: those entries are garbage that the response mask hides)."""
    mask = mb["attention_mask"]
    n, T = mask.shape
    R = mb["responses"].shape[1]
    P = T - R
    real = mask > 0
    lengths = real.sum(-1)
    starts = torch.cumsum(lengths, 0) - lengths
    ids = mb["sequences"][real][None]
    doc = torch.repeat_interleave(torch.arange(1, n + 1, device=mask.device), lengths)[None]
    pos = (torch.arange(ids.shape[1], device=mask.device) - torch.repeat_interleave(starts, lengths))[None]
    prompt_len = real[:, :P].sum(-1)
    index = starts[:, None] + prompt_len[:, None] + torch.arange(R, device=mask.device)[None] - 1
    index = index * mb["response_mask"]
    return ids, doc, pos, index


@dataclasses.dataclass
class Batching:
    """How a batch is cut into micro-batches: a fixed count of responses, or a token budget
    (`use_dynamic_bsz`), and whether each micro-batch is packed (`use_remove_padding`)."""
    micro_size: int | None = None  # responses per micro-batch; None: the whole batch at once
    token_budget: int | None = None  # tokens per micro-batch instead (dynamic batch size)
    packed: bool = False  # concatenate real tokens into one row, no padding


def split(batch, spec: Batching, agree=max):
    """Row indices of each micro-batch. With a token budget, `agree` turns this rank's count into
    the count every rank uses (the max over ranks, so that all run the same number)."""
    n = len(batch["responses"])
    if spec.token_budget is None:
        size = spec.micro_size or n
        return [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    lengths = sequence_lengths(batch, spec.packed)
    with warnings.catch_warnings():  # the count first; warn once, below, for the final split
        warnings.simplefilter("ignore")
        count = len(token_budget_micro_batches(lengths, spec.token_budget))
    return token_budget_micro_batches(lengths, spec.token_budget, min_count=int(agree(count)))

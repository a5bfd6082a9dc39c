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
another (nanokl/engine/model.py builds the block-diagonal causal mask). The logits of the positions
that predict response tokens are gathered by `index` (`logits_to_keep` as an index tensor for
the LM head, a plain gather for the critic's values), which puts them back in [n, R]. Kernel: the
block-diagonal mask is never built (at verl's budgets of 16,384 tokens a row, an L^2 mask and the
fp32 scores a masked kernel falls back to would take tens of GiB). The sequence ids give the
cumulative lengths cu_seqlens = [0, l_1, l_1 + l_2, ...], and a varlen kernel attends within each
sequence: PyTorch's `varlen_attn` or flash-attention's `flash_attn_varlen_func` on GPU (verl's
choice), a FlexAttention document mask otherwise, and one causal SDPA per sequence on CPU
(nanokl/engine/attention.py).

Metadata on the host. Which rows go together, where each real token sits in the packed row, the
position ids, the cumulative lengths and the positions to gather come from the attention mask; on a
GPU, reading it inside the micro-batch loop would stop the host at every micro-batch (a boolean-mask
index, `nonzero`, `repeat_interleave` without its output size all wait for the device). So a pass
reads the mask once (`host_mask`), `micro_batch` computes everything from that CPU copy and `send`s
it in one pinned, non-blocking copy, and the model receives its attention layout ready-made.

tests/test_batching.py checks that no micro-batch exceeds the budget unless it holds one
over-long sequence, that the partition is balanced, and that packed log-probs and values equal
the padded ones (<= 1e-5 fp32).
"""

import dataclasses
import math
import warnings

import torch

from nanokl.engine import attention as A


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


@dataclasses.dataclass
class Batching:
    """How a pass cuts its batch into micro-batches: a fixed count of responses, or a token budget
    (`use_dynamic_bsz`); whether each micro-batch is packed (`use_remove_padding`); and how the LM head
    runs (`chunk`: nanokl/engine/fused.py's chunked log-probs, never the whole [tokens, V] logits)."""
    micro_size: int | None = None  # responses per micro-batch; None: the whole batch at once
    token_budget: int | None = None  # tokens per micro-batch instead (dynamic batch size)
    packed: bool = False  # concatenate real tokens into one row, no padding
    chunk: int | None = None  # tokens per chunk of the LM head's log-probs and entropy; None: whole logits


def host_mask(batch):
    """The attention mask on the host: one device read per pass, before its micro-batch loop. Every
    micro-batch's lengths, packing and attention layout then come from it, with no read inside the loop."""
    return batch["attention_mask"].to("cpu")


def split(mask, spec: Batching, agree=max):
    """Row indices of each micro-batch of the rows of `mask` (a host_mask). With a token budget,
    `agree` turns this rank's count into the count every rank uses (the max over ranks, so that all
    run the same number)."""
    n = len(mask)
    if spec.token_budget is None:
        size = spec.micro_size or n
        return [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    lengths = (mask > 0).sum(-1).tolist() if spec.packed else [mask.shape[1]] * n
    with warnings.catch_warnings():  # the count first; warn once, below, for the final split
        warnings.simplefilter("ignore")
        count = len(token_budget_micro_batches(lengths, spec.token_budget))
    return token_budget_micro_batches(lengths, spec.token_budget, min_count=int(agree(count)))


def take(batch: dict, idx) -> dict:
    """The rows `idx` (a device index) of every [N, ...] tensor of a batch (None stays None)."""
    return {k: None if v is None else v[idx] for k, v in batch.items()}


def send(tensors, device):
    """Host integer tensors to `device` in one copy, as views of their shapes. On CUDA the copy is
    from pinned memory and non-blocking: the host goes on queueing kernels, nothing waits."""
    flat = torch.cat([t.reshape(-1).long() for t in tensors])
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


@dataclasses.dataclass
class ModelInputs:
    """What a training forward passes to the model for one micro-batch."""
    args: tuple  # (input_ids, attention_mask, position_ids): [n, T] padded, or [1, L] packed
    lay: A.Layout  # who attends to whom, built from host lengths (the model reads no mask values)
    keep: object  # logits_to_keep: R + 1 (padded: the last R + 1 positions), or the packed positions [n R]
    rows: torch.Tensor  # the micro-batch's rows of the batch, on the device
    index: torch.Tensor | None = None  # packed: the position predicting each response token [n, R]


def micro_batch(batch, rows, spec: Batching, host):
    """The micro-batch `rows` (host ints) of `batch` and its model inputs, with its packing metadata
    built on the host from `host` (the batch's host_mask) and sent in one copy: no device read.

    Packed: one row of the real tokens (sequence ids 1, 2, 3, ... for the model's attention,
    positions restarting at 0 for each); `index` [n, R] is the packed position whose output predicts
    each response token (0 where the response is padding: garbage that the response mask hides)."""
    device = batch["responses"].device
    m = host[rows]
    n, T = m.shape
    R = batch["responses"].shape[1]
    rows_t = torch.tensor(rows, dtype=torch.long)
    if not spec.packed:
        (rows_d,) = send([rows_t], device)
        mb = take(batch, rows_d)
        lay = A.Layout("causal") if bool((m == 1).all()) else A.Layout("padded", mask=A.padded_mask(mb["attention_mask"]))
        return mb, ModelInputs((mb["sequences"], mb["attention_mask"], mb["position_ids"]), lay, R + 1, rows_d)
    real = m > 0
    lengths = real.sum(-1)
    starts = torch.cumsum(lengths, 0) - lengths
    flat = (torch.arange(n)[:, None] * T + torch.arange(T))[real]  # where each real token sits in [n, T]
    doc = torch.repeat_interleave(torch.arange(1, n + 1), lengths)
    pos = torch.arange(len(flat)) - torch.repeat_interleave(starts, lengths)
    index = starts[:, None] + real[:, :T - R].sum(-1)[:, None] + torch.arange(R)[None] - 1
    docs = lengths.tolist()
    cu = torch.tensor([0] + docs).cumsum(0)
    rows_d, flat_d, doc_d, pos_d, index_d, cu_d = send([rows_t, flat, doc, pos, index, cu], device)
    mb = take(batch, rows_d)
    index_d = index_d * mb["response_mask"]
    seq_ids = doc_d[None]
    # one document is a causal row, as A.layout would find it
    lay = A.Layout("causal") if len(docs) == 1 else A.packed_layout(docs, seq_ids, cu_d.to(torch.int32))
    ids = mb["sequences"].reshape(-1)[flat_d][None]
    return mb, ModelInputs((ids, seq_ids, pos_d[None]), lay, index_d.flatten(), rows_d, index_d)


def agreed_micro_batches(batch, rows, spec: Batching, host, agree=max, skip_empty=False):
    """(micro-batch, its model inputs, whether it is the last) for the rows `rows` (host ints; None: every
    row) of `batch`, cut by `split` into the count that `agree` makes of this rank's (nanokl/engine/dist.py's
    agreed_count: the max over ranks), each built by `micro_batch` from `host` (the batch's host_mask):
    no device read.

    DDP and FSDP synchronise inside every backward, so every rank runs the agreed count; a rank with
    fewer sequences than that count gets empty micro-batches, and each runs a masked-out row instead (the
    first of `rows`, its response_mask zeroed: no loss, no gradient), so its collectives still match.
    `skip_empty` (the no-grad passes) skips them instead."""
    local = host if rows is None else host[rows]
    rows = list(range(len(host))) if rows is None else rows
    groups = split(local, spec, agree)
    for j, part in enumerate(groups):
        if not part and skip_empty:
            continue
        mb, inputs = micro_batch(batch, [rows[i] for i in part] or rows[:1], spec, host)
        if not part:  # a masked-out row: it still runs forward and backward
            mb["response_mask"] = torch.zeros_like(mb["response_mask"])
        yield mb, inputs, j == len(groups) - 1

"""nanokl.engine.batching: token-budget micro-batches and packed sequences.

- Every micro-batch fits the budget unless it holds a single over-long sequence (which then runs
  alone, with a warning); every sequence lands in exactly one micro-batch; the loads are balanced
  as LPT promises (max - min load <= the longest sequence); the agreed count is honoured.
- Packed log-probs and values equal the padded ones (<= 1e-5 fp32).
"""

import random

import pytest
import torch

from nanokl import forwards
from nanokl.engine import model as M
from nanokl.engine.batching import Batching, agreed_micro_batches, balanced_partition, micro_batch, split, \
    token_budget_micro_batches
from nanokl.rollout import generate


@pytest.mark.parametrize("seed", range(5))
def test_budget_respected_and_every_sequence_once(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(5, 60) for _ in range(rng.randint(1, 40))]
    budget = rng.randint(60, 200)
    bins = token_budget_micro_batches(lengths, budget)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert all(load <= budget for load in loads)
    assert max(loads) - min(loads) <= max(lengths)  # LPT's balance guarantee
    # no fewer bins than the budget allows, and not many more
    assert -(-sum(lengths) // budget) <= len(bins) <= -(-sum(lengths) // budget) + 2
    more = token_budget_micro_batches(lengths, budget, min_count=len(bins) + 1)
    assert len(more) == len(bins) + 1 or len(more) == len(lengths)


def test_over_long_sequence_runs_alone_with_a_warning():
    with pytest.warns(UserWarning, match="exceeds the micro-batch budget of 50 tokens"):
        bins = token_budget_micro_batches([10, 80, 20, 15], 50)
    assert [1] in bins
    assert all(sum([10, 80, 20, 15][i] for i in b) <= 50 for b in bins if b != [1])


def test_balanced_partition_by_hand():
    bins = balanced_partition([5, 4, 3, 3, 1], 2)
    # LPT: 5 -> A, 4 -> B, 3 -> B (4<5), 3 -> A (5<7), 1 -> A or B (8 vs 7 -> B)
    assert bins == [[0, 3], [1, 2, 4]]


def tiny(cls, seed=0):
    torch.manual_seed(seed)
    cfg = M.ModelConfig(model_type="llama", vocab_size=41, hidden_size=32, intermediate_size=48,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rope_theta=1e4)
    m = cls(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.2)
    return m.eval()


def test_packed_log_probs_and_values_equal_padded():
    policy, critic = tiny(M.CausalLM), tiny(M.ValueModel, seed=1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 41, (7, 6), generator=g)
    mask = torch.ones_like(ids)
    for b in range(7):
        mask[b, : b % 4] = 0
    out = generate(policy, ids.masked_fill(mask == 0, 0), mask, 9, eos_token_id=[1, 2, 3, 4, 5], pad_token_id=0,
                   generator=g)
    batch = {"sequences": out.sequences, "attention_mask": out.attention_mask, "position_ids": out.position_ids,
             "responses": out.responses, "response_mask": out.response_mask}
    rm = out.response_mask.bool()
    assert not rm.all()  # some responses ended early: padding inside the batch to remove
    padded, ent = forwards.compute_log_probs(policy, batch, 0.8, Batching(), with_entropy=True)
    for spec in (Batching(packed=True), Batching(token_budget=20, packed=True), Batching(micro_size=3, packed=True)):
        packed, ent_p = forwards.compute_log_probs(policy, batch, 0.8, spec, with_entropy=True)
        assert (packed - padded)[rm].abs().max() <= 1e-5
        assert (ent_p - ent)[rm].abs().max() <= 1e-5
    v_pad = forwards.compute_values(critic, batch, Batching())
    v_packed = forwards.compute_values(critic, batch, Batching(token_budget=25, packed=True))
    assert (v_packed - v_pad)[rm].abs().max() <= 1e-5
    # the packed row really holds only real tokens, with positions restarting per sequence
    _, inputs = micro_batch(batch, list(range(7)), Batching(packed=True), batch["attention_mask"])
    ids_p, seq_ids, pos = inputs.args
    assert ids_p.shape[1] == int(out.attention_mask.sum())
    first = torch.cat([torch.tensor([True]), seq_ids[0].diff() != 0])
    assert (pos[0][first] == 0).all() and int(first.sum()) == 7


def test_split_modes():
    batch = {"responses": torch.zeros(10, 4), "attention_mask": torch.ones(10, 12)}
    mask = batch["attention_mask"]
    assert split(mask, Batching(micro_size=4)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert split(mask, Batching()) == [list(range(10))]
    bins = split(mask, Batching(token_budget=36), agree=lambda k: k + 1)  # another rank needs one more
    assert len(bins) == 5 and all(len(b) * 12 <= 36 for b in bins)


def test_agreed_micro_batches_fill_a_short_rank_with_masked_out_rows():
    """Another rank needs more micro-batches than this one has sequences: each extra one is a masked-out
    row (the first of the rows, no response token counted), the last is flagged; a no-grad pass skips them."""
    batch = {"responses": torch.zeros(6, 3, dtype=torch.long), "response_mask": torch.ones(6, 3, dtype=torch.long),
             "attention_mask": torch.ones(6, 8, dtype=torch.long), "sequences": torch.arange(48).view(6, 8),
             "position_ids": torch.arange(8).repeat(6, 1)}
    host, rows, spec = batch["attention_mask"], [4, 1], Batching(token_budget=8)
    got = list(agreed_micro_batches(batch, rows, spec, host, agree=lambda k: 4))
    assert [inputs.rows.tolist() for _, inputs, _ in got] == [[4], [1], [4], [4]]
    assert [int(mb["response_mask"].sum()) for mb, _, _ in got] == [3, 3, 0, 0]
    assert [last for _, _, last in got] == [False, False, False, True]
    kept = list(agreed_micro_batches(batch, rows, spec, host, agree=lambda k: 4, skip_empty=True))
    assert [inputs.rows.tolist() for _, inputs, _ in kept] == [[4], [1]]
    assert [inputs.rows.tolist() for _, inputs, _ in agreed_micro_batches(batch, None, Batching(micro_size=4), host)] \
        == [[0, 1, 2, 3], [4, 5]]

"""nanokl/sampling.py (DAPO's dynamic sampling) against loops written from verl's rule.

- `kept_groups` keeps a group iff it has one response or its metric's population std is > 0,
  the std computed exactly (fractions.Fraction) in a loop; groups holding NaN or ±inf are dropped
  (their std is NaN in verl). Binary accuracies, random floats, ties, string and tensor ids, groups
  that are not contiguous.
- `GroupBuffer` over simulated rounds equals a loop of verl's DAPO trainer: concatenate each round's
  kept responses, count kept prompts, stop at the target and keep the first target·n responses;
  raise after max_num_gen_batches rounds short of it (0: no limit); the index numbers the prompts.
"""

import math
from fractions import Fraction

import pytest
import torch

from nanokl.sampling import GroupBuffer, kept_groups


def reference_keep(scores, index):
    """verl's rule per response: its group has one response, or std > 0 (exactly)."""
    groups = {}
    for k, v in zip(index, scores):
        groups.setdefault(k, []).append(v)
    keep_group = {}
    for k, vals in groups.items():
        if len(vals) == 1:
            keep_group[k] = True
        elif not all(math.isfinite(v) for v in vals):
            keep_group[k] = False  # np.std is NaN, and NaN > 0 is False
        else:
            exact = [Fraction(v) for v in vals]
            mean = sum(exact) / len(exact)
            keep_group[k] = sum((v - mean) ** 2 for v in exact) / len(exact) > 0
    return [keep_group[k] for k in index], sum(keep_group.values())


@pytest.mark.parametrize("seed", range(5))
def test_kept_groups_match_the_exact_std_rule(seed):
    g = torch.Generator().manual_seed(seed)
    P, n = 12, 4
    index = torch.arange(P).repeat_interleave(n)
    acc = (torch.rand(P * n, generator=g) < 0.7).double()  # many all-1 groups, some all-0
    noisy = torch.randn(P * n, generator=g, dtype=torch.float64)
    noisy[:n] = 0.1  # a tied group of floats: dropped
    noisy[n:2 * n] = torch.tensor([0.3, 0.3, 0.3, math.nextafter(0.3, 1)])  # one ulp apart: kept
    for scores in (acc, noisy):
        keep, count = kept_groups(scores, index)
        want, want_count = reference_keep(scores.tolist(), index.tolist())
        assert keep.tolist() == want and count == want_count
    keep, _ = kept_groups(acc, index)
    assert 0 < keep.sum() < P * n  # the draw had groups of both kinds


def test_kept_groups_non_finite_singletons_ids_and_order():
    index = ["a", "b", "a", "c", "b", "d", "d", "e", "e", "f", "f", "g", "h", "h", "h"]  # interleaved ids
    scores = [1.0, 0.0, 0.0, 5.0, 0.0, math.nan, 1.0, math.inf, 1.0, -math.inf, -math.inf, math.nan, 0.1, 0.1, 0.1]
    keep, count = kept_groups(torch.tensor(scores), index)
    want, want_count = reference_keep(scores, index)
    assert keep.tolist() == want and count == want_count
    # a varies; b ties; c is alone (kept, as in verl); d, e, f hold NaN/inf (dropped); g alone, even NaN;
    # h ties (verl's np.std of three 0.1s is 1.4e-17 > 0 and would keep it: rounding, not spread)
    assert [k for k, kept in zip(index, keep.tolist()) if kept] == ["a", "a", "c", "g"]
    assert count == 3
    import numpy as np
    keep_np, _ = kept_groups(np.array(scores), np.array(index))  # numpy ids and scores work too
    assert torch.equal(keep_np, keep)
    with pytest.raises(ValueError, match="ids"):
        kept_groups([1.0, 2.0], ["a"])


def simulate(rounds_acc, n):
    """Rounds of responses: per-response tensors (a global response id, the accuracy, a [N, 2] row)
    and a list; fresh prompt ids per round, as verl's uuids."""
    out, uid = [], 0
    for r, acc in enumerate(rounds_acc):
        N = acc.numel()
        ids = torch.arange(uid, uid + N)
        uid += N
        responses = {"id": ids, "acc": acc, "row": torch.stack([ids, ids * 10], -1).double(),
                     "text": [f"r{r}-{i}" for i in range(N)]}
        index = [f"round{r}-prompt{p}" for p in range(N // n) for _ in range(n)]
        out.append((responses, index))
    return out


def reference_rounds(rounds, target, n, max_num_gen_batches):
    """verl's DAPO loop: keep, concatenate, count; stop at target (first target*n trajectories),
    or raise after max_num_gen_batches rounds (<= 0: no limit). Returns (ids, rounds used)."""
    batch, prompts = [], 0
    for k, (responses, index) in enumerate(rounds, start=1):
        keep, _ = reference_keep(responses["acc"].tolist(), index)
        batch += [i for i, kept in zip(responses["id"].tolist(), keep) if kept]
        prompts += len({p for p, kept in zip(index, keep) if kept})
        if prompts >= target:
            return batch[:target * n], k
        if 0 < max_num_gen_batches <= k:
            return None, k
    raise AssertionError("ran out of simulated rounds")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("target,max_rounds", [(8, 0), (8, 2), (20, 0), (3, 1)])
def test_group_buffer_equals_the_dapo_loop(seed, target, max_rounds):
    n, P = 4, 6
    g = torch.Generator().manual_seed(seed)
    rounds = simulate([(torch.rand(P * n, generator=g) < 0.6).double() for _ in range(40)], n)
    want_ids, want_rounds = reference_rounds(rounds, target, n, max_rounds)
    buf = GroupBuffer(target, max_rounds)
    if want_ids is None:
        with pytest.raises(RuntimeError, match="max_num_gen_batches"):
            for responses, index in rounds:
                buf.add(responses, responses["acc"], index)
        assert buf.num_gen_batches == want_rounds
        return
    for responses, index in rounds:
        if buf.add(responses, responses["acc"], index):
            break
    assert buf.num_gen_batches == want_rounds
    out, index = buf.take()
    assert out["id"].tolist() == want_ids
    assert torch.equal(index, torch.arange(target).repeat_interleave(n))
    ids = out["id"]
    assert torch.equal(out["row"], torch.stack([ids, ids * 10], -1).double())
    by_id = {i: t for responses, _ in rounds for i, t in zip(responses["id"].tolist(), responses["text"])}
    assert out["text"] == [by_id[i] for i in want_ids]
    for p in range(target):  # every kept group's accuracies vary
        assert out["acc"][index == p].unique().numel() > 1


def test_group_buffer_keeps_whole_groups_and_a_padding_cat():
    """Groups that are not contiguous stay whole (the surplus prompt's responses all go); a cat
    that right-pads joins rounds of different widths (a rollout trims its padding per round)."""
    buf = GroupBuffer(target=2)
    assert not buf.add({"resp": torch.tensor([[1, 1], [2, 2], [3, 3]])}, [1.0, 0.5, 1.0], ["x", "y", "x"])
    assert buf.num_prompts == 1 and buf.num_gen_batches == 1  # x tied (dropped), y alone (kept)
    r2 = {"resp": torch.tensor([[4, 4, 4], [5, 5, 5], [6, 6, 6], [7, 7, 7]])}
    assert buf.add(r2, [0.0, 0.0, 1.0, 1.0], ["z", "w", "z", "w"]) is True  # z and w vary: 3 prompts
    pad = lambda key, parts: torch.cat(  # noqa: E731
        [torch.nn.functional.pad(p, (0, max(q.shape[1] for q in parts) - p.shape[1])) for p in parts])
    out, index = buf.take(cat=pad)
    assert out["resp"].tolist() == [[2, 2, 0], [4, 4, 4], [6, 6, 6]]  # y, then z whole; w is the surplus
    assert index.tolist() == [0, 1, 1]


def test_group_buffer_refuses_early_take_and_a_bad_target():
    buf = GroupBuffer(target=3)
    buf.add({"x": torch.zeros(2)}, [1.0, 1.0], [0, 0])  # a tied group: nothing kept
    assert buf.num_prompts == 0
    with pytest.raises(RuntimeError, match="0 of 3"):
        buf.take()
    with pytest.raises(ValueError):
        GroupBuffer(target=0)

"""nanokl/rewards.py against naive float64 loops.

- `token_level_scores` puts each response's score (minus the missing-EOS penalty) on its last real
  token and 0 elsewhere, exactly as a per-row loop does; an empty response carries nothing.
- `apply_kl_penalty` gives r_t = score_t − β·KL_t with KL_t the chosen estimator at each token, 0
  under the mask (NaN/±inf there never leak into the rewards), and the controller's KL is the
  mean over responses of each response's per-token mean: checked in float64 for every estimator.
- `mean_kl` with a `reduce` that adds two shards equals the mean over the whole batch.
- `overlong_penalty` (DAPO) equals a float64 loop of verl's min(−(L − (L_max − len))/len · factor, 0)
  at every length from 0 past the limit: 0 before the buffer, linear inside it, −factor at L_max.
"""

import math

import pytest
import torch

from nanokl.kl import KL_KINDS
from nanokl.rewards import apply_kl_penalty, mean_kl, overlong_penalty, token_level_scores
from test_kl import naive_value  # each estimator written out in float64


def naive_token_level_scores(scores, mask, missing_eos, penalty):
    out = [[0.0] * len(mask[0]) for _ in mask]
    for i in range(len(mask)):
        length = sum(mask[i])
        if length == 0:
            continue  # an empty response has no token to carry its score
        s = scores[i]
        if missing_eos is not None and missing_eos[i]:
            s -= penalty
        out[i][length - 1] = s
    return torch.tensor(out)


def test_token_level_scores_matches_a_loop():
    R = 7
    lengths = [3, 0, 7, 1, 5, 7]
    mask = torch.tensor([[1] * n + [0] * (R - n) for n in lengths])
    scores = [1.0, 0.7, -0.25, 0.0, 2.0, 1.0]
    missing = [False, True, True, False, False, True]
    for miss, penalty in [(None, 0.0), (missing, 0.5), (missing, 0.0)]:
        got = token_level_scores(torch.tensor(scores), mask, None if miss is None else torch.tensor(miss), penalty)
        want = naive_token_level_scores(scores, mask.tolist(), miss, penalty)
        assert got.shape == (6, R) and got.dtype == torch.float32
        assert torch.equal(got, want)
    got = token_level_scores(scores, mask.bool(), missing, 0.5)  # lists and a bool mask work too
    assert torch.equal(got, naive_token_level_scores(scores, mask.tolist(), missing, 0.5))
    assert got[2, 6] == -0.75 and got[1].eq(0).all()  # penalised full-length row; empty row stays 0


SAMPLED = [k for k in KL_KINDS if k != "full"]


@pytest.mark.parametrize("kind", SAMPLED)
def test_apply_kl_penalty_matches_a_float64_loop(kind):
    g = torch.Generator().manual_seed(3)
    N, R, beta = 5, 6, 0.3
    lengths = [6, 3, 0, 1, 4]
    mask = torch.tensor([[1] * n + [0] * (R - n) for n in lengths])
    old = -torch.rand(N, R, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(N, R, generator=g, dtype=torch.float64) * 3
    old[mask == 0] = float("nan")  # whatever lies under the mask never reaches a reward
    ref[1, 5] = float("inf")
    scores = token_level_scores(torch.tensor([1.0, -0.5, 2.0, 0.25, 0.0]), mask).double()
    rewards, kl, current = apply_kl_penalty(scores, old, ref, mask, beta, kind)
    want_r, want_kl, per_response = [], [], []
    for i in range(N):
        row_r, row_kl = [], []
        for t in range(R):
            k = naive_value(old[i, t].item(), ref[i, t].item(), kind) if mask[i, t] else 0.0
            row_kl.append(k)
            row_r.append(scores[i, t].item() - beta * k)
        want_r.append(row_r)
        want_kl.append(row_kl)
        per_response.append(sum(row_kl) / lengths[i] if lengths[i] else 0.0)
    torch.testing.assert_close(kl, torch.tensor(want_kl, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rewards, torch.tensor(want_r, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert current == pytest.approx(sum(per_response) / N, rel=1e-6)  # the mean is taken in float32
    assert torch.isfinite(rewards).all()


def test_exact_penalty_takes_the_given_kl_and_a_reduce_adds_shards():
    g = torch.Generator().manual_seed(5)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    kl = torch.rand(4, 3, generator=g)
    kl[0, 2] = float("nan")
    scores = torch.zeros(4, 3)
    rewards, kl0, current = apply_kl_penalty(scores, None, None, mask, 2.0, "full", kl=kl)
    assert torch.equal(rewards, -2.0 * kl0) and kl0[0, 2] == 0 and kl0[3].eq(0).all()
    naive = [(kl[0, 0] + kl[0, 1]).item() / 2, kl[1, 0].item(), kl[2].sum().item() / 3, 0.0]
    assert current == pytest.approx(sum(naive) / 4, rel=1e-6)
    # two ranks: a reduce that adds the other rank's sums gives the mean over both ranks' responses
    other, omask = torch.rand(2, 3, generator=g), torch.tensor([[1, 1, 1], [1, 0, 0]])
    sent = []
    mean_kl(other, omask, reduce=lambda s: sent.append(s) or s)  # what the other rank contributes
    both = mean_kl(kl0, mask, reduce=lambda s: s + sent[0])
    assert both == pytest.approx((sum(naive) + other[0].sum().item() / 3 + other[1, 0].item()) / 6, rel=1e-6)
    assert math.isnan(mean_kl(torch.zeros(0, 3), torch.zeros(0, 3)))


@pytest.mark.parametrize("max_len,buffer_len,factor", [(20, 8, 1.0), (16, 16, 0.5), (4096, 512, 1.0), (10, 3, 2.5)])
def test_overlong_penalty_matches_a_float64_loop(max_len, buffer_len, factor):
    lengths = list(range(0, max_len + 3))  # from an empty response to past the limit
    got = overlong_penalty(torch.tensor(lengths), max_len, buffer_len, factor)
    assert got.dtype == torch.float64 and got.shape == (len(lengths),)
    for L, p in zip(lengths, got.tolist()):
        exceed = L - (max_len - buffer_len)
        assert p == min(-exceed / buffer_len * factor, 0)  # the same float64 operations, in order
        if L <= max_len - buffer_len:
            assert p == 0.0
        else:  # strictly negative inside the buffer, linear in L
            assert p == pytest.approx(-factor * (L - max_len + buffer_len) / buffer_len, rel=1e-15)
    assert got[max_len].item() == pytest.approx(-factor, rel=1e-15)
    assert torch.equal(overlong_penalty(lengths, max_len, buffer_len, factor), got)  # a list works too


@pytest.mark.parametrize("buffer_len", [0, -1, 21])
def test_overlong_penalty_refuses_a_buffer_outside_the_length(buffer_len):
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        overlong_penalty([5], 20, buffer_len, 1.0)

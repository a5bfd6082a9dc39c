"""Step metrics (nanokl/harness/metrics.py) against numpy, at world size 1 (tests/test_dist.py covers W=2)."""

import numpy as np
import pytest
import torch

from nanokl.harness.metrics import add_stats, explained_variance, global_var


def test_stats_and_variance_equal_numpy():
    x = torch.randn(6, 9) * 3 + 1
    mask = (torch.rand(6, 9) > 0.3).float()
    sel = x.numpy()[mask.numpy() > 0].astype(np.float64)
    m = {}
    add_stats(m, "v", x, mask)
    assert m["v/mean"] == pytest.approx(sel.mean(), rel=1e-6)
    assert m["v/max"] == pytest.approx(sel.max()) and m["v/min"] == pytest.approx(sel.min())
    assert global_var(x, mask) == pytest.approx(sel.var(), rel=1e-6)  # population variance (ddof 0)
    assert global_var(x[:, 0]) == pytest.approx(x[:, 0].double().numpy().var(), rel=1e-6)


def test_explained_variance_equals_numpy_definition():
    ret = torch.randn(5, 7)
    val = ret + 0.5 * torch.randn(5, 7)
    mask = (torch.rand(5, 7) > 0.2).float()
    r, v = ret.numpy()[mask.numpy() > 0].astype(np.float64), val.numpy()[mask.numpy() > 0].astype(np.float64)
    want = 1 - np.var(r - v, ddof=1) / np.var(r, ddof=1)
    assert explained_variance(val, ret, mask) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("pad_value", [1e6, float("nan")])
def test_explained_variance_ignores_padding_and_is_one_for_a_perfect_critic(pad_value):
    returns = torch.randn(4, 8, dtype=torch.float64) * 2
    values = returns + torch.randn(4, 8, dtype=torch.float64) * 0.7
    mask = torch.ones(4, 8, dtype=torch.float64)
    mask[2, 5:] = 0.0
    values[2, 5:] = pad_value  # padding must not count
    ev = explained_variance(values, returns, mask)
    r, v = returns.numpy()[mask.numpy() > 0], values.numpy()[mask.numpy() > 0]
    assert isinstance(ev, float)
    assert ev == pytest.approx(1 - np.var(r - v) / np.var(r), rel=1e-6)
    assert explained_variance(returns, returns, mask) == 1.0

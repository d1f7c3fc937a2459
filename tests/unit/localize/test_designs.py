"""Knockout designs: sizes, balance, prefix stability, adaptive focus."""

from __future__ import annotations

import numpy as np
import pytest

from capsense.localize.designs import adaptive_round, balanced_design, bernoulli_design, heads_per_mask
from capsense.errors import CapsenseError


def test_balanced_design_is_balanced_and_prefix_stable():
    X = balanced_design(40, 100, 7, seed=3)
    assert (X.sum(1) == 7).all()
    counts = X.sum(0)
    assert counts.max() - counts.min() <= 1  # least-used first
    np.testing.assert_array_equal(balanced_design(25, 100, 7, seed=3), X[:25])
    assert not np.array_equal(balanced_design(40, 100, 7, seed=4), X)


def test_bernoulli_design_rate_nonempty_and_prefix_stable():
    X = bernoulli_design(400, 200, 0.05, seed=1)
    assert X.any(1).all()
    assert abs(X.mean() - 0.05) < 0.01
    np.testing.assert_array_equal(bernoulli_design(100, 200, 0.05, seed=1), X[:100])


def test_adaptive_round_focuses_on_candidates():
    n, k = 200, 4
    first = adaptive_round(0, 20, n, k, 0, np.zeros((0, n), bool), None, None)
    assert (first.sum(1) == k).all()
    importance = np.zeros(n)
    importance[[5, 17, 42]] = [3.0, 2.0, 1.0]
    later = adaptive_round(1, 20, n, k, 0, first, importance, np.zeros(n))
    focus_share = later[:, [5, 17, 42]].sum() / later.sum()
    assert focus_share > 3 * (3 / n)  # candidates knocked out far more often than at random
    assert later[10:].sum(0).max() - later[10:].sum(0).min() <= 2  # the other half stays balanced


@pytest.mark.parametrize("kwargs, message", [
    (dict(sparsity=0.0), "`sparsity` must be in (0, 1)"),
    (dict(sparsity=1.0), "`sparsity` must be in (0, 1)"),
    (dict(k=300), "between 1 and 270"),
])
def test_heads_per_mask_rejects_bad_values(kwargs, message):
    with pytest.raises(CapsenseError, match=message.replace("(", r"\(").replace(")", r"\)")):
        heads_per_mask(270, **kwargs)


def test_heads_per_mask_from_sparsity():
    assert heads_per_mask(270, 0.02) == 5
    assert heads_per_mask(10, 0.01) == 1

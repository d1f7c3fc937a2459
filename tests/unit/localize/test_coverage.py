"""The false-negative report (capsense.localize.coverage): bounds from the knockouts a run made."""

from __future__ import annotations

import numpy as np
import pytest

from capsense.localize.coverage import coverage


def test_bound_is_the_smallest_mask_containing_the_head():
    masks = [(0,), (1,), (2, 3, 4, 5), (2, 3), (6, 7)]
    damage = [0.9, 0.5, 0.6, 0.05, 0.3]
    cov = coverage(masks, damage, n=10, k=2, estimate=np.arange(10) / 10)
    assert cov.measured == [0, 1] and cov.kth_single == pytest.approx(0.5)
    assert cov.bound == {2: 0.05, 3: 0.05, 4: 0.6, 5: 0.6, 6: 0.3, 7: 0.3}
    assert cov.uncovered == [8, 9]  # in no mask: no bound
    assert cov.possible_misses() == [4, 5]  # bound 0.6 >= the 2nd single's 0.5; 6 and 7 are ruled out
    d = cov.as_dict(lambda h: f"h{h}")
    assert d["n_possible_misses"] == 2 and d["largest_bound"] == {"head": "h4", "bound": 0.6}
    assert d["uncovered"] == ["h8", "h9"] and d["largest_estimates_not_measured"][0] == {"head": "h9", "estimate": 0.9}
    text = cov.summary(lambda h: f"h{h}")
    assert "8 of 10 heads not measured alone" in text and "2 of 6 bounded head(s) not ruled out" in text
    assert "2 head(s) in no measured mask: nothing bounds them, none is ruled out" in text


def test_heads_without_a_bound_are_not_reported_as_ruled_out():
    # every FE spent on singles: no group knockout, so no unmeasured head has a bound
    cov = coverage([(0,), (1,), (2,)], [0.9, 0.5, 0.1], n=6, k=2)
    text = cov.summary(str)
    assert cov.bound == {} and cov.uncovered == [3, 4, 5]
    assert "not ruled out of the top K" not in text and "3 head(s) in no measured mask" in text
    assert "none is ruled out" in text


def test_every_head_measured():
    cov = coverage([(h,) for h in range(4)], [0.1, 0.2, 0.3, 0.4], n=4, k=2)
    assert cov.not_measured == 0 and cov.summary(str) == "every head was measured alone"
    assert cov.possible_misses() == []


def test_a_helper_measured_alone_is_added_back_to_the_bound():
    # head 1 helps the target (-0.2 alone): the group {1, 2, 3} at +0.1 can hide up to +0.3 in heads 2 and 3
    cov = coverage([(0,), (1,), (1, 2, 3), (4, 5)], [0.5, -0.2, 0.1, 0.25], n=6, k=1)
    assert cov.bound == {2: pytest.approx(0.3), 3: pytest.approx(0.3), 4: 0.25, 5: 0.25}
    assert cov.possible_misses() == []  # 0.3 < the top single's 0.5


def test_additivity_is_checked_where_a_mask_and_both_halves_were_measured():
    masks = [(0,), (1, 2, 3, 4), (1, 2), (3, 4), (5, 6), (5,)]
    damage = [0.9, 0.2, 0.3, 0.2, 0.4, 0.1]
    cov = coverage(masks, damage, n=8, k=1)
    assert sorted(cov.additivity) == [(pytest.approx(0.2), pytest.approx(0.5))]  # (5, 6) has one half only
    assert cov.worst_ratio == pytest.approx(2.5)
    assert "summed to 2.50x the mask (1 check(s))" in cov.summary(str)
    assert cov.as_dict(str)["additivity"] == {"checks": 1, "worst_ratio": 2.5}
    assert coverage([(0, 1), (0,), (1,)], [1.0, 0.4, 0.5], n=2, k=1).worst_ratio == pytest.approx(0.9)

"""recipes/bench/replay_prior.py: prior-guided replayed on a sweep (singles exact, groups additive)."""

from __future__ import annotations

import numpy as np

from capsense.localize.prior import PriorSettings

from conftest import load_bench_script


def _case():
    bench = load_bench_script("bench_locate_recovery")
    lay = bench.Layout(4, 4)  # 16 heads, 4 layers
    eff = np.zeros(16)
    eff[[1, 6, 9, 12, 15]] = [2.0, 1.5, 1.2, 1.0, 0.9]
    return bench, lay, eff


def test_a_perfect_estimate_finds_the_top5_with_singles_alone():
    bench, lay, eff = _case()
    res = load_bench_script("replay_prior").replay(eff.copy(), eff, lay, 1.0, PriorSettings(top_m=5, group_size=4), bench.overlap)
    assert res["fe_5of5"] is not None and res["final"] == 5
    # 3 (the attribution, whose forward is the clean one) + the five singles' prefix-reused costs, nothing more
    singles = sum(bench.mask_cost([h], 4, 4, 1.0) for h in (1, 6, 9, 12, 15))
    assert res["fe_5of5"] <= 3 + singles + 1e-9
    assert res["last_change"] <= res["fe_5of5"] and (res["singles_end"] is None or res["singles_end"] >= res["fe_5of5"])
    # the accounting before round 10: a separate clean forward, 1 FE more to everything
    old = load_bench_script("replay_prior").replay(eff.copy(), eff, lay, 1.0, PriorSettings(top_m=5, group_size=4), bench.overlap, 0.0)
    assert old["fe_5of5"] == round(res["fe_5of5"] + 1, 2)


def test_a_head_the_estimate_misses_is_found_by_a_group_split_within_the_sweep_cap():
    bench, lay, eff = _case()
    est = eff.copy()
    est[9] = 0.0  # a false negative of attribution: only a group knockout and its splits can find it
    replay = load_bench_script("replay_prior").replay
    res = replay(est, eff, lay, 1.0, PriorSettings(top_m=4, group_size=4), bench.overlap)
    assert res["final"] == 5 and res["fe_4of5"] < res["fe_5of5"]
    assert res["last_change"] > res["singles_end"]  # found after the singles, by a group and its splits
    assert res["budget"] <= bench.sweep_cost(lay, 1.0) + 1e-9 and res["spent"] <= res["budget"] + 1e-9
    # without group knockouts big enough to reach it before the cap, it is never found
    assert replay(np.zeros(16), eff, lay, 1.0, PriorSettings(top_m=0, group_size=4), bench.overlap)["final"] < 5


def test_single_costs_are_each_heads_share_of_layers_run():
    """``--cost-power`` divides the order's score by these: a head in layer l costs (L - l) / L with reuse."""
    bench, lay, _ = _case()
    costs = load_bench_script("replay_prior").single_costs(lay)
    np.testing.assert_allclose(costs, [bench.mask_cost([h], 4, 4, 1.0) for h in range(16)])
    assert costs[0] == 1.0 and costs[-1] == 0.25

"""The collateral screen, and a planted "general" head kept out of the chosen set."""

from __future__ import annotations

import numpy as np
import pytest

from capsense.localize.fit import put_last
from capsense.localize.refine import refine
from capsense.localize.screen import collateral_screen
from capsense.localize.solvers import HeadScores
from capsense.tasks.suite import expand_controls

N = 60
SPECIFIC = (3, 17, 29, 41, 52)  # hurt only the target
GENERAL = 8  # hurts the target most of all, and factual recall (a control of the default suite) too


def _effects(seed: int = 0) -> dict[str, np.ndarray]:
    """Additive relative damage per head and task: small noise everywhere, the planted heads on top."""
    rng = np.random.default_rng(seed)
    eff = {t: rng.normal(0, 0.002, N) for t in ("capsense_induction", "capsense_arithmetic", "capsense_facts")}
    eff["capsense_induction"][list(SPECIFIC)] = [0.30, 0.25, 0.2, 0.18, 0.15]
    eff["capsense_induction"][GENERAL] = 0.6
    eff["capsense_facts"][GENERAL] = 0.25
    return eff


def _choose(controls: list[str], screen_z: float) -> tuple[list[int], set[int]]:
    """What a selective run hands on: ranking by target effect, the screen over the controls, refine."""
    eff = _effects()
    scores = HeadScores(eff["capsense_induction"].copy(), np.ones(N), eff["capsense_induction"].copy())
    tol, k = 0.03, 5
    screen = collateral_screen({c: eff[c] for c in controls}, z=screen_z, floor=tol / k)
    scores = put_last(scores, sorted(screen.excluded))

    def measure(sets):
        return [(float(sum(eff["capsense_induction"][list(s)])), {c: float(sum(eff[c][list(s)])) for c in controls})
                for s in sets]

    found = refine(screen.clean(scores.rank), k, measure, budget=24, tolerance=tol)
    return found.heads, set(screen.excluded)


def test_planted_general_head_is_kept_out_by_the_default_suite():
    # named controls only (arithmetic): the general head's damage to facts is invisible and it is chosen
    named_only, _ = _choose(["capsense_arithmetic"], screen_z=3.0)
    assert GENERAL in named_only
    # the default suite brings capsense_facts in: the screen sets the general head aside, whatever its target effect
    controls = [c for c in expand_controls(["default", "capsense_arithmetic"], "capsense_induction")
                if c in ("capsense_facts", "capsense_arithmetic")]
    assert "capsense_facts" in controls
    chosen, excluded = _choose(controls, screen_z=3.0)
    assert excluded == {GENERAL}
    assert GENERAL not in chosen
    assert sorted(chosen) == sorted(SPECIFIC)


def test_screen_thresholds_follow_each_controls_noise():
    rng = np.random.default_rng(1)
    quiet = rng.normal(0, 0.001, 40)
    loud = rng.normal(0, 0.02, 40)
    quiet[5], loud[5] = 0.02, 0.02  # the same damage: 20 noises on the quiet control, 1 on the loud one
    s = collateral_screen({"quiet": quiet, "loud": loud}, z=3.0, floor=0.0)
    assert s.noise["quiet"] < s.noise["loud"]
    assert s.excluded[5][0] == "quiet"
    assert s.worst[5][1] == pytest.approx(0.02)


def test_screen_floor_and_unmeasured_heads():
    eff = np.full(30, np.nan)  # prior-guided: most heads never measured alone
    eff[:10] = np.linspace(-0.001, 0.001, 10)
    eff[3] = 0.004  # beyond 3 noises of a tiny spread, but under the floor: no collateral damage
    s = collateral_screen({"c": eff}, z=3.0, floor=0.006)
    assert not s.excluded
    assert set(s.worst) == set(range(10))  # unmeasured heads have no worst control
    assert collateral_screen({"c": eff}, z=3.0, floor=0.003).excluded.keys() == {3}
    assert not collateral_screen({"c": eff}, z=0.0, floor=0.0).excluded  # z = 0: the screen is off


def test_put_last_keeps_the_order_of_the_rest():
    imp = np.array([0.5, 0.9, 0.1, 0.7, -2.0])
    s = put_last(HeadScores(imp, np.ones(5), imp.copy()), [1, 3])
    assert list(s.rank) == [0, 2, 4, 1, 3]


def test_noise_from_every_heads_estimate_not_the_biased_sample_measured_alone():
    # measured alone: a few generic heads with huge effects (what an estimate flags) and one
    # head that hurts the control by 0.28; their spread would hide it
    measured = np.full(100, np.nan)
    measured[:6] = [1.3, 0.7, 0.55, 0.4, 0.3, 0.01]
    measured[50] = 0.28
    assert 50 not in collateral_screen({"facts": measured}, z=3.0).excluded
    estimates = np.random.default_rng(0).normal(0, 0.03, 100)  # every head: most do nothing to facts
    s = collateral_screen({"facts": measured}, z=3.0, spread={"facts": estimates})
    assert 50 in s.excluded and s.noise["facts"] < 0.05


def test_refine_draws_only_from_clean_heads_measured_alone():
    from capsense.localize.fit import LocateResult
    from capsense.localize.pool import refine_candidates

    imp = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2])
    effect = np.array([0.9, 0.8, np.nan, 0.6, 0.5, np.nan, 0.3, 0.2])  # 2 and 5 never knocked out alone
    control = np.array([0.0, 0.5, np.nan, 0.0, 0.0, np.nan, 0.0, 0.0])  # 1 hurts the control
    result = LocateResult(HeadScores(imp, np.ones(8), imp.copy()), None, effect, {"c": control}, 9, {}, 0.0)
    result.screen = collateral_screen(result.control_effects, z=3.0, floor=0.01)
    assert refine_candidates(result, 3, "t") == [0, 3, 4, 6, 7]
    assert refine_candidates(result, 6, "t") == [0, 3, 4, 6, 7, 2, 5]  # too few measured: then the unmeasured
    result.estimates = {"t": np.array([0, 0, 0.1, 0, 0, 0.5, 0, 0])}
    assert refine_candidates(result, 6, "t") == [0, 3, 4, 6, 7, 5, 2]  # ... by their estimate


def test_heatmap_leaves_set_aside_heads_grey():
    from capsense.localize.config import LocateConfig
    from capsense.localize.fit import LocateResult
    from capsense.localize.outputs import unpainted

    imp = np.array([0.9, 0.8, 0.7, 0.6])
    effect = np.array([0.9, 0.8, np.nan, 0.6])
    result = LocateResult(HeadScores(imp, np.ones(4), imp.copy()), None, effect, {"c": np.array([0, 0.5, np.nan, 0])}, 5, {}, 0.0)
    result.screen = collateral_screen(result.control_effects, z=3.0, floor=0.01)
    cfg = LocateConfig(model="m", task="t", out="o", controls=["c"])
    assert list(unpainted(cfg, result)) == [False, True, True, False]  # 1 set aside, 2 never measured alone

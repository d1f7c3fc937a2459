"""Measure-and-choose's pool (capsense.localize.pool): more heads measured alone when the search left
too few clean ones to swap in, through the run's own refine step, store and runner."""

from __future__ import annotations

import numpy as np
import pytest

from capsense.core.arch import HeadLayout
from capsense.localize.choice import refine_ranking, screen_step
from capsense.localize.config import LocateConfig
from capsense.localize.evaluator import MaskRunner
from capsense.localize.fit import fit_single_heads
from capsense.localize.methods import no_knockout
from capsense.localize.pool import refine_candidates, single_effects
from capsense.localize.designs import head_set_masks
from capsense.localize.refine import SWAPS_PER_ROUND
from capsense.localize.run import _refine_step
from capsense.localize.store import POOL_ROUND, REFINE_ROUND, RunStore, read_evaluations

LAYOUT = HeadLayout(5, 8, 4)
N = LAYOUT.n_total
CONTROLS = ["c1", "c2"]
# each head's true single-head damage (target, c1, c2); knockouts compound: nll = prod(1 + d)
CLEAN5 = {h: (0.2 - 0.01 * h, 0.012, 0.0) for h in range(5)}  # any 5 of them: c1 +6.1%, beyond 3%
COLLATERAL = {h: (0.3, 0.0, 0.3) for h in range(5, 10)}  # hurt c2: the screen sets them aside
UNMEASURED = {10: (0.25, 0.2, 0.0), 11: (0.15, 0.0, 0.0), 12: (0.12, 0.0, 0.0), 13: (0.1, 0.0, 0.0), 14: (0.09, 0.0, 0.0)}
ESTIMATE = {10: 0.5, 11: 0.4, 12: 0.3, 13: 0.2, 14: 0.1}  # the order extra singles follow


class _World:
    """An evaluator of knockouts in a world of compounding single-head damages; counts its calls."""

    probes = {"t": None, "c1": None, "c2": None}

    def __init__(self, effects: dict[int, tuple[float, float, float]]) -> None:
        self.effects, self.masks = effects, 0

    def __call__(self, masks, probes=None):
        out = []
        for m in masks:
            self.masks += 1
            d = np.array([self.effects.get(int(h), (0.0, 0.0, 0.0)) for h in np.flatnonzero(m)]).reshape(-1, 3)
            nll = np.prod(1.0 + d, axis=0)
            out.append({t: {"nll": float(v), "acc": 0.0} for t, v in zip(("t", "c1", "c2"), nll) if probes is None or t in probes})
        return out


def _cfg(tmp_path, refine: int = 24) -> LocateConfig:
    return LocateConfig(model="m", task="t", out=str(tmp_path / "run"), controls=CONTROLS, top_k=5, refine=refine,
                        tolerance=0.03, progress=False)


def _search(tmp_path, cfg: LocateConfig, effects, searched):
    """What a prior-guided search leaves: the clean model and ``searched`` alone in the store, the
    singles' effects (NaN elsewhere), estimates of every head, the collateral screen."""
    manifest = {"identity": {"task": "t"}, "layout": {"n_heads": LAYOUT.n_heads}}
    world = _World(effects)
    runner = MaskRunner(RunStore.open(tmp_path / "run", manifest, ["task"], n_heads=LAYOUT.n_heads), world, 1)
    evals = runner(no_knockout(N)) + runner(head_set_masks([(h,) for h in searched], N))
    result = fit_single_heads(evals, cfg, N)
    seen = np.isin(np.arange(N), searched)
    result.target_effect = np.where(seen, result.target_effect, np.nan)
    result.control_effects = {c: np.where(seen, v, np.nan) for c, v in result.control_effects.items()}
    noise = np.random.default_rng(0).normal(0, 0.005, (3, N))
    result.estimates = {t: noise[i] for i, t in enumerate(("t", *CONTROLS))}
    for h, e in ESTIMATE.items():
        result.estimates["t"][h] = e
    screen_step(cfg, result, LAYOUT, lambda m: None)
    return runner, world, result, evals


def _refine(tmp_path, cfg, effects=None, searched=tuple(range(10))):
    runner, world, result, evals = _search(tmp_path, cfg, effects or {**CLEAN5, **COLLATERAL, **UNMEASURED}, list(searched))
    spent = _refine_step(runner, cfg, LAYOUT, result, evals, 0, lambda m: None, None, ("float32", "float32"))
    return runner, world, result, spent


def test_an_exhausted_pool_is_widened_by_screened_extra_singles(tmp_path):
    cfg = _cfg(tmp_path)
    runner, _, result, spent = _refine(tmp_path, cfg)
    w = result.refinement.widening
    assert w is not None and (w.clean_before, w.wanted) == (5, 5 + SWAPS_PER_ROUND)
    # by estimate: 10, 11, 12 (the shortfall, 3); 10 hurts c1 and is set aside; then 13 (the shortfall, 1)
    assert w.heads == [10, 11, 12, 13] and w.clean == [11, 12, 13]
    assert 10 in result.screen.excluded and result.target_effect[10] == pytest.approx(0.25)  # recorded like a search single
    assert result.control_effects["c1"][10] == pytest.approx(0.2) and result.pool_singles == [10, 11, 12, 13]
    stored = read_evaluations(cfg.out)
    pool = [e for e in stored if e.round == POOL_ROUND]
    sets = [e for e in stored if e.round == REFINE_ROUND]
    assert [e.heads for e in pool] == [[10], [11], [12], [13]]
    # on the controls until one excludes the head (this world has no token shares: in the listed order): 10 hurts
    # c1, so c2 was never scored on it; the clean ones on every probe
    assert [set(e.scores) for e in pool] == [{"t", "c1"}] + [{"t", *CONTROLS}] * 3
    assert np.isnan(result.control_effects["c2"][10])
    assert len(pool) + len(sets) == len(spent) <= cfg.refine  # the extra singles are evaluations of refine's budget
    assert not any(10 in e.heads for e in sets)  # the set-aside extra is never in a measured set
    q = result.refinement.quality
    assert q.feasible and {11, 12, 13} <= set(result.refinement.heads)  # two of the first five: c1 +2.4%
    assert len(sets) == 2  # the old start, then the set the grown singles predict, within tolerance: stop
    assert not [e for e in read_evaluations(cfg.out, design_only=True) if e.round < 0]
    info = result.refinement.as_dict(str)["extra_singles"]
    assert info["n_measured"] == 4 and info["set_aside"] == ["10"] and "fewer than K + 3 = 8" in info["why"]


def test_extra_singles_stop_at_what_one_round_of_swaps_leaves(tmp_path):
    budget = 1 + (1 + 5 + SWAPS_PER_ROUND) + 2  # the start, a new start and a full round, and two singles
    cfg = _cfg(tmp_path, refine=budget)
    _, _, result, spent = _refine(tmp_path, cfg)
    w = result.refinement.widening
    assert w.cap == 2 and w.heads == [10, 11] and w.clean == [11]
    assert len(spent) <= budget and len(result.refinement.measured) <= budget - 2


def test_a_resumed_run_replays_the_extra_singles_without_evaluating(tmp_path):
    cfg = _cfg(tmp_path)
    _, _, first, spent = _refine(tmp_path, cfg)
    runner, world, again, spent2 = _refine(tmp_path, cfg)  # the same folder: every mask is stored
    assert world.masks == 0 and runner.new == 0
    assert again.refinement.heads == first.refinement.heads and len(spent2) == len(spent)
    assert again.refinement.widening.heads == first.refinement.widening.heads
    assert sorted(again.screen.excluded) == sorted(first.screen.excluded)


@pytest.mark.parametrize("case", ["large pool", "feasible start"])
def test_no_widening_leaves_every_evaluation_as_before(tmp_path, case):
    """A pool of K + SWAPS_PER_ROUND clean heads, or a start within tolerance (the SmolLM2 main job: 6
    clean heads, its first set within tolerance), measures exactly the sets refine measured before."""
    if case == "large pool":
        effects = {**CLEAN5, **COLLATERAL, **UNMEASURED, 5: (0.1, 0.0, 0.0), 6: (0.05, 0.0, 0.0), 7: (0.04, 0.0, 0.0)}
    else:
        effects = {**{h: (0.2, 0.001, 0.0) for h in range(6)}, **COLLATERAL, 5: (0.1, 0.0, 0.0), **UNMEASURED}
    new = tmp_path / "new"
    old = tmp_path / "old"
    new.mkdir(), old.mkdir()
    _, _, result, _ = _refine(new, _cfg(new), effects)
    assert result.refinement.widening is None and result.pool_singles == []
    # before round 18: the candidates, the singles, and refine without a widen callback
    cfg = _cfg(old)
    runner, _, before, evals = _search(old, cfg, effects, list(range(10)))
    ranking = refine_candidates(before, 5, "t")
    found, _ = refine_ranking(runner, cfg, N, evals[0], ranking, single_effects(before, cfg, ranking))
    assert [q.heads for q in result.refinement.measured] == [q.heads for q in found.measured]
    assert result.refinement.heads == found.heads
    assert [e.heads for e in read_evaluations(new / "run")] == [e.heads for e in read_evaluations(old / "run")]
    if case == "feasible start":
        assert len(found.measured) == 1


def test_a_head_the_extra_singles_set_aside_is_never_handed_on():
    """Round 18, Gemma 3's main job: the measured start was filled with heads never measured alone; the
    extra singles' screen set three of them aside, yet the search went on from that start (its control
    damage the least of all) and handed them on. Now no set holding a set-aside head is a candidate."""
    from capsense.localize.refine import Widening, refine

    k, fill = 3, 9  # head 9: in the first set as a fill head, set aside once measured alone
    ranking = [0, 1, 9, 2, 3, 4, 5]

    def measure(sets):  # the first set (with 9) spares the controls most; every other set breaks 3% more
        return [(0.5, {"c": 0.05 if 9 in s else 0.10 + 0.001 * sum(s)}) for s in sets]

    singles = {h: (0.9 if h == fill else 0.5 - 0.01 * h, {"c": 0.0}) for h in ranking}  # 9: its estimate

    def widen(cap):
        new = [h for h in ranking if h != fill]
        return Widening(2, k + SWAPS_PER_ROUND, cap, heads=[fill, 2, 3], clean=[2, 3], ranking=new,
                        singles={h: singles[h] for h in new})

    found = refine(ranking, k, measure, budget=12, tolerance=0.03, singles=singles, widen=widen)
    assert found.start.heads == (0, 1, 9)  # the predicted start held the fill head
    assert found.found_by[:2] == ["start", "restart"] and set(found.found_by[2:]) == {"swaps"}
    assert fill not in found.heads and fill not in found.quality.heads
    assert not found.quality.feasible and found.quality.control == pytest.approx(min(
        q.control for q in found.measured if len(q.heads) == k and fill not in q.heads))


def test_a_pool_filled_with_heads_never_measured_alone_is_not_widened(tmp_path):
    """Fewer than K clean heads measured alone: the candidates already hold heads never measured alone to
    swap in, so no extra singles (round 18: widening such pools spent 14 of 24 evaluations on singles and
    chose worse sets on SmolLM2 sequence and Gemma 3 induction)."""
    cfg = _cfg(tmp_path)
    _, _, result, spent = _refine(tmp_path, cfg, searched=(0, 1, 2, 5, 6, 7, 8, 9))  # 3 clean of the 8 measured
    assert len(refine_candidates(result, 5, "t")) >= 5 + SWAPS_PER_ROUND
    assert result.refinement.widening is None and result.pool_singles == []
    assert not [e for e in read_evaluations(cfg.out) if e.round == POOL_ROUND]
    assert len(result.refinement.measured) == len(spent) > 1  # the swaps ran on the filled pool

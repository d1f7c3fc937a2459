"""K-head sets (capsense.localize.head_sets): damage predicted from singles, corrected by measured sets;
and measure-and-choose's predicted search (capsense.localize.refine, search="predicted")."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from capsense.errors import CapsenseError
from capsense.localize.choice import shortfall
from capsense.localize.head_sets import LazyControls, MeasuredSets, SetModel, SetQuality, choose
from capsense.localize.outputs import _search_phrase
from capsense.localize.refine import refine


def _singles(target, control):
    return {h: (target.get(h, 0.0), {"ctl": control.get(h, 0.0)}) for h in set(target) | set(control)}


def _world(target, control, pair=None):
    """Target and control damage compounding per head (log-additive), plus control interactions for head pairs."""
    calls = []

    def measure(sets):
        out = []
        for s in sets:
            calls.append(tuple(s))
            t = math.expm1(sum(math.log1p(target.get(h, 0.0)) for h in s))
            c = math.expm1(sum(math.log1p(control.get(h, 0.0)) for h in s))
            c += sum((pair or {}).get(frozenset(p), 0.0) for p in itertools.combinations(s, 2))
            out.append((t, {"ctl": c}))
        return out

    return measure, calls


def _pred(model):
    sets, pred = model.predict()
    return {frozenset(s): (float(p[0]), dict(zip(model.controls, map(float, p[1:])))) for s, p in zip(sets, pred)}


def test_unfitted_prediction_is_the_singles_compounded():
    singles = {0: (1.0, {"a": 0.1}), 1: (0.5, {"a": 0.2, "b": 0.05}), 2: (0.0, {})}
    p = _pred(SetModel([0, 1, 2, 3], 2, singles))
    assert len(p) == 6 and SetModel([0, 1, 2, 3], 2, singles).controls == ["a", "b"]
    t, c = p[frozenset((0, 1))]
    assert t == pytest.approx(2.0 * 1.5 - 1) and c["a"] == pytest.approx(1.1 * 1.2 - 1) and c["b"] == pytest.approx(0.05)
    assert p[frozenset((2, 3))] == (0.0, {"a": 0.0, "b": 0.0})  # heads without singles count as harmless


def test_a_measured_set_corrects_its_own_prediction_and_shifts_the_rest():
    singles = {h: (0.2, {"ctl": 0.01}) for h in range(6)}
    model = SetModel(range(6), 3, singles)
    before = _pred(model)
    model.fit([((0, 1, 2), 0.9, {"ctl": 0.10})])  # the set compounds far worse than its singles
    after = _pred(model)
    assert model.n_fitted == 1 and model.offset[1] > 0
    t, c = after[frozenset((0, 1, 2))]
    assert c["ctl"] == pytest.approx(0.10, rel=1e-6) and t == pytest.approx(0.9, rel=1e-6)  # one set: the offset fits it
    assert after[frozenset((3, 4, 5))][1]["ctl"] > before[frozenset((3, 4, 5))][1]["ctl"]  # unmeasured sets move too
    model.fit([((0, 1, 2), 0.9, {"ctl": 0.10}), ((0, 3, 4), 0.8, {"ctl": 0.02}), ((1, 3, 5), 0.8, {"ctl": 0.02}),
               ((2, 4, 5), 0.8, {"ctl": 0.08})])
    assert model.shift[2, 1] > max(model.shift[h, 1] for h in (0, 1, 3, 4, 5))  # head 2 hurts the control beside others
    model.fit([((0, 1), 1.0, {"ctl": 1.0}), ((0, 9, 1), 1.0, {"ctl": 1.0})])  # not K-sets of the pool: ignored
    assert model.n_fitted == 0 and _pred(model) == before


def test_a_control_a_set_was_not_scored_on_is_fitted_on_the_sets_that_were():
    """``set_controls`` until-beyond: a set that stopped at its first control beyond tolerance leaves the others out.
    Each metric is fitted on the sets scored on it: a control none was scored on keeps the singles' prediction, the
    metrics a set was scored on fit as if the missing one had any value."""
    singles = {h: (0.2, {"a": 0.01, "b": 0.02}) for h in range(6)}
    full = [((0, 1, 2), 0.9, {"a": 0.10, "b": 0.03}), ((0, 3, 4), 0.8, {"a": 0.02, "b": 0.05})]
    short = ((2, 4, 5), 0.7, {"a": 0.2})  # beyond tolerance on a: b never scored
    lazy = SetModel(range(6), 3, singles).fit([*full, short])
    for fill in (0.0, 5.0):  # target and a: the fit of every set, whatever b would have been
        filled = SetModel(range(6), 3, singles).fit([*full, (short[0], short[1], {**short[2], "b": fill})])
        assert np.allclose(lazy.offset[:2], filled.offset[:2]) and np.allclose(lazy.shift[:, :2], filled.shift[:, :2])
    only_full = SetModel(range(6), 3, singles).fit(full)  # b: the two sets scored on it
    assert np.allclose(lazy.offset[2], only_full.offset[2]) and np.allclose(lazy.shift[:, 2], only_full.shift[:, 2])
    none = SetModel(range(6), 3, singles).fit([short, ((0, 1, 3), 0.5, {"a": 0.3})])
    unfitted = _pred(SetModel(range(6), 3, singles))
    assert all(_pred(none)[s][1]["b"] == pytest.approx(unfitted[s][1]["b"]) for s in unfitted)  # b: the singles'


def test_a_chosen_set_not_scored_on_every_control_is_completed_until_the_choice_is():
    """Sets scored until their first control beyond the bound (the first whole): the fallback choice reads a stopped
    set's worst control as a bound, so the set it picks is scored on the rest and the choice made again, until the set
    handed on was scored on every control; a stopped set the choice never picks is never completed."""
    target = {(1, 2): 1.0, (0, 1): 3.0, (0, 2): 2.0, (3, 4): 0.5}
    true = {(1, 2): {"a": 0.30, "b": 0.02, "c": 0.01}, (0, 1): {"a": 0.40, "b": 0.01, "c": 0.90},
            (0, 2): {"a": 0.35, "b": 0.50, "c": 0.0}, (3, 4): {"a": 0.60, "b": 0.0, "c": 0.0}}
    bounds, rest_calls = [], []

    def until(sets, beyond):  # a, b, c in turn, stopping after the first beyond the bound
        bounds.append(beyond)
        out = []
        for s in sets:
            got = {}
            for c in "abc":
                got[c] = true[s][c]
                if got[c] > beyond:
                    break
            out.append((target[s], got))
        return out

    def rest(heads, missing):
        rest_calls.append((heads, missing))
        return {c: true[heads][c] for c in missing}

    measured = MeasuredSets(None, 4, 0.03, "start", 2, LazyControls(("a", "b", "c"), until, rest))
    for s in target:
        measured.run([s])
    assert bounds == [float("inf"), 0.30, 0.30, 0.30]  # the first set whole, then its worst control (above 3%)
    assert [q.complete for q in measured.order] == [True, False, False, False]
    chosen = measured.choice([0, 1, 2, 3, 4], 0.1)
    # the strong sets (target >= 1.5): (0, 1) bound 0.40, (0, 2) bound 0.35: (0, 2) completed to 0.50, then (0, 1)
    # to 0.90, and (0, 2) is chosen; (3, 4), too weak to be chosen, keeps its bound
    assert chosen.heads == (0, 2) and chosen.complete and chosen.controls == true[(0, 2)]
    assert rest_calls == [((0, 2), ["b", "c"]), ((0, 1), ["b", "c"])]
    assert [q.heads for q in measured.order] == list(target) and not measured.get((3, 4)).complete
    every = [SetQuality(s, target[s], c, 0.03) for s, c in true.items()]
    assert choose(every).heads == chosen.heads  # the choice every control makes
    assert measured.beyond() == pytest.approx(0.50)  # the chosen whole set's worst control now


def test_predicted_search_finds_an_interaction_in_few_sets_and_says_why_it_stopped():
    # Heads 0 and 1 hurt the control together only, the singles cannot see it; swaps also find {0, 2, 3}. The singles'
    # small control damages differ, so the fit's choice is no tie (with all of them 0 it was one, and the last bits
    # of the fit decided it: the search went on here on an AVX2 host and handed over to the swaps on an AMX host).
    target = {0: 1.0, 1: 0.9, 2: 0.5, 3: 0.45, 4: 0.1}
    control = {0: 0.01, 1: 0.02, 2: 0.004, 3: 0.005}
    measure, calls = _world(target, control, {frozenset((0, 1)): 0.2})
    swaps = refine(list(range(8)), 3, measure, budget=20, tolerance=0.05, singles=_singles(target, control))
    n_swaps = len(calls)
    measure, calls = _world(target, control, {frozenset((0, 1)): 0.2})
    r = refine(list(range(8)), 3, measure, budget=20, tolerance=0.05, singles=_singles(target, control), search="predicted")
    assert r.start.heads == (0, 1, 2) and not r.start.feasible
    assert r.quality.feasible and 0 in r.heads and 1 not in r.heads and set(swaps.heads) == {0, 2, 3}
    assert r.stopped == "prediction settled" and len(calls) == len(r.measured) < n_swaps
    assert len(set(map(frozenset, calls))) == len(calls)  # each set measured once
    assert r.as_dict(str)["stopped"] == "prediction settled" and r.as_dict(str)["search"] == "predicted"
    assert swaps.search == "swaps" and swaps.as_dict(str)["search"] == "swaps"
    # what proposed each set: recorded per set in heads.json and counted in the report's line
    assert r.found_by == ["start"] + ["prediction"] * (len(calls) - 1)
    assert [m["found_by"] for m in r.as_dict(str)["measured"]] == r.found_by
    assert len(calls) == 2 and _search_phrase(r) == (" (predicted search: 1 set each the best predicted from the singles "
                                                     "and the sets before it)")
    assert swaps.found_by[0] == "start" and set(swaps.found_by[1:]) == {"swaps"} and _search_phrase(swaps) == ""


def test_a_tie_with_a_measured_set_goes_to_it_whatever_the_fits_last_bits(monkeypatch):
    # Every single spares the control, so the measured start's control damage (an interaction) is the offset's alone
    # and every set is predicted to do exactly as badly: a tie, which the measured start wins, so the swaps go on
    # from it. Noise in the fit's last bits (as SIMD kernels of different CPUs leave) changes nothing.
    import capsense.localize.head_sets as head_sets

    target = {0: 1.0, 1: 0.9, 2: 0.5, 3: 0.45, 4: 0.1}
    real_fit = head_sets.SetModel.fit
    runs = []
    for eps in (0.0, 1e-15, -1e-15):
        def fit(self, measured, eps=eps):
            real_fit(self, measured)
            self.offset = self.offset + eps
            return self

        monkeypatch.setattr(head_sets.SetModel, "fit", fit)
        measure, calls = _world(target, {}, {frozenset((0, 1)): 0.2})
        r = refine(list(range(8)), 3, measure, budget=20, tolerance=0.05, singles=_singles(target, {}), search="predicted")
        assert r.start.heads == (0, 1, 2) and r.found_by[:2] == ["start", "swaps"], (eps, r.found_by)
        runs.append(calls)
    assert runs[0] == runs[1] == runs[2]


def test_predicted_search_without_a_selective_set_hands_the_budget_to_the_swaps():
    # every pair does the same damage: once the first pair is measured, no other is predicted to beat it, and it
    # breaks the tolerance, so the swap search goes on from the start with the budget left; the predicted phase
    # measured nothing the swaps would not have, so the run is the swap search's, set for set
    target = {h: 1.0 for h in range(8)}
    control = {h: 0.1 for h in range(8)}
    measure, calls = _world(target, control)
    r = refine(list(range(8)), 2, measure, budget=6, tolerance=0.01, singles=_singles(target, control), search="predicted")
    measure, swap_calls = _world(target, control)
    swaps = refine(list(range(8)), 2, measure, budget=6, tolerance=0.01, singles=_singles(target, control))
    assert calls == swap_calls and len(calls) == 6 and calls[0] == (0, 1)
    assert not r.quality.feasible and r.stopped == swaps.stopped == "budget" and r.heads == swaps.heads
    assert shortfall(r).startswith("NO measured set is within tolerance (6 measured; the budget ran out")
    assert r.found_by == ["start"] + ["swaps"] * 5
    assert "no unmeasured set was predicted to beat the sets already measured, none within tolerance" in _search_phrase(r)


def test_predicted_search_is_deterministic_and_a_feasible_start_is_unchanged():
    target = {h: 1.0 / (h + 1) for h in range(12)}
    control = {h: 0.02 * (h % 3) for h in range(12)}
    runs = []
    for _ in range(2):
        measure, calls = _world(target, control, {frozenset((0, 1)): 0.05})
        runs.append((refine(list(range(12)), 4, measure, budget=10, tolerance=0.03, singles=_singles(target, control),
                            search="predicted").heads, calls))
    assert runs[0] == runs[1]
    measure, calls = _world(target, {})
    r = refine(list(range(12)), 4, measure, budget=10, singles=_singles(target, {}), search="predicted")
    assert r.stopped == "start within tolerance" and len(calls) == 1


def test_searches_are_named_and_predicted_needs_singles():
    measure, _ = _world({0: 1.0, 1: 1.0}, {})
    with pytest.raises(CapsenseError, match="unknown refine search 'greedy': use one of swaps, predicted"):
        refine([0, 1], 1, measure, search="greedy")
    with pytest.raises(CapsenseError, match="needs `singles`"):
        refine([0, 1], 1, measure, search="predicted")

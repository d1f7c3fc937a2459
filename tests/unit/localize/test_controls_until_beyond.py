"""A selective run scores a single's controls cheapest first until one is beyond its screen threshold, and, with
``set_controls`` until-beyond, a measure-and-choose set's until one is beyond tolerance (capsense.localize.singles),
through the run's own runner and store."""

from __future__ import annotations

import numpy as np
import pytest

from capsense.localize.config import LocateConfig
from capsense.localize.designs import head_set_masks
from capsense.localize.evaluator import MaskRunner
from capsense.localize.fit import filled_scores, fit_single_heads
from capsense.localize.methods import Search, no_knockout
from capsense.localize.pool import screen_of
from capsense.localize.choice import refine_ranking
from capsense.localize.singles import controls_until_beyond, screen_thresholds
from capsense.localize.store import REFINE_ROUND, Evaluation, RunStore, read_evaluations

N = 12
TASKS = ("t", "c1", "c2")
SHARE = {"t": 0.3, "c1": 0.6, "c2": 0.1}  # c2 is the cheaper control: scored first
# each head's single-head damage (t, c1, c2)
EFFECTS = {0: (0.4, 0.0, 0.001), 1: (0.3, 0.01, 0.0), 2: (0.2, 0.0, 0.0),  # clean
           3: (0.5, 0.0, 0.4), 4: (0.6, 0.9, 0.3),  # c2 beyond its threshold: c1 never scored
           5: (0.3, 0.5, 0.0),  # c2 clean, c1 beyond: both scored
           6: (3.0, 0.0, 0.9), 7: (0.45, 0.05, 0.0)}  # for measure-and-choose's sets
SINGLES = [(h,) for h in range(6)]


class _World:
    """Knockouts in a world of compounding single-head damages, scored on the probes asked for."""

    probes = dict.fromkeys(TASKS)

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[str]]] = []

    def token_share(self, names) -> float:
        return sum(SHARE[n] for n in names)

    def cost(self, heads, probes=None) -> float:  # a mask on every probe = 1 forward-equivalent
        return self.token_share(probes or TASKS)

    def __call__(self, masks, probes=None):
        asked = list(probes or TASKS)
        out = []
        for m in masks:
            heads = [int(h) for h in np.flatnonzero(m)]
            self.calls.append((heads, asked))
            d = np.array([EFFECTS.get(h, (0.0, 0.0, 0.0)) for h in heads]).reshape(-1, 3)
            nll = dict(zip(TASKS, np.prod(1.0 + d, axis=0)))
            out.append({t: {"nll": float(nll[t]), "acc": 0.0} for t in asked})
        return out


class _Refuses(_World):
    def __call__(self, masks, probes=None):
        raise AssertionError("a resumed run evaluates nothing it already stored")


def _cfg(tmp_path, **kw) -> LocateConfig:
    return LocateConfig(model="m", task="t", out=str(tmp_path / "run"), controls=["c1", "c2"], top_k=5, progress=False,
                        **kw)


def _estimates() -> dict[str, np.ndarray]:
    """Spread 0.01 around 0 on every control: with z 3, thresholds near 0.03 (floor 0.03 / 5 = 0.006)."""
    rng = np.random.default_rng(0)
    return {t: rng.normal(0, 0.01, N) for t in TASKS}


def _search(tmp_path, world) -> tuple[Search, Evaluation]:
    manifest = {"identity": {"task": "t"}, "layout": {"n_heads": 4}}
    runner = MaskRunner(RunStore.open(tmp_path / "run", manifest, ["task"], n_heads=4), world, 1)
    s = Search(runner, _cfg(tmp_path), N)
    return s, runner(no_knockout(N))[0]


def test_controls_stop_at_the_first_beyond_its_threshold_cheapest_first(tmp_path):
    world = _World()
    s, base = _search(tmp_path, world)
    thresholds = screen_thresholds(s.cfg, _estimates())
    assert all(0.006 <= v < 0.1 for v in thresholds.values())
    evs = controls_until_beyond(s.run, s.cfg, N, SINGLES, base, thresholds)
    assert [e.heads for e in evs] == [[h] for h in range(6)]
    assert [sorted(e.scores) for e in evs] == (
        [sorted(TASKS)] * 3 + [["c2", "t"]] * 2 + [sorted(TASKS)])
    assert [e.index for e in evs] == [1, 2, 3, 4, 5, 6]  # at the index of its target's evaluation
    # the target for all, then c2 (cheapest) for all, then c1 for the heads c2 did not put beyond its threshold
    assert world.calls[1:] == ([([h], ["t"]) for h in range(6)] + [([h], ["c2"]) for h in range(6)]
                               + [([h], ["c1"]) for h in (0, 1, 2, 5)])
    stored = read_evaluations(s.cfg.out, joined=False)  # one per call
    assert [(e.heads, sorted(e.scores)) for e in stored[1:]] == [(heads, probes) for heads, probes in world.calls[1:]]
    assert [(e.index, e.heads, e.scores) for e in read_evaluations(s.cfg.out)[1:]] == [  # read joined: as the search saw
        (e.index, e.heads, e.scores) for e in evs]
    # the cost counts the documents run: the clean model, 6 targets, 6 c2, 4 c1 (instead of 1 + 6 of everything)
    assert s.run.forward_equivalents == pytest.approx(1 + 6 * 0.3 + 6 * 0.1 + 4 * 0.6)
    # a resumed run replays the same calls from the store
    again, base2 = _search(tmp_path, _Refuses())
    assert [(e.heads, e.scores) for e in controls_until_beyond(again.run, again.cfg, N, SINGLES, base2, thresholds)] == [
        (e.heads, e.scores) for e in evs]


def test_the_screen_sets_aside_the_heads_it_would_with_every_control(tmp_path):
    """The same heads are set aside; what differs is the controls a set-aside head was not scored on (NaN)."""
    est = _estimates()
    results = {}
    for mode in ("until-excluded", "all"):
        s, base = _search(tmp_path / mode, _World())
        if mode == "all":
            evs = s.run(head_set_masks(SINGLES, N))
        else:
            evs = controls_until_beyond(s.run, s.cfg, N, SINGLES, base, screen_thresholds(s.cfg, est))
        result = fit_single_heads([base, *evs], s.cfg, N, fill=est)
        result.estimates = est
        results[mode] = result
    cfg = _cfg(tmp_path)
    screens = {mode: screen_of(cfg, r) for mode, r in results.items()}
    assert set(screens["until-excluded"].excluded) == set(screens["all"].excluded) == {3, 4, 5}
    assert screens["until-excluded"].until_excluded and "not measured" in screens["until-excluded"].as_dict(str)["rule"]
    partial = results["until-excluded"].control_effects
    assert np.isnan(partial["c1"][3]) and np.isnan(partial["c1"][4]) and partial["c1"][5] == pytest.approx(0.5)
    for c in ("c1", "c2"):  # every control a head was scored on reads the same as with every control
        full = results["all"].control_effects[c]
        seen = np.isfinite(partial[c])
        assert np.allclose(partial[c][seen], full[seen])
    clean = [h for h in results["until-excluded"].scores.rank if h not in screens["all"].excluded][:3]
    assert sorted(clean) == [0, 1, 2]


def test_a_control_not_scored_counts_as_the_fill_says_in_the_selective_fit(tmp_path):
    cfg = _cfg(tmp_path)
    evals = [Evaluation(0, [], {t: {"nll": 2.0, "acc": 0.0} for t in TASKS}),
             Evaluation(1, [7], {"t": {"nll": 3.0, "acc": 0.0}, "c2": {"nll": 2.5, "acc": 0.0}}),
             Evaluation(2, [4, 5], {"t": {"nll": 3.0, "acc": 0.0}})]
    fill = np.zeros(N)
    fill[7] = 0.25
    assert filled_scores(evals, "c1", cfg, fill) == pytest.approx([-2.0, -2.5, -2.0])  # a group: the clean score
    assert filled_scores(evals, "c1", cfg, None) == pytest.approx([-2.0, -2.0, -2.0])  # no fill: harmless
    assert filled_scores(evals, "c2", cfg, fill)[1] == pytest.approx(-2.5)  # measured: as measured


@pytest.mark.parametrize("kw, message", [
    ({"single_controls": "some"}, "unknown single_controls 'some'"),
    ({"single_controls": "all", "screen": 0.0}, "`single_controls` all applies to a run with `controls` and a"),
    ({"set_controls": "some"}, "unknown set_controls 'some'"),
    ({"set_controls": "all", "refine": 0}, "`set_controls` all applies to measure-and-choose with `controls` .* it "
                                           "has no refine budget"),
])
def test_bad_single_and_set_controls_are_refused(tmp_path, kw, message):
    from capsense.errors import CapsenseError
    from capsense.localize.methods import get_method

    with pytest.raises(CapsenseError, match=message):
        cfg = _cfg(tmp_path, **kw)
        cfg.check()
        get_method(cfg)
    if "refine" in kw:  # without controls; and a method that measures its own set does no measure-and-choose
        for bad in ({}, {"method": "greedy"}):
            with pytest.raises(CapsenseError, match="it has no (controls|refine budget)"):
                get_method(LocateConfig(model="m", task="t", out=str(tmp_path), set_controls="all",
                                        controls=[] if not bad else ["c1"], **bad))


def _true_quality(heads, tolerance: float):
    """A set's damage on every control in :class:`_World` (compounding single-head damages)."""
    from capsense.localize.head_sets import SetQuality

    d = np.prod([1.0 + np.array(EFFECTS.get(h, (0.0, 0.0, 0.0))) for h in heads], axis=0) - 1.0
    return SetQuality(tuple(heads), float(d[0]), {"c1": float(d[1]), "c2": float(d[2])}, tolerance)


def test_sets_scored_until_beyond_the_bound_and_the_chosen_one_on_every_control(tmp_path):
    """Measure-and-choose with ``set_controls`` until-beyond: the first set on every probe in one call; later sets on
    the target, then c2 (the cheaper control), then c1 unless c2 was beyond the bound (the first set's worst control,
    c1 +5%); the set the choice picks is completed (c1 alone) and handed on, as the choice over every control would;
    the evaluations returned hold one per set, its calls joined."""
    from capsense.localize.head_sets import choose

    world = _World()
    s, base = _search(tmp_path, world)
    cfg = LocateConfig(model="m", task="t", out=str(tmp_path / "run"), controls=["c1", "c2"], top_k=2, progress=False,
                       refine=6, refine_search="swaps", set_controls="until-beyond")
    found, spent = refine_ranking(s.run, cfg, N, base, [7, 0, 6])
    assert found.set_controls == "until-beyond" and not found.quality.feasible
    assert [sorted(q.heads) for q in found.measured] == [[0, 7], [0], [7], [0, 6]]  # start, leave-one-out, a swap
    assert [(sorted(h), p) for h, p in world.calls[1:]] == [
        ([0, 7], list(TASKS)),  # the first set: no bound yet
        ([0], ["t"]), ([7], ["t"]), ([0], ["c2"]), ([7], ["c2"]), ([0], ["c1"]), ([7], ["c1"]),  # within the bound
        ([0, 6], ["t"]), ([0, 6], ["c2"]),  # c2 +90%: beyond the bound of +5%, c1 not scored
        ([0, 6], ["c1"])]  # the choice picks it (the first set does less than half its target damage): completed
    truth = [_true_quality(q.heads, cfg.tolerance) for q in found.measured if len(q.heads) == 2]
    assert set(found.quality.heads) == set(choose(truth).heads) == {0, 6}
    assert found.quality.complete and found.quality.controls == pytest.approx(
        _true_quality(found.quality.heads, cfg.tolerance).controls)
    assert [sorted(e.heads) for e in spent] == [sorted(q.heads) for q in found.measured]  # one evaluation per set
    assert all(e.round == REFINE_ROUND and set(e.scores) == set(TASKS) for e in spent)
    assert "all_controls" not in found.as_dict(str)["chosen"]
    # a resumed run replays the same calls, the completion included, from the store
    again, base2 = _search(tmp_path, _Refuses())
    replay, spent2 = refine_ranking(again.run, cfg, N, base2, [7, 0, 6])
    assert replay.measured == found.measured and [(e.heads, e.scores) for e in spent2] == [(e.heads, e.scores) for e in spent]


def test_cheapest_first_scores_the_target_in_its_place_and_never_for_a_head_a_cheaper_control_sets_aside(tmp_path):
    """``single_controls`` cheapest-first: c2 (0.1 of the tokens) before the target (0.3) before c1 (0.6); heads 3 and 4,
    beyond c2's threshold, cost c2 alone; the screen sets aside the same heads as target-first, and the clean heads
    rank as they do there."""
    world = _World()
    s, base = _search(tmp_path, world)
    est = _estimates()
    thresholds = screen_thresholds(s.cfg, est)
    evs = controls_until_beyond(s.run, s.cfg, N, SINGLES, base, thresholds, target_first=False)
    assert world.calls[1:] == ([([h], ["c2"]) for h in range(6)] + [([h], ["t"]) for h in (0, 1, 2, 5)]
                               + [([h], ["c1"]) for h in (0, 1, 2, 5)])
    assert [sorted(e.scores) for e in evs] == [sorted(TASKS)] * 3 + [["c2"]] * 2 + [sorted(TASKS)]
    assert [e.index for e in evs] == [1, 2, 3, 4, 5, 6]  # at the index of its first call's evaluation
    assert s.run.forward_equivalents == pytest.approx(1 + 6 * 0.1 + 4 * 0.3 + 4 * 0.6)  # target-first: 1 + 6*0.3 + 6*0.1 + 4*0.6
    again, base2 = _search(tmp_path, _Refuses())  # a resumed run replays the same calls from the store
    assert [(e.heads, e.scores) for e in controls_until_beyond(again.run, again.cfg, N, SINGLES, base2, thresholds,
                                                                target_first=False)] == [(e.heads, e.scores) for e in evs]

    result = fit_single_heads([base, *evs], s.cfg, N, fill=est)
    result.estimates = est
    assert np.isnan(result.target_effect[[3, 4]]).all() and np.isfinite(result.target_effect[[0, 1, 2, 5]]).all()
    assert result.control_effects["c2"][3] == pytest.approx(0.4) and np.isnan(result.control_effects["c1"][3])
    assert set(screen_of(s.cfg, result).excluded) == {3, 4, 5}
    s_first, base_first = _search(tmp_path / "first", _World())
    first = fit_single_heads([base_first, *controls_until_beyond(s_first.run, s_first.cfg, N, SINGLES, base_first,
                                                                  thresholds)], s_first.cfg, N, fill=est)
    first.estimates = est
    ranks = [screen_of(s.cfg, r).clean(r.scores.rank) for r in (result, first)]
    assert ranks[0][:3] == ranks[1][:3] == [0, 1, 2]  # the fit keeps a target-less single, its target the estimate's
    # without the target's estimate (a metric it is not in) a target-less single stays out of the fit and ranks last
    out = fit_single_heads([base, *evs], s.cfg, N, fill={c: est[c] for c in ("c1", "c2")})
    assert set(out.scores.rank[:4]) == {0, 1, 2, 5} and out.scores.confidence[3] == 0


def test_a_target_cheaper_than_every_control_goes_first_as_before(tmp_path, monkeypatch):
    monkeypatch.setitem(SHARE, "t", 0.05)
    world = _World()
    s, base = _search(tmp_path, world)
    controls_until_beyond(s.run, s.cfg, N, SINGLES, base, screen_thresholds(s.cfg, _estimates()), target_first=False)
    assert world.calls[1:7] == [([h], ["t"]) for h in range(6)]


def test_the_search_flags_and_bounds_by_the_target_damages_it_measured():
    """A single without a target damage (NaN: set aside before its target) neither sets the flag's K-th single
    damage nor the coverage's, and ranks after the singles measured on the target."""
    from capsense.localize.coverage import coverage
    from capsense.localize.prior import PriorSearch, _threshold

    search = PriorSearch(singles={0: 0.5, 1: float("nan"), 2: 0.2, 3: 0.9})
    assert _threshold(search, 2, 0.5) == pytest.approx(0.25)  # 0.5 x the 2nd largest of 0.9, 0.5, 0.2
    assert search.ranking(5) == [3, 0, 2, 1, 4]
    cov = coverage([[0], [1], [2], [3], [1, 4]], [0.5, float("nan"), 0.2, 0.9, 0.3], 5, 2)
    assert cov.kth_single == pytest.approx(0.5) and cov.measured == [0, 1, 2, 3] and cov.bound == {4: pytest.approx(0.3)}


@pytest.mark.parametrize("metric, in_fit", [("nll", True), ("acc", False)])
def test_the_estimate_stands_in_for_a_missing_target_only_in_its_own_unit(tmp_path, metric, in_fit):
    """The prior-guided fit gives a target-less single attribution's target estimate where the run ranks by nll (its
    unit); an accuracy run leaves it out of the fit (an nll estimate says nothing of an accuracy drop)."""
    import json

    from capsense.localize.guided import fit_prior_guided

    world = _World()
    s, base = _search(tmp_path, world)
    est = _estimates()
    evs = controls_until_beyond(s.run, s.cfg, N, SINGLES, base, screen_thresholds(s.cfg, est), target_first=False)
    (tmp_path / "run" / "attribution.json").write_text(json.dumps({"estimate": {t: v.tolist() for t, v in est.items()}}))
    cfg = _cfg(tmp_path, metric=metric)
    result = fit_prior_guided([base, *evs], cfg, N)
    assert np.isnan(result.target_effect[3]) and np.isnan(result.target_effect[4])
    assert (result.scores.confidence[[3, 4]] == 1).all() == in_fit and (result.scores.confidence[[0, 1, 2, 5]] == 1).all()


@pytest.mark.parametrize("metric, kept", [("nll", {"t", "c1", "c2"}), ("choice_nll", {"t", "c1", "c2"}), ("acc", set())])
def test_estimates_stand_in_only_for_probes_scored_in_their_unit(tmp_path, metric, kept):
    """One rule for every place an estimate stands in for a damage not measured (the selective fit, measure-and-choose's
    singles, the coverage report): a probe's estimate qualifies where the run scores that probe by a gradient metric.
    Under ``acc`` the controls are scored by accuracy too, so none does (before, the fit still took their nll
    estimates for accuracy damages while measure-and-choose took none)."""
    from capsense.localize.fit import estimates_in_units

    cfg = _cfg(tmp_path, metric=metric)
    est = {"t": np.zeros(N), "c1": np.ones(N), "c2": np.ones(N)}
    assert cfg.task == "t" and set(cfg.controls) == {"c1", "c2"}
    assert set(estimates_in_units(cfg, est)) == kept
    assert estimates_in_units(cfg, None) is None

"""Measure and choose: the K-head set a selective run hands on, checked on its own documents.

A regression ranks single heads from an additive model, but users ablate a *set*, and
head effects are not additive: on SmolLM2-135M the selective top 5 for induction cost
arithmetic +7.1% nats/token on the run's documents, while the same set without one head
(L0H2) cost +3.8% and without another (L8H0) +13.4%, with induction wrecked either way.
So a selective run measures candidate K-head sets with the same evaluator and keeps the
best (:func:`choose`): among sets whose every control worsens by at most ``tolerance``
(relative) and whose target damage is near the best such set's, the one with the least
control damage; else, among sets that do at least half the largest target damage measured, the one
with the least control damage (not a selective set, and the run says so).

Search (deterministic, so a resumed run replays it from the stored evaluations): start
from the ranking's top K; each round measures the set without each of its heads
(leave-one-out), picks the head to swap out (the one whose removal helps the controls
most while the set breaks the tolerance, else the one the target misses least), tries it
against the next untried candidates of the ranking, and keeps a swap only if it improves
the search objective (feasible first, then target damage). The loop ends when the budget of
evaluations or the candidates run out; the choice is made over every K-set measured.

**Predicted start** (``singles``: each candidate's measured single-head damage on the target and
every control, which every selective run has already paid for): instead of the top K of the
ranking, the search starts from the K-set the singles predict best, by the rule
:func:`choose` applies to measured sets (predicted within tolerance, target near the best,
least control damage; with none predicted within tolerance, the least control damage of all, without
:func:`choose`'s target floor, since a start is where the search for a set within tolerance begins). A set's damage is predicted log-additively,
``log(1 + d_set) = sum_h log(1 + d_h)``, which keeps a sum of relative worsenings from
running past what compounding gives. When the measured start is within tolerance the search
stops there: the singles already ranked every other set below it, so only an interaction the
singles cannot see could change the choice, and the leave-one-out rounds exist to find those
when the start breaks the tolerance.

**Extra singles** (round 18, ``widen``): when the measured start breaks the tolerance and the search
left fewer than K + :data:`SWAPS_PER_ROUND` candidates (clean heads measured alone, filled with heads
never measured alone only when fewer than K are clean), a round of swaps would have fewer than its
candidates to try (on SmolLM2 antonyms exactly K were clean: nothing to swap, the
infeasible start was handed on after one evaluation). The caller's ``widen(cap)`` then measures more
heads alone (:mod:`capsense.localize.pool`), at most ``cap`` of them: what the budget leaves after one
full round (a new start, K leave-one-out sets, :data:`SWAPS_PER_ROUND` swaps). They count against the
budget; the search then starts again from the set the grown singles predict best (stopping there when it
is within tolerance) or keeps the measured start when that is better. A start within tolerance never
widens: the run is then the same as before, evaluation for evaluation (the SmolLM2 main job: 6 clean).

**Predicted search** (round 30, ``search="predicted"``, :data:`DEFAULT_SEARCH` of a locate run): after a start that breaks the tolerance (and any
extra singles), measure, one at a time, the set :func:`choose` picks over every K-set of the pool, each measured
set as measured and every other predicted from the singles corrected by the sets measured so far
(:class:`capsense.localize.head_sets.SetModel`: a shared offset and per-head shifts, fitted after each set); a
head's knockout is never predicted to help (:data:`capsense.localize.head_sets.SEARCH_FLOOR`). It stops when that
choice is a measured set within tolerance ("prediction settled"). When the choice it settles on breaks the
tolerance, the swap search goes on from the start (or the set extra singles restarted from) with the budget left (sets already measured are not measured
again): where no set is within tolerance the prediction has nothing more to offer, and leave-one-out rounds are
what find an interaction. RESULTS-locate.md, round 30, has the runs it was measured on.

Measured and not adopted (round 15, RESULTS-locate.md): naming the head to swap out from the singles
instead of leave-one-out, and stopping once no swap is predicted to beat a feasible set. On the SmolLM2
main job with groups at their real cost it measured 5 sets instead of 19 to the same set; on Gemma 3,
where no set is feasible, it handed on another set that left held-out induction accuracy untouched. Replayed in
round 29 (``recipes/bench/replay_refine_stop.py``) on six SmolLM2 runs with no set within tolerance: stopping once
the choice had not changed for P sets handed on a worse set in 5 of 6 at P = 4 and 3 of 6 at P = 8, and saved
nothing at P = 12 (choices settled at sets 1-22). :attr:`Refinement.stopped` and ``settled`` say so in each run.

**Controls until beyond** (round 43, ``set_controls="until-beyond"``, the default of a locate run with controls;
:class:`~capsense.localize.head_sets.LazyControls`): a set is scored on the target, then on the controls cheapest
first, until the first control beyond a bound (as a single is scored until the screen excludes it,
:mod:`capsense.localize.singles`). The bound (:meth:`~capsense.localize.head_sets.MeasuredSets.beyond`) is the worst
control of the set :func:`choose` picks among the sets scored on every control, or the tolerance where that is
larger; the first set is scored on every control. A set that stops is neither within tolerance nor better than that
set, and its worst control is then only bounded from below (:attr:`~capsense.localize.head_sets.SetQuality.complete`
False): the search reads that bound where it reads a set's worst control (the swaps' objective and leave-one-out,
the fallback choice), and the predicted search's :class:`~capsense.localize.head_sets.SetModel` fits each control on
the sets scored on it. The choice stays exact over the sets measured
(:meth:`~capsense.localize.head_sets.MeasuredSets.choice`): while the set :func:`choose` picks is not complete, its
other controls are measured and the choice made again, so the set handed on is scored on every control. The sets
the search proposes may differ from ``all``'s. On six targets of both models (RESULTS-locate.md, round 43) it handed
on the same set on four and a better one on two (arithmetic: one within tolerance where ``all`` found none), for
0.5-15 FE less. Measured first with the tolerance as the bound, not kept: on SmolLM2 sequence it measured 14.2 FE
instead of 30.45 but, its search misled by the bounds of most sets it read, handed on a worse set (worst control
+10.6% against +7.8%), and on Gemma 3 induction too (+56.4% against +40.3%).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from capsense.errors import CapsenseError
from capsense.localize.head_sets import (DEFAULT_TARGET_SLACK, SEARCH_FLOOR, LazyControls, Measure, MeasuredSets,
                                         SetModel, SetQuality, Singles, candidate_sets, choose, rounded)


DEFAULT_BUDGET = 24
DEFAULT_TOLERANCE = 0.03  # relative control worsening allowed on the run's documents
SWAPS_PER_ROUND = 3
#: Why a search ends (``Refinement.stopped``): a start (predicted, or predicted again after extra singles) within
#: tolerance, the budget of evaluations spent, or every candidate tried against the head to swap out.
#: The predicted search (``search="predicted"``) ends instead when the choice over every K-set of its pool, measured
#: where measured and predicted elsewhere, is a measured set within tolerance: "prediction settled" (a measured set
#: beyond it hands the budget left to the swap search, which then ends by budget or candidates).
STOPPED = ("start within tolerance", "budget", "candidates", "prediction settled")
#: How measure-and-choose searches after a start that breaks the tolerance (see the module's docstring).
SEARCHES = ("swaps", "predicted")
#: The search a locate run uses unless told (:attr:`capsense.localize.config.LocateConfig.refine_search`); round 30
#: measured it against swaps on nine targets (RESULTS-locate.md). :func:`refine`'s own default is the search that
#: needs no singles.
DEFAULT_SEARCH = "predicted"
#: How a measured set's controls are scored (``LocateConfig.set_controls``): every one, or until the first beyond the
#: search's bound (see "Controls until beyond" above).
SET_CONTROLS = ("all", "until-beyond")

#: Which part of the search proposed a measured set (``Refinement.found_by``, ``found_by`` of each set in
#: heads.json): the first set, the set predicted again after extra singles, the predicted search, and the swap
#: search (its leave-one-out sets and swaps). On Gemma 3's main job (round 31) the predicted search measured one
#: set and handed 22 to the swaps; a report that called all 24 predicted would have misled.
FOUND_BY = ("start", "restart", "prediction", "swaps")


@dataclass
class Widening:
    """Heads measured alone for measure-and-choose because the search left too few clean ones to swap
    in (see the module's "Extra singles"), and the candidates afterwards."""

    clean_before: int  # clean heads measured alone that the search left
    wanted: int  # clean heads measured alone a round of swaps needs: K + SWAPS_PER_ROUND
    cap: int  # the most extra singles the budget allowed (one full round of swaps left)
    heads: list[int]  # knocked out alone here, in order (each one evaluation of the budget)
    clean: list[int]  # of them, the ones the collateral screen kept
    ranking: list[int] = field(repr=False)  # the candidates afterwards
    singles: Singles = field(repr=False)  # their single-head damages

    def as_dict(self, name: Callable[[int], str]) -> dict:
        return {
            "why": f"the measured start broke the tolerance and the search left {self.clean_before} clean heads "
                   f"measured alone, fewer than K + {SWAPS_PER_ROUND} = {self.wanted} (a round of swaps needs "
                   f"{SWAPS_PER_ROUND} candidates outside the set)",
            "clean_before": self.clean_before,
            "wanted": self.wanted,
            "cap": self.cap,
            "n_measured": len(self.heads),
            "measured": [name(h) for h in self.heads],
            "clean": [name(h) for h in self.clean],
            "set_aside": [name(h) for h in self.heads if h not in self.clean],
        }


#: ``widen(cap)``: at most ``cap`` more heads measured alone (None: the pool is large enough).
Widen = Callable[[int], Widening | None]


@dataclass
class Refinement:
    """What the search chose and what it measured on the way."""

    heads: list[int]  # the chosen set, ordered by how much the target misses each head
    quality: SetQuality
    start: SetQuality
    measured: list[SetQuality] = field(default_factory=list)
    widening: Widening | None = None  # extra singles measured before the swaps (None: none were needed)
    stopped: str = "budget"  # why the search ended: one of STOPPED
    settled: int = 1  # how many sets were measured when the set handed on became the choice for good
    search: str = "swaps"  # how it searched after a start that broke the tolerance: one of SEARCHES
    found_by: list[str] = field(default_factory=list)  # per measured set, what proposed it: one of FOUND_BY
    set_controls: str = SET_CONTROLS[0]  # how each set's controls were scored: one of SET_CONTROLS

    def as_dict(self, name: Callable[[int], str]) -> dict:
        def q(s: SetQuality) -> dict:
            return {
                "heads": [name(h) for h in s.heads],
                "target_damage": round(s.target, 4),
                "control_damage": {c: round(v, 4) for c, v in s.controls.items()},
                "feasible": s.feasible,
                **({} if s.complete else {"all_controls": False}),  # scored until its first control beyond the bound
            }

        out = {
            "heads": [name(h) for h in self.heads],
            "tolerance": self.quality.tolerance,
            "within_tolerance": self.quality.feasible,  # False: no measured set spares the controls (see `shortfall`)
            "chosen": q(self.quality),
            "start": q(self.start),
            "n_evaluations": len(self.measured),
            "stopped": self.stopped,
            "choice_settled_at": self.settled,  # well before n_evaluations: later sets changed nothing
            "search": self.search,
            "set_controls": self.set_controls,
            "measured": [{**q(s), "found_by": by} for s, by in zip(self.measured, self.found_by, strict=True)],
        }
        if self.widening is not None:  # its singles are evaluations of the same budget
            out["extra_singles"] = self.widening.as_dict(name)
        return out


def _head_to_swap(current: tuple[int, ...], measured: MeasuredSets) -> int | None:
    """The head to swap out of ``current`` (None when the budget ran out before deciding):
    the one whose removal helps the controls most while the set breaks the tolerance, else
    the one the target misses least."""
    if len(current) == 1:
        return current[0]
    loo = {h: tuple(x for x in current if x != h) for h in current}
    measured.run(list(loo.values()))
    without = {h: measured.get(s) for h, s in loo.items()}
    if any(q is None for q in without.values()):
        return None
    if measured.get(current).feasible:
        return max(current, key=lambda h: (without[h].target, -without[h].control))
    return min(current, key=lambda h: (without[h].control, -without[h].target))


def _by_loss(chosen: SetQuality, ranking: list[int], measured: MeasuredSets) -> list[int]:
    """The chosen heads by how much the target misses each (when every leave-one-out set was
    measured), else in ranking order."""
    pos = {h: i for i, h in enumerate(ranking)}
    heads = sorted(chosen.heads, key=lambda h: pos.get(h, len(pos)))
    without = {h: measured.get([x for x in heads if x != h]) for h in heads}
    if len(heads) > 1 and all(q is not None for q in without.values()):
        heads = sorted(heads, key=lambda h: -(chosen.target - without[h].target))
    return heads


def refine(
    ranking: Sequence[int],
    k: int,
    measure: Measure,
    budget: int = DEFAULT_BUDGET,
    tolerance: float = DEFAULT_TOLERANCE,
    pool: int | None = None,
    target_slack: float = DEFAULT_TARGET_SLACK,
    singles: Singles | None = None,
    widen: Widen | None = None,
    search: str = "swaps",
    lazy: LazyControls | None = None,
) -> Refinement:
    """Search K-head sets near the top of ``ranking``.

    ``measure(sets)`` returns, per head set, the relative target damage and the relative damage per control
    (positive = worse); it is called with only unmeasured sets and never with more than ``budget`` sets in total.
    ``singles``: per candidate head its single-head damage (target, controls); with them the search starts from
    the predicted best K-set (:func:`predicted_best`) and stops there when it is within tolerance. ``widen``:
    called once before the swaps, it may measure more heads alone (see "Extra singles"); its evaluations count
    against ``budget``. ``search``: how to go on from a start that breaks the tolerance, one of :data:`SEARCHES`
    (``predicted`` needs ``singles``). ``lazy``: a set after the first is measured by ``lazy.until``, its controls
    until the first beyond the search's bound, and ``lazy.rest`` measures the others where the choice needs them
    (see "Controls until beyond").
    """
    if search not in SEARCHES:
        raise CapsenseError(f"unknown refine search {search!r}: use one of {', '.join(SEARCHES)}")
    if search == "predicted" and singles is None:
        raise CapsenseError("the predicted refine search needs `singles` (each candidate's single-head damage)")
    if k < 1 or k > len(ranking):
        raise CapsenseError(f"cannot choose {k} heads from a ranking of {len(ranking)}: `top_k` must be between 1 and {len(ranking)}")
    ranking = [int(h) for h in ranking]
    pool = pool if pool is not None else 4 * k
    measured = MeasuredSets(measure, budget, tolerance, FOUND_BY[0], k, lazy)
    how = SET_CONTROLS[0] if lazy is None else SET_CONTROLS[1]
    current = tuple(ranking[:k])
    if singles is not None:
        current = predicted_best(ranking[: k + pool], k, singles, tolerance, target_slack)
    measured.run([current])
    start = measured.get(current)
    if start is None:
        raise CapsenseError("refine needs a `budget` of at least 1 evaluation")
    if singles is not None and start.feasible:
        return Refinement(list(current), start, start, measured.order, stopped=STOPPED[0], search=search,
                          found_by=measured.found_by, set_controls=how)
    measured.phase = FOUND_BY[1]
    widened, ranking, current, stop = _widened(widen, ranking, k, pool, current, measured, target_slack)
    if stop:
        return Refinement(list(current), measured.get(current), start, measured.order, widened, STOPPED[0],
                          len(measured.order), search, measured.found_by, how)
    measured.phase = FOUND_BY[2]
    stopped = _predicted_search(ranking, k, pool, measured, singles or {}, target_slack) if search == "predicted" else ""
    if stopped != STOPPED[3] or not choose(candidate_sets(measured.order, k, ranking), target_slack).feasible:
        measured.phase = FOUND_BY[3]
        _swap_search(current, ranking, k, pool, measured)  # (after the predicted search: the sets it measured are free)
        stopped = STOPPED[1] if len(measured.order) >= measured.budget else STOPPED[2]
    chosen = measured.choice(ranking, target_slack)  # (completed where it was scored until beyond: see above)
    return Refinement(_by_loss(chosen, ranking, measured), chosen, measured.get(start.heads), measured.order, widened,
                      stopped, _settled_at(measured.order, k, ranking, target_slack, chosen), search, measured.found_by, how)


def _swap_search(current: tuple[int, ...], ranking: list[int], k: int, pool: int, measured: MeasuredSets) -> None:
    """Leave-one-out names the head to swap out, the next untried candidates of the ranking are tried in its
    place, and a swap is kept when it improves the search objective (feasible first, then target damage)."""
    queue = [h for h in ranking[: k + pool] if h not in current]
    tried: dict[int, set[int]] = {}
    while len(measured.order) < measured.budget and queue:
        cur = measured.get(current)
        out = _head_to_swap(current, measured)
        if out is None:  # the budget ran out within the leave-one-out sets
            break
        done = tried.setdefault(out, set())
        cands = [c for c in queue if c not in done][:SWAPS_PER_ROUND]
        if not cands:
            break
        done.update(cands)
        swaps = [tuple(c if h == out else h for h in current) for c in cands]
        measured.run(swaps)
        best = max([cur, *(q for q in map(measured.get, swaps) if q is not None)], key=SetQuality.key)
        if best is not cur:
            queue = [h for h in queue if h not in best.heads] + [out]
            current = best.heads
            tried = {}


def _predicted_search(ranking: list[int], k: int, pool: int, measured: MeasuredSets, singles: Singles,
                      target_slack: float) -> str:
    """Measure, one at a time, the set :func:`choose` picks over every K-set of the pool, measured where measured
    and predicted elsewhere by the singles corrected by every set measured so far
    (:class:`capsense.localize.head_sets.SetModel`); stop when that choice is a measured set (nothing
    unmeasured is predicted to beat it) or the budget is spent. Returns why it stopped (:data:`STOPPED`).

    A measured set and an unmeasured one predicted exactly as good is a tie the measured set wins: nothing unmeasured
    is predicted to beat it. Predictions and measured damages are compared at
    :data:`~capsense.localize.head_sets.PREDICTION_DECIMALS`, so that a tie is one in exact arithmetic. Until round
    38 the last bits of the fit decided such a tie, one way on an AVX2 host and the other on an AMX host (a set the
    fit explained by the offset every set shares, tied with every set whose singles were the same)."""
    model = SetModel(ranking[: k + pool], k, singles, floor=SEARCH_FLOOR)
    while len(measured.order) < measured.budget:
        model.fit([(q.heads, q.target, q.controls) for q in measured.order])
        sets = [rounded(q) for q in candidate_sets(measured.order, k, ranking)]  # first: a tie goes to a measured set
        done = {frozenset(q.heads) for q in measured.order}
        sets += [q for q in model.qualities(measured.tolerance) if frozenset(q.heads) not in done]
        best = choose(sets, target_slack)
        if measured.get(best.heads) is not None:
            return STOPPED[3]
        measured.run([best.heads])
    return STOPPED[1]


def _settled_at(order: list[SetQuality], k: int, ranking: list[int], target_slack: float, chosen: SetQuality) -> int:
    """How many sets were measured when ``chosen`` became the choice for good: the choice made from every
    shorter prefix of ``order`` after that one is ``chosen`` too."""
    n = len(order)
    while n > 1 and (sets := candidate_sets(order[: n - 1], k, ranking)) and choose(sets, target_slack) is chosen:
        n -= 1
    return n


def _widened(widen: Widen | None, ranking: list[int], k: int, pool: int, current: tuple[int, ...], measured: MeasuredSets,
             target_slack: float) -> tuple[Widening | None, list[int], tuple[int, ...], bool]:
    """Extra singles when the measured start broke the tolerance (room kept for a new start and one full
    round of swaps): the record, the candidates, the set to go on from, and whether to stop there."""
    if widen is None or measured.get(current).feasible:
        return None, ranking, current, False
    widened = widen(max(0, measured.budget - len(measured.order) - (1 + k + SWAPS_PER_ROUND)))
    if widened is None or not widened.heads:
        return widened, ranking, current, False
    ranking = [int(h) for h in widened.ranking]
    current, stop = _restart(ranking, k, pool, current, measured, len(widened.heads), widened.singles, target_slack)
    return widened, ranking, current, stop


def _restart(ranking: list[int], k: int, pool: int, current: tuple[int, ...], measured: MeasuredSets, spent: int,
             singles: Singles, target_slack: float) -> tuple[tuple[int, ...], bool]:
    """After ``spent`` extra singles (taken off the budget): the set to search from, and whether to stop
    there. The set the grown ``singles`` predict best is measured; within tolerance the search
    stops there (as at the predicted start), else it goes on from the better of it and ``current``, unless
    ``current`` holds a head the extra singles' screen set aside (no longer in ``ranking``): a start filled
    with heads never measured alone can hold one, and going on from it handed that head on (Gemma 3's
    main job, round 18: L2H1, L1H3 and L2H2, set aside for collateral damage, in the chosen set)."""
    measured.budget -= spent
    stale = not set(current) <= set(ranking)
    again = predicted_best(ranking[: k + pool], k, singles, measured.tolerance, target_slack)
    measured.run([again])
    q = measured.get(again)
    if q is None:  # (the cap leaves room for it; a budget cut short by hand may not)
        return current, False
    if q.feasible:
        return again, True
    return (again if stale or q.key() > measured.get(current).key() else current), False


def predicted_best(pool: Sequence[int], k: int, singles: Singles, tolerance: float,
                   target_slack: float = DEFAULT_TARGET_SLACK) -> tuple[int, ...]:
    """The K-set of ``pool`` the single-head damages predict best (:class:`capsense.localize.head_sets.SetModel`,
    unfitted), by :func:`choose`'s rule, except that with none predicted within tolerance it is the least control
    damage of all, whatever its target damage: a start for a search that looks for a set within tolerance first
    (the SmolLM2 main job's start is such a set, predicted +6.4% on a control, measured +1.7%: round 14), not a
    set handed on. Ties keep ``pool`` order (deterministic, so a resumed run replays it).
    """
    return choose(SetModel(pool, k, singles).qualities(tolerance), target_slack, target_floor=0.0).heads

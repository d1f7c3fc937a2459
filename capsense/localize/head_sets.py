"""K-head sets as measure-and-choose (:mod:`capsense.localize.refine`) sees them: a set's quality
(:class:`SetQuality`: target damage, control damage, within tolerance or not), the rule that picks the set to
hand on (:func:`choose`), a set's damage predicted from its heads' single-head damages, corrected by the
sets measured (:class:`SetModel`: the search starts from its best set, and its predicted search,
``search="predicted"``, refits it after each measured set), and the sets a search measured (:class:`MeasuredSets`,
which sets the bound a set's controls stop at, and completes a set that stopped before the choice hands it on).

Per metric (the target and each control) a set's damage is predicted log-additively from its heads'
single-head damages, ``log1p(d_S) = sum_h log1p(d_h)``, which keeps a sum of relative worsenings from running
past what compounding gives. Measured sets correct it: ``log1p(d_S) = sum_h (log1p(d_h) + shift_h) + offset``,
with ``offset`` shared by every K-set (a set compounds worse, or better, than its singles: the SmolLM2 main
job's start was predicted +6.4% on a control and measured +1.7%, round 14) and ``shift_h`` a head's own
(it hurts more, or less, beside others than alone), fitted by least squares with a ridge of :data:`RIDGE`
on the shifts and none on the offset. A head in one measured set moves by about half its residual; a
head in none keeps its singles, shifted by the offset. :data:`RIDGE` is 1 by construction (a measured set
weighs as much as the singles' prior), not tuned on any run.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import comb

import numpy as np

#: per head: its single-head (relative target damage, {control: relative damage}) (as refine's ``Singles``).
Singles = dict[int, tuple[float, dict[str, float]]]
MAX_PREDICTED_SETS = 200_000  # K-subsets of the pool scored (K = 5, pool 25: C(25, 5) = 53,130)
RIDGE = 1.0  # the shifts' ridge, in units of one measured set
#: The predicted search's ``floor``: a head's knockout is never predicted to help a set. Singles of heads never
#: knocked out alone are attribution's estimates, and a wrong-signed one misleads every prediction it enters:
#: on a new user's plural task (SmolLM2, round 30) L0H8 was estimated to make syntax 47% better, was measured
#: in 8 of 9 sets the search proposed, and the set handed on hurt syntax +27.2% (swaps: worst control +7.2%).
SEARCH_FLOOR = 0.0
#: Decimals a predicted damage keeps (:meth:`SetModel.predict`, and a measured set where the predicted search
#: compares it with predictions: :func:`rounded`). Sets equal in exact arithmetic then compare equal on every CPU.
#: Left to the last bits, which differ between SIMD kernels, a tie went one way on an AVX2 host and the other on an
#: AMX host (round 38: a set fitted by the shared offset alone, tied with every set the fit could not tell from it).
PREDICTION_DECIMALS = 12
DEFAULT_TARGET_SLACK = 0.1  # target damage within 10% of the best counts as equally wrecked
#: With no set within tolerance, the set handed on does at least this fraction of the largest target damage
#: measured (see :func:`choose`).
DEFAULT_TARGET_FLOOR = 0.5


@dataclass
class SetQuality:
    """A measured head set: target damage, worst control damage (relative), and feasibility."""

    heads: tuple[int, ...]
    target: float
    controls: dict[str, float]
    tolerance: float
    #: every control measured; False: scored until the first control beyond the search's bound (``set_controls``
    #: until-beyond, :meth:`MeasuredSets.beyond`), so :attr:`control` is a lower bound
    complete: bool = True

    @property
    def control(self) -> float:
        """The worst control damage (of the controls measured: a lower bound where the set is not complete)."""
        return max(self.controls.values(), default=0.0)

    @property
    def feasible(self) -> bool:
        return self.control <= self.tolerance

    def worst(self) -> str | None:
        """The control this set damages most (None without controls)."""
        return max(self.controls, key=self.controls.get, default=None)

    def key(self) -> tuple[int, float]:
        """Larger is better: feasible sets by target damage, others by least control damage."""
        return (1, self.target) if self.feasible else (0, -self.control)


def choose(measured: Sequence[SetQuality], target_slack: float = DEFAULT_TARGET_SLACK,
           target_floor: float = DEFAULT_TARGET_FLOOR) -> SetQuality:
    """The set to hand on: among sets within tolerance whose target damage is within
    ``target_slack`` (relative) of the best such set, the one with the least control damage;
    with none within tolerance, among sets whose target damage is at least ``target_floor`` x the
    largest measured, the one with the least control damage.

    A wrecked target saturates (induction at 0.70 -> 0.03 accuracy either way), so a margin on
    the controls is worth more than the last few points of target damage: it buys robustness
    to the noise of estimating control damage on a few documents.

    Until round 25 the fallback was the least control damage of all sets, and the swaps drive towards sets
    that spare the controls: it handed on sets that spared the target too (Gemma 3 induction, round 20:
    target +8.7%; a new user's capitals task on SmolLM2: +10.1% where the first set did +187%, held-out
    capitals -14.3% against -71.4% with the floor; RESULTS-locate.md, round 25). Half the largest damage,
    not the largest, leaves room to spare the controls.
    """
    feasible = [q for q in measured if q.feasible]
    if not feasible:
        most = max(q.target for q in measured)
        strong = [q for q in measured if q.target >= target_floor * most] if most > 0 else list(measured)
        return min(strong, key=lambda q: (q.control, -q.target))
    best = max(q.target for q in feasible)
    near = [q for q in feasible if q.target >= best - target_slack * abs(best)]
    return min(near, key=lambda q: (q.control, -q.target))


def rounded(q: SetQuality) -> SetQuality:
    """``q`` with its damages kept to :data:`PREDICTION_DECIMALS`, as predictions are (for comparing the two)."""
    return SetQuality(q.heads, round(q.target, PREDICTION_DECIMALS),
                      {c: round(v, PREDICTION_DECIMALS) for c, v in q.controls.items()}, q.tolerance, q.complete)


def _logs(target: float, controls: dict[str, float], names: Sequence[str], floor: float = -0.99) -> np.ndarray:
    return np.log1p(np.maximum([target, *(controls.get(c, 0.0) for c in names)], floor))


class SetModel:
    """Predicted damage of every K-subset of ``pool`` (cut so that at most :data:`MAX_PREDICTED_SETS`
    are scored; ties keep ``pool`` order), from ``singles`` (a head without singles counts as harmless)
    and, after :meth:`fit`, the sets measured.

    ``floor``: the least single-head damage carried into a set's prediction. The start is predicted with
    -0.99 (a head that helps counts as helping); the predicted search uses 0 (:data:`SEARCH_FLOOR`).
    """

    def __init__(self, pool: Sequence[int], k: int, singles: Singles, floor: float = -0.99) -> None:
        pool = [int(h) for h in pool]
        while len(pool) > k and comb(len(pool), k) > MAX_PREDICTED_SETS:
            pool = pool[:-1]
        self.pool, self.k = pool, k
        self.controls = sorted({c for h in pool if h in singles for c in singles[h][1]})
        self.prior = np.zeros((len(pool), 1 + len(self.controls)))
        for i, h in enumerate(pool):
            self.prior[i] = _logs(*singles.get(h, (0.0, {})), self.controls, floor)
        self.sets = np.array(list(itertools.combinations(range(len(pool)), k)), dtype=int)
        self.shift = np.zeros_like(self.prior)
        self.offset = np.zeros(self.prior.shape[1])
        self.n_fitted = 0

    def fit(self, measured: Sequence[tuple[Sequence[int], float, dict[str, float]]]) -> "SetModel":
        """Fit the offset and shifts to ``measured`` (heads, target damage, {control: damage}): K-sets of
        the pool only (others are skipped); with none, the prediction is the singles'. A control a set was not
        scored on (``set_controls`` until-beyond) is fitted on the sets that were: with none, its prediction is
        the singles'."""
        where = {h: i for i, h in enumerate(self.pool)}
        rows = [(s, t, c) for s, t, c in measured if len(s) == self.k and all(h in where for h in s)]
        self.n_fitted = len(rows)
        if not rows:
            self.shift[:], self.offset[:] = 0.0, 0.0
            return self
        x = np.zeros((len(rows), 1 + len(self.pool)))
        x[:, 0] = 1.0
        for r, (s, _, _) in enumerate(rows):
            x[r, [1 + where[h] for h in s]] = 1.0
        y = np.stack([_logs(t, c, self.controls) for _, t, c in rows]) - x[:, 1:] @ self.prior
        seen = np.array([[True, *(name in c for name in self.controls)] for _, _, c in rows])
        penalty = np.diag([0.0] + [RIDGE] * len(self.pool))
        if seen.all():
            coef = np.linalg.solve(x.T @ x + penalty, x.T @ y)
        else:  # a set that stopped at its first control beyond the bound: each metric fitted on the sets scored on it
            coef = np.column_stack([np.linalg.solve(x[m].T @ x[m] + penalty, x[m].T @ y[m, j]) if m.any()
                                    else np.zeros(x.shape[1]) for j, m in enumerate(seen.T)])
        self.offset, self.shift = coef[0], coef[1:]
        return self

    def predict(self) -> tuple[list[tuple[int, ...]], np.ndarray]:
        """Every K-subset of the pool, in ``combinations`` order, and its predicted damage: an array of
        [sets, 1 + controls], the target first, then :attr:`controls` in order."""
        logs = self.prior[self.sets].sum(axis=1)
        if self.n_fitted:  # (unfitted: the singles' sums exactly, as the start has always been predicted)
            logs = logs + self.shift[self.sets].sum(axis=1) + self.offset
        sets = [tuple(self.pool[j] for j in s) for s in self.sets.tolist()]
        return sets, np.round(np.expm1(logs), PREDICTION_DECIMALS)

    def qualities(self, tolerance: float) -> list[SetQuality]:
        """The predicted sets as :class:`SetQuality`, each with its worst control alone (all :func:`choose` reads)."""
        sets, pred = self.predict()
        if not self.controls:
            return [SetQuality(s, float(t), {}, tolerance) for s, t in zip(sets, pred[:, 0])]
        worst = pred[:, 1:].argmax(axis=1)
        names = [self.controls[w] for w in worst]
        return [SetQuality(s, t, {c: v}, tolerance)
                for s, t, c, v in zip(sets, pred[:, 0].tolist(), names, pred[np.arange(len(sets)), 1 + worst].tolist())]


#: ``measure(sets)`` -> per set: (relative target damage, {control: relative damage}).
Measure = Callable[[list[tuple[int, ...]]], list[tuple[float, dict[str, float]]]]


@dataclass
class LazyControls:
    """Sets scored until their first control beyond a bound (``set_controls`` until-beyond,
    :data:`capsense.localize.refine.SET_CONTROLS`): every control a set has (``names``, in the order a complete set
    lists them); ``until(sets, beyond)``, which measures each set on the target, then on the controls until the first
    whose damage is beyond ``beyond`` (every control where it is infinite); and ``rest(heads, missing)``, which measures
    a set's damage on the controls ``missing``."""

    names: tuple[str, ...]
    until: Callable[[list[tuple[int, ...]], float], list[tuple[float, dict[str, float]]]]
    rest: Callable[[tuple[int, ...], list[str]], dict[str, float]]


def candidate_sets(order: Sequence[SetQuality], k: int, ranking: list[int]) -> list[SetQuality]:
    """The measured K-sets the choice is made over: after widening, none holding a head its screen set
    aside (no longer in ``ranking``), unless every one does."""
    sets = [q for q in order if len(q.heads) == k]
    return [q for q in sets if set(q.heads) <= set(ranking)] or sets


class MeasuredSets:
    """The K-sets (and leave-one-out sets) measure-and-choose measured so far (each once, never more than ``budget``),
    by set and in order; ``phase``: what proposes the sets measured next (the search sets it as it goes); ``lazy``:
    sets are scored until their first control beyond :meth:`beyond` (:class:`LazyControls`)."""

    def __init__(self, measure: Measure, budget: int, tolerance: float, phase: str, k: int,
                 lazy: LazyControls | None = None) -> None:
        self.measure, self.budget, self.tolerance, self.phase, self.k, self.lazy = measure, budget, tolerance, phase, k, lazy
        self.seen: dict[frozenset, SetQuality] = {}
        self.order: list[SetQuality] = []
        self.found_by: list[str] = []  # per set in ``order``

    def get(self, heads: Sequence[int]) -> SetQuality | None:
        return self.seen.get(frozenset(heads))

    def run(self, sets: list[tuple[int, ...]]) -> None:
        """Measure the sets not measured yet, as many as the budget allows."""
        new: list[tuple[int, ...]] = []
        for s in sets:
            if frozenset(s) not in self.seen and frozenset(s) not in {frozenset(x) for x in new}:
                new.append(tuple(s))
        new = new[: max(0, self.budget - len(self.order))]
        if not new:
            return
        got = self.measure(new) if self.lazy is None else self.lazy.until(new, self.beyond())
        for s, (t, c) in zip(new, got):
            complete = self.lazy is None or set(c) >= set(self.lazy.names)
            q = SetQuality(s, float(t), {n: float(v) for n, v in c.items()}, self.tolerance, complete)
            self.seen[frozenset(s)] = q
            self.order.append(q)
            self.found_by.append(self.phase)

    def beyond(self) -> float:
        """Where a set's controls may stop: beyond the worst control of the set :func:`choose` picks among the K-sets
        scored on every control, or beyond the tolerance where that is larger (infinite before any was): a set that
        stops there can be neither within tolerance nor better than that set, so every set that could be chosen
        over it is scored on every control, and the search reads whole sets wherever they compete with the best."""
        whole = [q for q in self.order if q.complete and len(q.heads) == self.k]
        return max(self.tolerance, choose(whole).control) if whole else float("inf")

    def completed(self, q: SetQuality) -> SetQuality:
        """``q`` scored on the controls it was not scored on; it stays where it was measured, complete."""
        missing = [c for c in self.lazy.names if c not in q.controls]
        got = {**q.controls, **self.lazy.rest(q.heads, missing)}
        full = SetQuality(q.heads, q.target, {c: float(got[c]) for c in self.lazy.names}, q.tolerance)
        self.seen[frozenset(q.heads)] = full
        self.order[self.order.index(q)] = full
        return full

    def choice(self, ranking: list[int], target_slack: float) -> SetQuality:
        """:func:`choose` over the measured K-sets (:func:`candidate_sets`), the chosen set scored on every control:
        one that was not is completed and the choice made again (its bound only rises), until the chosen set is
        complete. Exact: a complete set chosen over bounds is chosen over the true values too."""
        while not (chosen := choose(candidate_sets(self.order, self.k, ranking), target_slack)).complete:
            self.completed(chosen)
        return chosen

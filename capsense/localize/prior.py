"""Prior-guided localization: the gradient estimate says where to look, knockouts decide.

A gradient attribution (:mod:`capsense.scoring.attribution`) estimates every head's ablation
effect for the price of 3 forward passes, but it is linear: saturated attention and
cancelling paths give false negatives (near-zero or even wrong-sign estimates of heads that
matter). :func:`prior_guided` spends real knockouts where the estimate is informative and
group tests where it may be blind:

1. **singles**: the ``top_m`` heads by ``|estimate|`` are knocked out one at a time (a large
   estimate of either sign flags a head; a wrong-sign head is caught here), in order of
   ``|estimate|`` per forward-equivalent (a late head's knockout reuses the clean prefix and
   costs a fraction of an early one's), so a budget cut keeps the most informative knockouts.
   Measured in index order, as before round 7, they spent the first forward-equivalents on
   layer-0 heads (1 FE each) whatever their estimate. Replayed on the recorded SmolLM2 sweeps
   (singles exactly as measured, groups as the sum of their heads' effects), 4/5 of the
   exhaustive top 5 came at 8.9 / 12.7 / 9.1 FE on arithmetic / induction / sequence with this
   order and ``top_m`` 32, against 16.5 / 22.0 / 18.7 in index order with ``top_m`` 24; largest
   ``|estimate|`` first without the cost gave 16.8 / 11.1 / 9.6 (arithmetic's L20H8 is the
   14th largest ``|estimate|`` but a cheap late head);
2. **groups**: every other head is covered by a group knockout of ``group_size`` heads
   adjacent in layer order (prefix reuse makes a late group cheap);
3. **splits**: a group whose damage reaches ``flag`` x the K-th largest single damage is
   halved and the halves measured, down to single heads (a zero-estimate head that
   matters lands here).

It stops when no flagged group is left (then, if head effects add up, no unmeasured head can
beat the measured top K by more than the margin ``flag`` leaves) or the budget of
forward-equivalents is spent. Every head of the ranking it returns was knocked out alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from capsense.scoring.cost import ATTRIBUTION

DEFAULT_TOP_M = 32
DEFAULT_GROUP_SIZE = 16
DEFAULT_FLAG = 0.5
DEFAULT_BUDGET = 50.0
#: What orders the singles (``LocateConfig.prior_score``): the attribution's ``|estimate|`` (its
#: per-document gradients summed, then the absolute value), or ``documents``: each document's
#: ``|gradient|`` summed, which a head whose documents pull both ways cannot cancel out of
#: (:attr:`capsense.scoring.attribution.Attribution.magnitude`; measured in RESULTS-locate.md, round 9:
#: over both models' six recorded tasks the worst FE to 5/5 fell from 38.6 to 18.0 and the mean FE to
#: 4/5 from 10.2 to 9.2, for 0.9 FE more on one pair's FE to 4/5; the default since round 9).
PRIOR_SCORES = ("estimate", "documents")

#: How the search's budget prices a group knockout (``LocateConfig.group_price``) in a selective run,
#: where groups are scored on the target alone: ``full`` (the default), as if scored on every probe,
#: so the budget buys the masks it bought before round 14; ``target``, at what it costs (the target's
#: token share), so the same budget buys more groups and splits. Measured on the SmolLM2 main job
#: (round 15, RESULTS-locate.md): ``target`` bought 24 groups instead of 4, reached L16H0 and cut
#: held-out induction accuracy by 100% instead of 85.7%, but that set hurt held-out QA (-13.6%) and
#: math word problems (-54.5%), which the searched controls do not cover; not the default.
GROUP_PRICES = ("full", "target")

Measure = Callable[[list[tuple[int, ...]]], list[float]]  # head sets -> target damage (positive = hurts)
Cost = Callable[[tuple[int, ...]], float]  # head set -> forward-equivalents


@dataclass(frozen=True)
class PriorSettings:
    """How :func:`prior_guided` spends its budget (forward-equivalents, the attribution included)."""

    top_k: int = 5
    top_m: int = DEFAULT_TOP_M
    group_size: int = DEFAULT_GROUP_SIZE
    flag: float = DEFAULT_FLAG
    budget: float = DEFAULT_BUDGET
    already_spent: float = ATTRIBUTION  # the attribution (and whatever else ran before the search)


@dataclass
class PriorSearch:
    """What the search measured: single-head damage, group damage, and the cost."""

    singles: dict[int, float] = field(default_factory=dict)
    groups: list[tuple[tuple[int, ...], float]] = field(default_factory=list)
    spent: float = 0.0
    stopped_by_budget: bool = False

    def ranking(self, n: int) -> list[int]:
        """Heads measured alone by damage (largest first; a single without a target damage, NaN, after them), then
        the rest in index order."""
        measured = sorted(self.singles, key=lambda h: (not np.isfinite(self.singles[h]), -np.nan_to_num(self.singles[h]), h))
        return measured + [h for h in range(n) if h not in self.singles]

    def group_bound(self, n: int) -> np.ndarray:
        """Per head the damage of the smallest group knockout containing it (NaN if none)."""
        bound = np.full(n, np.nan)
        size = np.full(n, np.inf)
        for heads, d in self.groups:
            for h in heads:
                if len(heads) < size[h]:
                    bound[h], size[h] = d, len(heads)
        return bound


class Spender:
    """Measures head sets while the budget lasts, recording singles and groups in the search.

    Public because :func:`groups_and_splits` takes one: a caller that measures its singles some other
    way (``recipes/bench/replay_racing.py`` races them) hands its own to the group step."""

    def __init__(self, measure: Measure, cost: Cost, budget: float, search: PriorSearch) -> None:
        self.measure, self.cost, self.budget, self.search = measure, cost, budget, search

    def __call__(self, sets: Sequence[tuple[int, ...]]) -> list[tuple[tuple[int, ...], float]]:
        todo = []
        for s in sets:
            c = self.cost(s)
            if self.search.spent + c > self.budget + 1e-9:
                self.search.stopped_by_budget = True
                break
            self.search.spent += c
            todo.append(s)
        if not todo:
            return []
        out = list(zip(todo, (float(d) for d in self.measure(todo))))
        for s, d in out:
            if len(s) == 1:
                self.search.singles[s[0]] = d
            else:
                self.search.groups.append((s, d))
        return out


def _threshold(search: PriorSearch, k: int, flag: float) -> float:
    """``flag`` x the K-th largest target damage of the heads measured alone; a single the collateral screen set aside
    before its target was scored (NaN: ``single_controls`` cheapest-first) has none and does not count."""
    vals = sorted((v for v in search.singles.values() if np.isfinite(v)), reverse=True)
    kth = vals[min(k, len(vals)) - 1] if vals else 0.0
    return flag * max(kth, 0.0)


def prior_guided(estimate: np.ndarray, measure: Measure, cost: Cost, settings: PriorSettings = PriorSettings(),
                 also: np.ndarray | None = None) -> PriorSearch:
    """Localize with knockouts guided by ``estimate`` (per head, positive = its removal hurts).

    ``measure`` returns the measured damage of each head set (same sign convention), ``cost``
    its forward-equivalents; the search never spends more than ``settings.budget`` in all.
    ``also``: a second score (selective mode: the target estimate minus the controls'); the
    singles then alternate between the largest ``|estimate|`` and the largest ``also``.
    """
    n = len(estimate)
    search = PriorSearch(spent=settings.already_spent)
    spend = Spender(measure, cost, settings.budget, search)
    by_size = [int(h) for h in np.argsort(-np.abs(estimate), kind="stable")]
    if also is not None:
        by_also = [int(h) for h in np.argsort(-also, kind="stable")]
        by_size = list(dict.fromkeys(h for pair in zip(by_size, by_also) for h in pair))
    value = np.abs(estimate) if also is None else np.maximum(np.abs(estimate), also)
    singles = sorted(by_size[: min(settings.top_m, n)], key=lambda h: -value[h] / max(cost((h,)), 1e-9))
    spend([(h,) for h in singles])
    groups_and_splits(search, spend, n, settings)
    return search


def groups_and_splits(search: PriorSearch, spend: Spender, n: int, settings: PriorSettings,
                      skip: frozenset[int] = frozenset()) -> None:
    """Steps 2 and 3 of :func:`prior_guided`: group knockouts over the heads neither measured alone nor
    in ``skip``, then halving of the groups that reach ``flag`` x the K-th single damage (largest first)
    while the budget lasts. (``recipes/bench/replay_racing.py`` runs it after singles raced on a subset.)"""
    rest = [h for h in range(n) if h not in search.singles and h not in skip]
    g = max(2, settings.group_size)
    groups = [tuple(rest[i : i + g]) for i in range(0, len(rest), g)]
    queue = [(s, d) for s, d in spend(groups) if len(s) > 1]
    while queue and not search.stopped_by_budget:
        tau = _threshold(search, settings.top_k, settings.flag)
        flagged = [(s, d) for s, d in queue if d >= tau and d > 0]
        if not flagged:
            break
        s, _ = max(flagged, key=lambda x: x[1])
        queue.remove((s, _))
        half = len(s) // 2
        parts = [s[:half], s[half:]]
        queue += [(p, d) for p, d in spend(parts) if len(p) > 1]

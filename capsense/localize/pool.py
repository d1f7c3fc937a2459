"""Measure-and-choose's candidate pool: which heads it draws from, what it knows of each, and more
heads measured alone when the search left too few clean ones to swap in.

* :func:`refine_candidates`: the clean heads measured alone (the search's, then the extra ones), and
  only to fill the set, unmeasured heads by their estimate;
* :func:`single_effects`: each candidate's single-head damage, measured or estimated;
* :func:`widener`: the ``widen`` callback of :func:`capsense.localize.refine.refine`.

**Extra singles** (round 18). On SmolLM2 antonyms the screen set aside 13 of the 18 heads the search
measured alone, leaving exactly K = 5 clean: measure-and-choose measured that one set (beyond the
tolerance), had nothing to swap in, and handed it on with most of its budget unspent. Rule, the same
for every task and model: when the measured start breaks the tolerance (the search is about to swap)
and measure-and-choose has fewer than K + ``SWAPS_PER_ROUND`` candidates (a round of swaps tries
``SWAPS_PER_ROUND`` outside the set; :func:`refine_candidates` adds heads never measured alone only when
fewer than K are clean, so this is a clean pool of K to K + 2 heads), the next heads never measured alone are knocked out
alone, each with the run's runner as the search's singles are (on the controls until one excludes it,
:mod:`capsense.localize.singles`; stored as round :data:`POOL_ROUND`, replayed on
resume), recorded in the result like the search's singles, screened by the same collateral screen,
until that many are clean, the heads run out, or the cap :func:`~capsense.localize.refine.refine`
gives is spent (what the budget leaves after one full round of swaps). Each batch is the shortfall,
so the run measures no more than it needs when every one comes out clean.

Order: attribution's estimated target effect, largest first (the estimate that proposed the search's
singles; in the run's unit or not, it only orders); without estimates, the run's ranking. A start
within tolerance never widens (the SmolLM2 main job, 6 clean heads: unchanged), nor does a pool of
K + ``SWAPS_PER_ROUND`` clean heads.

Measured and narrowed (round 18): first the rule counted clean heads measured alone only, so runs with
fewer than K clean (SmolLM2 sequence 0, Gemma 3 induction 1), whose candidates were already filled with
heads never measured alone, also widened, spending the whole cap (14 of 24) on singles and 9-10 sets
where round 17 measured 24. Sequence then chose a set with worst control +13.6% on the search's
documents (round 17: +7.9%) that held-out math word problems reject (-45.5%; round 17's set: -18.2%,
selective), and Gemma's handed-on set kept three heads the extra singles set aside (see
:func:`capsense.localize.refine._restart`). Such pools have heads to swap in; widening now fires only
when the candidates run short.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from capsense.localize.config import LocateConfig
from capsense.localize.designs import head_set_masks
from capsense.localize.evaluator import MaskRunner
from capsense.localize.fit import LocateResult, damage, estimates_in_units, put_last
from capsense.localize.head_sets import Singles
from capsense.localize.refine import SWAPS_PER_ROUND, Widen, Widening
from capsense.localize.screen import Screen, collateral_screen
from capsense.localize.singles import controls_until_beyond, screen_settings, screen_thresholds
from capsense.localize.store import POOL_ROUND, Evaluation


def single_effects(result: LocateResult, cfg: LocateConfig, heads: Sequence[int]) -> Singles:
    """Per head its single-head damage on the target and every control, as the run knows it: measured
    (or a regression's effect) where there is one, else attribution's estimate when it is in the run's
    unit (:func:`~capsense.localize.fit.estimates_in_units`), else none (the prediction then counts the head as
    harmless)."""
    est = estimates_in_units(cfg, result.estimates)

    def value(effects: np.ndarray, task: str, h: int) -> float:
        v = float(effects[h])
        if np.isfinite(v):
            return v
        return float(est[task][h]) if est is not None and task in est else 0.0

    return {int(h): (value(result.target_effect, cfg.task, h),
                     {c: value(result.control_effects[c], c, h) for c in cfg.controls}) for h in heads}


def clean_ranking(result: LocateResult) -> list[int]:
    """The run's ranking without the heads the collateral screen set aside."""
    rank = [int(h) for h in result.scores.rank]
    return result.screen.clean(rank) if result.screen is not None else rank


def clean_measured(result: LocateResult) -> list[int]:
    """The clean heads with a measured single-head effect: the search's in ranking order, then the
    extra singles by their measured target effect (their importance is no fit, only a placeholder)."""
    extra = set(result.pool_singles)
    measured = [h for h in clean_ranking(result) if np.isfinite(result.target_effect[h])]
    return ([h for h in measured if h not in extra]
            + sorted((h for h in measured if h in extra), key=lambda h: -float(result.target_effect[h])))


def unmeasured_by_estimate(result: LocateResult, task: str) -> list[int]:
    """The clean heads never knocked out alone, by attribution's estimated target effect (largest first;
    ties and runs without estimates: the run's ranking)."""
    rest = [h for h in clean_ranking(result) if not np.isfinite(result.target_effect[h])]
    est = (result.estimates or {}).get(task)
    return sorted(rest, key=lambda h: -float(est[h])) if est is not None else rest


def refine_candidates(result: LocateResult, k: int, task: str) -> list[int]:
    """The ranking measure-and-choose draws from: without the heads the screen set aside, the clean
    heads measured alone first, then (only to fill the set, when fewer than ``k`` are clean) heads
    never knocked out alone, by their estimated target effect. Unmeasured heads used to follow in
    index order: swapping them in cost full forwards from layer 0 and handed on unscreened early
    heads (seen on SmolLM2 with prior-guided)."""
    measured = clean_measured(result)
    return measured if len(measured) >= k else measured + unmeasured_by_estimate(result, task)


def until_excluded(cfg: LocateConfig, result: LocateResult) -> bool:
    """Whether a single's controls stop at the first beyond its screen threshold: asked for, and the run has the
    estimates that set the thresholds before any knockout (:mod:`capsense.localize.singles`)."""
    return cfg.controls_until_excluded and result.estimates is not None


def screen_of(cfg: LocateConfig, result: LocateResult) -> Screen:
    """The run's collateral screen over every head measured alone so far (noise from the estimates'
    spread where the run has them, so heads measured later meet the same thresholds)."""
    return collateral_screen(result.control_effects, **screen_settings(cfg), spread=result.estimates,
                             until_excluded=until_excluded(cfg, result),
                             target_after=until_excluded(cfg, result) and cfg.target_after_cheaper_controls)


def measure_alone(runner: MaskRunner, cfg: LocateConfig, n: int, base: Evaluation, result: LocateResult,
                  heads: Sequence[int]) -> list[Evaluation]:
    """Knock each of ``heads`` out alone (on every probe; in a screened run with estimates, on the controls until
    one excludes it, as the search's singles are: :mod:`capsense.localize.singles`), record its target and control
    damage in ``result`` as the search's singles are, and screen again; newly set aside heads rank last."""
    if until_excluded(cfg, result):
        evs = controls_until_beyond(runner, cfg, n, [(h,) for h in heads], base,
                                    screen_thresholds(cfg, result.estimates), POOL_ROUND,
                                    target_first=not cfg.target_after_cheaper_controls)
    else:
        evs = runner(head_set_masks([(h,) for h in heads], n), POOL_ROUND)
    for e, h in zip(evs, heads):
        result.target_effect[h] = float(damage([e], cfg.task, cfg, base)[0])
        for c in cfg.controls:
            result.control_effects[c][h] = float(damage([e], c, cfg, base)[0])
    result.pool_singles += [int(h) for h in heads]
    if result.screen is not None:
        screen = screen_of(cfg, result)
        result.scores = put_last(result.scores, sorted(set(screen.excluded) - set(result.screen.excluded)))
        result.screen = screen
    return evs


def widener(runner: MaskRunner, cfg: LocateConfig, n: int, base: Evaluation, result: LocateResult, k: int,
            spent: list[Evaluation]) -> Widen:
    """``widen(cap)`` for :func:`~capsense.localize.refine.refine`: None when measure-and-choose has K +
    ``SWAPS_PER_ROUND`` candidates (:func:`refine_candidates`: clean heads measured alone, and heads never
    measured alone when fewer than K are clean), else the extra singles (at most ``cap``; their evaluations added to
    ``spent``) and the candidates and singles afterwards. ``base``: the clean evaluation refine's sets
    are measured against (the same model and precision)."""
    wanted = k + SWAPS_PER_ROUND

    def widen(cap: int) -> Widening | None:
        if len(refine_candidates(result, k, cfg.task)) >= wanted:  # something to swap in (clean or never measured)
            return None
        clean = clean_measured(result)
        before, order, heads = len(clean), unmeasured_by_estimate(result, cfg.task), []
        while len(clean) < wanted and len(heads) < min(cap, len(order)):
            batch = order[len(heads): len(heads) + min(wanted - len(clean), cap - len(heads))]
            spent.extend(measure_alone(runner, cfg, n, base, result, batch))
            heads += batch
            clean = clean_measured(result)
        ranking = refine_candidates(result, k, cfg.task)
        return Widening(before, wanted, cap, heads, [h for h in heads if h in set(clean)], ranking,
                        single_effects(result, cfg, ranking))

    return widen

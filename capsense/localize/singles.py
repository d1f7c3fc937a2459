"""Knockouts scored on the target, then on the controls until the first beyond its threshold: a single
until the collateral screen excludes the head (:data:`~capsense.localize.screen.SINGLE_CONTROLS`), and a
measure-and-choose set until the first control beyond the search's bound (``set_controls`` until-beyond,
:data:`~capsense.localize.refine.SET_CONTROLS`).

One control beyond its threshold sets a head aside whatever the others say, and with the attribution's
estimates the thresholds are known before any knockout (:func:`screen_thresholds`: their spread is each
control's noise). So a single is scored on the target, then on the controls cheapest first (their share of
the run's tokens), each control on the heads no earlier one excluded: the screen sets aside the same heads,
and a collateral head costs the target and a cheap control or two instead of every control. Both the
search's singles (:func:`capsense.localize.guided.measure_sets`) and measure-and-choose's extra singles
(:func:`capsense.localize.pool.measure_alone`) are measured this way; so are measure-and-choose's sets after the
first, by default (:func:`capsense.localize.choice.refine_ranking`), with the search's bound as every control's threshold
(:meth:`capsense.localize.head_sets.MeasuredSets.beyond`).

Since round 45 a single's target takes its place among the controls by its own token share (``single_controls``
cheapest-first, the default): the exclusion never reads the target, so a head that a control cheaper than the target
sets aside costs that control alone. On the main job the target (induction, 24 documents) is dearer than 8 of its 10
controls, and 11 of 16 singles, 9 of them in layers 0-2 where a knockout runs nearly every layer, were set aside by
the cheapest one or two. The price is the set-aside heads' target effects (blank in ``heads.json``; the selective fit
takes attribution's estimate there, as for their unscored controls). Measure-and-choose's sets stay target first:
the choice reads a set's target damage, and the first set is scored on every probe in one call.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import numpy as np

from capsense.localize.config import LocateConfig
from capsense.localize.designs import head_set_masks
from capsense.localize.evaluator import MaskRunner
from capsense.localize.fit import damage
from capsense.localize.screen import collateral_screen
from capsense.localize.store import Evaluation, join_probes


def screen_settings(cfg: LocateConfig) -> dict[str, float]:
    """The run's screen settings (:func:`~capsense.localize.screen.collateral_screen`'s ``z`` and ``floor``: the
    refine tolerance over the set size), one rule for the screen and the thresholds a single stops at."""
    return {"z": cfg.screen, "floor": cfg.tolerance / max(1, cfg.top_k)}


def screen_thresholds(cfg: LocateConfig, estimates: dict[str, np.ndarray]) -> dict[str, float]:
    """Per control the threshold the run's screen (:func:`capsense.localize.pool.screen_of`) applies, from the
    attribution's ``estimates`` alone: known before any head is measured."""
    n = len(estimates[cfg.task])
    return collateral_screen({c: np.full(n, np.nan) for c in cfg.controls}, **screen_settings(cfg),
                             spread=estimates).threshold


def controls_until_beyond(run: MaskRunner, cfg: LocateConfig, n: int, singles: Sequence[tuple[int, ...]],
                          base: Evaluation, thresholds: dict[str, float], round_index: int = 0,
                          target_first: bool = True) -> list[Evaluation]:
    """``singles`` (head sets: one head each, or measure-and-choose's sets) knocked out on the target, then on the
    controls cheapest first (ties in the listed order), each control on the sets no earlier control put beyond its
    ``thresholds`` (relative damage against ``base``). ``target_first`` False (``single_controls`` cheapest-first):
    the target takes its place among the controls by its own token share (first on a tie), so only the sets no cheaper
    control put beyond its threshold are scored on it; a set put aside before it has no target score.
    One evaluation per head, holding the scores of the probes it was scored on, at the index of its first call's
    (:func:`~capsense.localize.store.join_probes`); the store keeps one per call (each probe's masks a block),
    so a resumed run replays the same calls from the same scores. Only the first call moves the progress bar:
    the later ones complete evaluations already counted."""
    share = getattr(run.evaluate, "token_share", None)
    price = (lambda p: share([p])) if share is not None else (lambda p: 0.0)  # (without shares: the listed order)
    controls = sorted(cfg.controls, key=price)
    # (sorted is stable: the target goes first on a tie)
    order = [cfg.task, *controls] if target_first else sorted([cfg.task, *controls], key=price)
    evs: list[Evaluation] = []
    live = list(singles)
    for i, p in enumerate(order):
        if not live:
            break
        with run.uncounted() if i else nullcontext():
            got = run(head_set_masks(live, n), round_index, probes=[p])
        evs += got
        if p != cfg.task:
            live = [h for h, e in zip(live, got) if not damage([e], p, cfg, base)[0] > thresholds[p]]
    return join_probes(evs)

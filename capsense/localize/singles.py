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
"""

from __future__ import annotations

from collections.abc import Sequence

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
                          base: Evaluation, thresholds: dict[str, float], round_index: int = 0) -> list[Evaluation]:
    """``singles`` (head sets: one head each, or measure-and-choose's sets) knocked out on the target, then on the
    controls cheapest first (ties in the listed order), each control on the sets no earlier control put beyond its
    ``thresholds`` (relative damage against ``base``).
    One evaluation per head, holding the scores of the probes it was scored on, at the index of its target's
    (:func:`~capsense.localize.store.join_probes`); the store keeps one per call (each control's masks a block),
    so a resumed run replays the same calls from the same scores. Only the target's calls move the progress bar:
    the controls complete evaluations already counted."""
    evs = run(head_set_masks(list(singles), n), round_index, probes=[cfg.task])
    share = getattr(run.evaluate, "token_share", None)
    order = sorted(cfg.controls, key=lambda c: share([c])) if share is not None else list(cfg.controls)
    live = list(singles)
    with run.uncounted():
        for c in order:
            if not live:
                break
            got = run(head_set_masks(live, n), round_index, probes=[c])
            evs += got
            live = [h for h, e in zip(live, got) if not damage([e], c, cfg, base)[0] > thresholds[c]]
    return join_probes(evs)

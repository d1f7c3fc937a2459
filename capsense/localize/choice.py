"""What a run hands on, after its search: the false-negative report, the collateral screen and
measure-and-choose, in that order (each reads the search's result; only refine evaluates masks).

* :func:`coverage_step`: the heads never measured alone and a bound on what they hide
  (:mod:`capsense.localize.coverage`);
* :func:`screen_step`: heads whose knockout hurts a control beyond its noise are set aside
  (:mod:`capsense.localize.screen`);
* :func:`refine_ranking`: the K-set measured on the run's documents, starting from the set the
  single-head effects predict (:mod:`capsense.localize.refine`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from capsense.core.arch import HeadLayout
from capsense.core.heads import Head
from capsense.localize.config import LocateConfig
from capsense.localize.coverage import coverage
from capsense.localize.evaluator import MaskRunner
from capsense.localize.fit import LocateResult, damage, put_last
from capsense.localize.methods import refine_budget
from capsense.localize.refine import Refinement, Singles, head_set_masks, refine
from capsense.localize.screen import collateral_screen
from capsense.localize.store import REFINE_ROUND, Evaluation


def refine_ranking(run: MaskRunner, cfg: LocateConfig, n: int, base: Evaluation, ranking: Sequence[int],
                   singles: Singles | None = None) -> tuple[Refinement, list[Evaluation]]:
    """Measure and choose the top-K set on the run's documents (see :mod:`capsense.localize.refine`),
    starting from the set ``singles`` predict best when given."""
    spent: list[Evaluation] = []

    def measure(sets: list[tuple[int, ...]]) -> list[tuple[float, dict[str, float]]]:
        evs = run(head_set_masks(sets, n), REFINE_ROUND)
        spent.extend(evs)
        return [
            (float(damage([e], cfg.task, cfg, base)[0]),
             {c: float(damage([e], c, cfg, base)[0]) for c in cfg.controls})
            for e in evs
        ]

    k = min(cfg.top_k, n, len(ranking))
    found = refine(ranking, k, measure, budget=refine_budget(cfg), tolerance=cfg.tolerance, singles=singles)
    return found, spent


def estimates_in_metric(result: LocateResult, cfg: LocateConfig) -> dict[str, np.ndarray] | None:
    """Attribution's estimates where they are in the run's damage unit (relative nll: the run ranks by
    nll), else None: an nll estimate says nothing of an accuracy drop's size."""
    return result.estimates if cfg.metric == "nll" else None


def single_effects(result: LocateResult, cfg: LocateConfig, heads: Sequence[int]) -> Singles:
    """Per head its single-head damage on the target and every control, as the run knows it: measured
    (or a regression's effect) where there is one, else attribution's estimate when it is in the run's
    unit (:func:`estimates_in_metric`), else none (the prediction then counts the head as harmless)."""
    est = estimates_in_metric(result, cfg)

    def value(effects: np.ndarray, task: str, h: int) -> float:
        v = float(effects[h])
        if np.isfinite(v):
            return v
        return float(est[task][h]) if est is not None and task in est else 0.0

    return {int(h): (value(result.target_effect, cfg.task, h),
                     {c: value(result.control_effects[c], c, h) for c in cfg.controls}) for h in heads}


def refine_candidates(result: LocateResult, k: int, task: str) -> list[int]:
    """The ranking measure-and-choose draws from: without the heads the screen set aside, the clean
    heads measured alone first, then (only to fill the set, when fewer than ``k`` are clean) heads
    never knocked out alone, by their estimated target effect. Unmeasured heads used to follow in
    index order: swapping them in cost full forwards from layer 0 and handed on unscreened early
    heads (seen on SmolLM2 with prior-guided)."""
    ranking = result.screen.clean(result.scores.rank) if result.screen is not None else [int(h) for h in result.scores.rank]
    measured = [h for h in ranking if np.isfinite(result.target_effect[h])]
    if len(measured) >= k:
        return measured
    rest = [h for h in ranking if h not in set(measured)]
    est = (result.estimates or {}).get(task)
    if est is not None:
        rest = sorted(rest, key=lambda h: -float(est[h]))
    return measured + rest


def coverage_step(cfg: LocateConfig, result: LocateResult, evals: list[Evaluation], layout: HeadLayout,
                  log: Callable[[str], None]) -> None:
    """What the search did not measure alone, and a bound on how much target effect hides there
    (:mod:`capsense.localize.coverage`); read from the search's evaluations, before refine."""
    est = (estimates_in_metric(result, cfg) or {}).get(cfg.task)
    rest = evals[1:]
    result.coverage = coverage([e.heads for e in rest], damage(rest, cfg.task, cfg, evals[0]) if rest else [],
                               layout.n_total, min(cfg.top_k, layout.n_total), est)
    log("coverage: " + result.coverage.summary(lambda h: str(Head.from_index(h, layout.n_heads))))


def screen_step(cfg: LocateConfig, result: LocateResult, layout: HeadLayout, log: Callable[[str], None]) -> None:
    """The collateral screen (:mod:`capsense.localize.screen`) on the heads measured alone: excluded
    heads rank after every clean head, whatever their target effect. Costs no evaluation: every
    mask was scored on the controls already."""
    result.screen = collateral_screen(result.control_effects, z=cfg.screen, floor=cfg.tolerance / max(1, cfg.top_k),
                                      spread=result.estimates)
    result.scores = put_last(result.scores, sorted(result.screen.excluded))
    if result.screen.excluded:
        name = lambda h: str(Head.from_index(h, layout.n_heads))  # noqa: E731
        worst = sorted(result.screen.excluded.items(), key=lambda kv: -kv[1][1])
        log(f"screen: {len(worst)} head(s) set aside for collateral damage: "
            + ", ".join(f"{name(h)} ({c} {100 * d:+.1f}%)" for h, (c, d) in worst[:8]) + (" ..." if len(worst) > 8 else ""))

"""What a run hands on, after its search: the false-negative report, the collateral screen and
measure-and-choose, in that order (each reads the search's result; only refine evaluates masks).

* :func:`coverage_step`: the heads never measured alone and a bound on what they hide
  (:mod:`capsense.localize.coverage`);
* :func:`screen_step`: heads whose knockout hurts a control beyond its noise are set aside
  (:mod:`capsense.localize.screen`);
* :func:`refine_ranking`: the K-set measured on the run's documents, starting from the set the
  single-head effects predict (:mod:`capsense.localize.refine`), from the candidates of
  :mod:`capsense.localize.pool` (which measures more heads alone when too few are clean).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from capsense.core.arch import HeadLayout
from capsense.core.heads import Head
from capsense.localize.config import LocateConfig
from capsense.localize.coverage import coverage
from capsense.localize.evaluator import MaskRunner
from capsense.localize.fit import LocateResult, damage, put_last
from capsense.localize.methods import refine_budget
from capsense.localize.pool import estimates_in_metric, screen_of
from capsense.localize.refine import Refinement, Singles, Widen, head_set_masks, refine
from capsense.localize.store import REFINE_ROUND, Evaluation


def refine_ranking(run: MaskRunner, cfg: LocateConfig, n: int, base: Evaluation, ranking: Sequence[int],
                   singles: Singles | None = None, widen: Widen | None = None) -> tuple[Refinement, list[Evaluation]]:
    """Measure and choose the top-K set on the run's documents (see :mod:`capsense.localize.refine`),
    starting from the set ``singles`` predict best when given; ``widen`` may measure more heads alone
    (:func:`capsense.localize.pool.widener`: its evaluations are its own to report, not these)."""
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
    found = refine(ranking, k, measure, budget=refine_budget(cfg), tolerance=cfg.tolerance, singles=singles, widen=widen)
    return found, spent


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
    result.screen = screen_of(cfg, result)
    result.scores = put_last(result.scores, sorted(result.screen.excluded))
    if result.screen.excluded:
        name = lambda h: str(Head.from_index(h, layout.n_heads))  # noqa: E731
        worst = sorted(result.screen.excluded.items(), key=lambda kv: -kv[1][1])
        log(f"screen: {len(worst)} head(s) set aside for collateral damage: "
            + ", ".join(f"{name(h)} ({c} {100 * d:+.1f}%)" for h, (c, d) in worst[:8]) + (" ..." if len(worst) > 8 else ""))

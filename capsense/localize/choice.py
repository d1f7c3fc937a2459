"""What a run hands on, after its search: the false-negative report, the collateral screen and
measure-and-choose, in that order (each reads the search's result; only refine evaluates masks).

* :func:`coverage_step`: the heads never measured alone and a bound on what they hide
  (:mod:`capsense.localize.coverage`);
* :func:`screen_step`: heads whose knockout hurts a control beyond its noise are set aside
  (:mod:`capsense.localize.screen`);
* :func:`refine_ranking`: the K-set measured on the run's documents, starting from the set the
  single-head effects predict (:mod:`capsense.localize.refine`), from the candidates of
  :mod:`capsense.localize.pool` (which measures more heads alone when too few are clean);
* :func:`chosen_accuracy`: what the chosen set does to the target's accuracy when it was chosen by a loss
  (:func:`metric_note`: before the search, what ``nll`` scores on a multiple-choice target).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from capsense.core.arch import HeadLayout
from capsense.core.heads import Head
from capsense.localize.config import LocateConfig
from capsense.localize.coverage import coverage
from capsense.localize.designs import head_set_masks
from capsense.localize.evaluator import MaskRunner
from capsense.localize.fit import LocateResult, damage, estimates_in_units, put_last
from capsense.localize.head_sets import LazyControls, Singles
from capsense.localize.methods import refine_budget
from capsense.localize.pool import screen_of
from capsense.localize.refine import Refinement, Widen, refine
from capsense.localize.singles import controls_until_beyond
from capsense.localize.store import REFINE_ROUND, Evaluation, join_probes
from capsense.scoring import GRADIENT_METRICS


def refine_ranking(run: MaskRunner, cfg: LocateConfig, n: int, base: Evaluation, ranking: Sequence[int],
                   singles: Singles | None = None, widen: Widen | None = None) -> tuple[Refinement, list[Evaluation]]:
    """Measure and choose the top-K set on the run's documents (see :mod:`capsense.localize.refine`),
    starting from the set ``singles`` predict best when given; ``widen`` may measure more heads alone
    (:func:`capsense.localize.pool.widener`: its evaluations are its own to report, not these). With
    ``set_controls`` until-beyond a set's controls are scored cheapest first until the first beyond the search's bound
    (:func:`~capsense.localize.singles.controls_until_beyond`), the rest only where the choice needs them; the
    evaluations returned then hold one per set, its calls joined (:func:`~capsense.localize.store.join_probes`)."""
    spent: list[Evaluation] = []
    lazy = cfg.sets_until_beyond

    def dmg(e: Evaluation, task: str) -> float:
        return float(damage([e], task, cfg, base)[0])

    def measure(sets: list[tuple[int, ...]], beyond: float = float("inf")) -> list[tuple[float, dict[str, float]]]:
        if beyond < float("inf"):
            evs = controls_until_beyond(run, cfg, n, sets, base, dict.fromkeys(cfg.controls, beyond), REFINE_ROUND)
        else:
            evs = run(head_set_masks(sets, n), REFINE_ROUND)
        spent.extend(evs)
        return [(dmg(e, cfg.task), {c: dmg(e, c) for c in cfg.controls if c in e.scores}) for e in evs]

    def rest(heads: tuple[int, ...], missing: list[str]) -> dict[str, float]:
        with run.uncounted():  # (the set was counted when its target was scored)
            evs = run(head_set_masks([heads], n), REFINE_ROUND, probes=missing)
        spent.extend(evs)
        return {c: dmg(evs[0], c) for c in missing}

    k = min(cfg.top_k, n, len(ranking))
    found = refine(ranking, k, measure, budget=refine_budget(cfg), tolerance=cfg.tolerance, singles=singles, widen=widen,
                   search=cfg.resolved_refine_search, lazy=LazyControls(tuple(cfg.controls), measure, rest) if lazy else None)
    return found, join_probes(spent) if lazy else spent


def coverage_step(cfg: LocateConfig, result: LocateResult, evals: list[Evaluation], layout: HeadLayout,
                  log: Callable[[str], None]) -> None:
    """What the search did not measure alone, and a bound on how much target effect hides there
    (:mod:`capsense.localize.coverage`); read from the search's evaluations, before refine."""
    est = (estimates_in_units(cfg, result.estimates) or {}).get(cfg.task)
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


#: The relative fall in the target's accuracy below which an nll-chosen set's damage "does not show as accuracy":
#: validation's tolerance (capsense.evaluation.selectivity.DEFAULT_TOLERANCE).
ACCURACY_SHOWS = 0.10


def chosen_accuracy(cfg: LocateConfig, evals: list[Evaluation], chosen: list[int]) -> dict[str, Any] | None:
    """The target's accuracy on the run's documents, clean (in refine's precision: the last clean evaluation) and
    under the ``chosen`` set, when the run chose by a loss (``nll``, ``choice_nll``) and the clean model gets some
    right; ``nll_only`` when the set's accuracy falls less than :data:`ACCURACY_SHOWS` (relative). Round 27: on a
    multiple-choice target, where ``nll`` scores the gold choice alone, a set did +90% nll and left accuracy at 0.92
    of 1.00 on the run's documents, 1.00 held out (RESULTS-locate.md): the log and report say so instead of leaving
    it to validation, and name ``choice_nll`` (the choice itself) for a multiple-choice target scored by ``nll``."""
    if cfg.metric not in GRADIENT_METRICS:
        return None
    clean = next((e for e in reversed(evals) if not e.heads), None)
    under = next((e for e in reversed(evals) if set(e.heads) == set(chosen)), None)
    if clean is None or under is None or not clean.scores[cfg.task].get("acc"):
        return None
    a0, a1 = clean.scores[cfg.task]["acc"], under.scores[cfg.task]["acc"]
    return {"clean": round(a0, 4), "chosen": round(a1, 4), "nll_only": bool((a0 - a1) / a0 < ACCURACY_SHOWS),
            "metric": cfg.metric, "choices": "choice_nll" in clean.scores[cfg.task]}


def metric_note(cfg: LocateConfig, target) -> str | None:
    """Before the search, for a multiple-choice ``target`` probe scored by ``nll``: what that scores, and the metric
    that scores the choice (measured on round 27's plural task, RESULTS-locate.md round 28: over a run's 48
    evaluations, Spearman with the accuracy fall 0.63 for the gold nll, 0.89 for ``choice_nll``)."""
    if cfg.metric != "nll" or target.kind != "multiple_choice":
        return None
    return (f"note: {cfg.task} is multiple choice and nll scores its gold choice alone, not whether it still wins; "
            "metric choice_nll scores the choice (the gold choice's share of its document's choices)")


def accuracy_line(acc: dict[str, Any]) -> str:
    """The log's and report's sentence for :func:`chosen_accuracy`."""
    line = f"the chosen set takes the target's accuracy on the run's documents from {acc['clean']:.3f} to {acc['chosen']:.3f}"
    if not acc["nll_only"]:
        return line
    metric = acc.get("metric", "nll")
    line += f", less than {100 * ACCURACY_SHOWS:.0f}% down: its {metric} damage does not show as accuracy here"
    if metric == "nll":
        line += (" (nll scores how likely the reference is, not whether it still wins: on a multiple-choice target, "
                 "the gold choice alone" + ("; metric choice_nll scores the choice" if acc.get("choices") else "") + ")")
    return line + "; validate before relying on it"


def shortfall(ref: Refinement) -> str | None:
    """One plain sentence when no measured set is within tolerance (None when the chosen one is): the set
    handed on is then the one that damages the controls least among those doing at least half the largest
    target damage measured (:func:`~capsense.localize.refine.choose`), not a selective set; log and report say so
    in these words, and why the search ended (its budget, and since which set the choice stood, or its
    candidates).

    Measured on Gemma 3 270M induction (round 20, 24 sets): every set that hurt the target hurt a control by
    more than 3%, and the least-damaging one (target +8.7%, categories +26.1%) left held-out induction accuracy
    untouched; the line before this one only said "tolerance 3.0%". Round 29 (six SmolLM2 runs, float32, with
    no set within tolerance): four spent their 24 sets, their choices standing since the 12th to the 22nd; two
    ran out of candidates after 11 and 13. So the line says which, and since which set the choice stood."""
    q = ref.quality
    if q.feasible:
        return None
    why = {"budget": f"; the budget ran out with the choice unchanged since set {ref.settled}",
           "candidates": "; every candidate was tried"}.get(ref.stopped, "")
    return (f"NO measured set is within tolerance ({len(ref.measured)} measured{why}): every one worsens a control by "
            f"more than {100 * q.tolerance:.1f}%; the set handed on damages the controls least among those doing at "
            f"least half the largest target damage measured ({q.worst()} {100 * q.control:+.1f}%, target "
            f"{100 * q.target:+.1f}%) and is NOT a selective set: its target's heads serve the controls too; "
            "validate before relying on it, or raise the refine budget or the tolerance")

"""From evaluated masks to a ranking: scores per mask, damage, and the fits a method hands on.

* :func:`fit_target`: the vector a solver fits (the target score, residualized on the
  controls in selective mode);
* :func:`fit_regression`: a sparse regression over random masks (cs, thompson's effects);
* :func:`fit_single_heads`: measured single-head knockouts (exhaustive, greedy).

Both fits return a :class:`LocateResult`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from capsense.core.tables import relative_change
from capsense.localize.config import LocateConfig
from capsense.localize.coverage import Coverage
from capsense.localize.refine import Refinement
from capsense.localize.screen import Screen
from capsense.localize.solvers import HeadScores, make_solver, residualize, ridge_effects, standardize
from capsense.localize.store import Evaluation
from capsense.scoring import GRADIENT_METRICS


@dataclass
class LocateResult:
    """What a run found: ranked head scores (fitted), raw-target scores and per-task damage."""

    scores: HeadScores
    raw_scores: HeadScores | None
    target_effect: np.ndarray
    control_effects: dict[str, np.ndarray]
    n_evaluations: int
    base: dict[str, dict[str, float]]
    seconds_per_mask: float
    refinement: Refinement | None = None
    estimates: dict[str, np.ndarray] | None = None  # attribution's estimated effect per task (relative)
    forward_equivalents: float = 0.0
    screen: Screen | None = None  # the collateral screen of a selective run
    coverage: Coverage | None = None  # the heads not measured alone and a bound on what they hide
    pool_singles: list[int] = field(default_factory=list)  # measured alone after the search, for refine (pool.py)
    # the target's accuracy on the run's documents, clean and under the chosen set (refine's precision), when the
    # run chose by a loss: {"clean": ..., "chosen": ..., "nll_only": whether its damage did not show as accuracy,
    # "metric": that loss, "choices": whether the target has choice_nll (multiple choice)}
    chosen_accuracy: dict[str, Any] | None = None


def design_matrix(evals: Sequence[Evaluation], n: int) -> np.ndarray:
    """The 0/1 knockout matrix ``[len(evals), n]`` of the evaluated masks."""
    X = np.zeros((len(evals), n), dtype=bool)
    for i, e in enumerate(evals):
        X[i, e.heads] = True
    return X


def task_scores(evals: Sequence[Evaluation], task: str, cfg: LocateConfig) -> np.ndarray:
    """Score per mask of ``task`` by its metric, signed so that higher = better (``-nll``, ``acc``); NaN for a
    mask not scored on ``task`` (a group scored on the target alone, a single the screen set aside before
    its other controls: :func:`capsense.localize.singles.controls_until_beyond`)."""
    metric = cfg.metric_for(task)
    v = np.array([e.scores[task][metric] if task in e.scores else np.nan for e in evals], dtype=float)
    return v if cfg.higher_is_better(task) else -v


def damage(evals: Sequence[Evaluation], task: str, cfg: LocateConfig, base: Evaluation) -> np.ndarray:
    """Relative worsening of ``task``'s metric per mask vs the clean model (+0.2 = 20% worse).

    Where the relative change is undefined (a clean score of 0) it is the plain drop.
    """
    s, s0 = task_scores(evals, task, cfg), float(task_scores([base], task, cfg)[0])
    # signed scores: a drop is damage whichever way the metric points
    rel = [relative_change(s0, float(x)) for x in s]
    return np.array([s0 - x if r is None else -r for x, r in zip(s, rel)], dtype=float)


def fit_target(evals: Sequence[Evaluation], cfg: LocateConfig, n: int, selective: bool = True,
               fill: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """The vector the solver fits: the target score, residualized on the controls when selective
    (``evals[0]`` the clean model). A single not scored on a control counts there as ``fill`` says (per control,
    each head's relative damage: attribution's estimate), else as harmless: the rule measure-and-choose's
    prediction follows (:func:`capsense.localize.pool.single_effects`). So does a single not scored on the target
    (set aside before it: ``single_controls`` cheapest-first) where ``fill`` has the target (the caller gives it only in
    the target's unit, :func:`estimates_in_units`: :func:`fit_single_heads` leaves such singles out otherwise)."""
    y = task_scores(evals, cfg.task, cfg)
    if fill is not None and cfg.task in fill:
        y = filled_scores(evals, cfg.task, cfg, fill[cfg.task])
    if selective and cfg.controls:
        C = np.column_stack([filled_scores(evals, c, cfg, (fill or {}).get(c)) for c in cfg.controls])
        y = residualize(y, C)
    return y


def estimates_in_units(cfg: LocateConfig, estimates: dict[str, np.ndarray] | None) -> dict[str, np.ndarray] | None:
    """Attribution's ``estimates`` (per probe, each head's relative nll change; the target's ``choice_nll`` under that
    metric) of the probes the run scores by what they estimate (:meth:`LocateConfig.metric_for` a gradient metric):
    the only ones that may stand in for a damage the run did not measure. None without estimates. (The attribution's
    methods refuse a metric without a gradient, so in a run that has estimates every probe qualifies today; the
    rule is per probe so that a control scored by accuracy would never take an nll estimate for its damage.)"""
    if estimates is None:
        return None
    return {t: v for t, v in estimates.items() if cfg.metric_for(t) in GRADIENT_METRICS}


def filled_scores(evals: Sequence[Evaluation], task: str, cfg: LocateConfig, fill: np.ndarray | None) -> np.ndarray:
    """:func:`task_scores` with a single not scored on ``task`` given the score of its ``fill`` damage (its head's
    entry; None or a group: the clean score, ``evals[0]``'s)."""
    s = task_scores(evals, task, cfg)
    for i in np.flatnonzero(~np.isfinite(s)):
        heads = evals[i].heads
        d = float(fill[heads[0]]) if fill is not None and len(heads) == 1 and np.isfinite(fill[heads[0]]) else 0.0
        s[i] = s[0] - d * abs(s[0])  # damage d = (s0 - s) / |s0|, as damage() computes it
    return s


def single_head_scores(evals: Sequence[Evaluation], y: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Importance from single-head evaluations: standardized score drop vs the clean model
    (``evals[0]``); heads never knocked out alone rank last with confidence 0."""
    z = standardize(y)
    imp = np.full(n, np.nan)
    for e, zi in zip(evals, z):
        if len(e.heads) == 1:
            imp[e.heads[0]] = z[0] - zi
    seen = ~np.isnan(imp)
    imp[~seen] = (np.nanmin(imp) - 1) if seen.any() else 0.0
    return imp, seen.astype(float)


def fit_regression(evals: list[Evaluation], cfg: LocateConfig, n: int) -> LocateResult:
    """Rank heads by a sparse regression (``cfg.solver``) over every evaluated mask; per-head
    effects by ridge regression of each task's damage."""
    X = design_matrix(evals, n)
    scores = make_solver(cfg.solver, cfg.alpha, cfg.seed).fit(X, fit_target(evals, cfg, n)).scores_
    raw = make_solver(cfg.solver, cfg.alpha, cfg.seed).fit(X, fit_target(evals, cfg, n, False)).scores_ if cfg.controls else None
    effects = {t: ridge_effects(X, damage(evals, t, cfg, evals[0])) for t in cfg.tasks}
    return _result(evals, cfg, scores, raw, effects)


def fit_single_heads(evals: list[Evaluation], cfg: LocateConfig, n: int,
                     fill: dict[str, np.ndarray] | None = None) -> LocateResult:
    """Rank heads by their measured single-head knockouts (``evals[0]`` is the clean model); an effect
    not measured is NaN (``fill``: what the selective fit assumes there, :func:`fit_target`). A single the
    collateral screen set aside before its target was scored (``single_controls`` cheapest-first) keeps its control
    effects, a NaN target effect, and its place in the fit with ``fill``'s target entry (the screen ranks it last).
    Left out of the fit instead, as first built, it moved the clean heads' order: SmolLM2's main job and arithmetic
    (round 45, replayed from recorded runs) lost 11 and 4 of their 16 points, and the residualization on 10 and 9
    controls then fitted the few left (arithmetic's clean top 5 shared 3 heads with the target-first fit's; with the
    fill, 4, and the main job's 5 in the same order). Without a target entry in ``fill`` it stays out."""
    base = evals[0]
    sel = [base, *(e for e in evals if len(e.heads) == 1)]
    effects = {t: np.zeros(n) for t in cfg.tasks}
    for t in cfg.tasks:
        for e, v in zip(sel[1:], damage(sel, t, cfg, base)[1:]):
            effects[t][e.heads[0]] = v
    if fill is None or cfg.task not in fill:
        sel = [base, *(e for e in sel[1:] if cfg.task in e.scores)]
    imp, conf = single_head_scores(sel, fit_target(sel, cfg, n, fill=fill), n)
    raw = None
    if cfg.controls:
        r_imp, r_conf = single_head_scores(sel, fit_target(sel, cfg, n, selective=False, fill=fill), n)
        raw = HeadScores(r_imp, r_conf, r_imp.copy())
    return _result(evals, cfg, HeadScores(imp, conf, imp.copy()), raw, effects)


def _result(evals: list[Evaluation], cfg: LocateConfig, scores: HeadScores, raw: HeadScores | None,
            effects: dict[str, np.ndarray]) -> LocateResult:
    secs = [e.seconds for e in evals if e.seconds > 0]
    return LocateResult(
        scores=scores,
        raw_scores=raw,
        target_effect=effects[cfg.task],
        control_effects={c: effects[c] for c in cfg.controls},
        n_evaluations=len(evals),
        base=evals[0].scores,
        seconds_per_mask=float(np.mean(secs)) if secs else 0.0,
    )


def put_first(scores: HeadScores, chosen: Sequence[int]) -> HeadScores:
    """The same scores, re-ranked so that ``chosen`` (in its order) leads."""
    imp = scores.importance
    top = np.nanmax(np.abs(imp[np.isfinite(imp)])) if np.isfinite(imp).any() else 0.0
    boost = np.zeros(len(imp))
    boost[list(chosen)] = np.arange(len(chosen), 0, -1) + top
    return HeadScores(imp + boost, scores.confidence, scores.marginal)


def put_last(scores: HeadScores, heads: Sequence[int]) -> HeadScores:
    """The same scores, re-ranked so that ``heads`` come after every other head (their own order kept)."""
    imp = scores.importance
    if not len(heads):
        return scores
    finite = imp[np.isfinite(imp)]
    span = (np.nanmax(finite) - np.nanmin(finite) + 1.0) if finite.size else 1.0
    low = np.nanmin(finite) if finite.size else 0.0
    out = imp.copy()
    idx = list(heads)
    out[idx] = np.where(np.isfinite(imp[idx]), imp[idx], low) - span
    return HeadScores(out, scores.confidence, scores.marginal)

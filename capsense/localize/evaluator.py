"""Evaluating knockout masks: scores on every probe (:class:`MaskEvaluator`), kept in the
run folder in order and replayed on resume (:class:`MaskRunner`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from capsense.localize.config import LocateConfig, LocateError
from capsense.localize.store import Evaluation, RunStore, RunStoreError
from capsense.scoring import METRICS
from capsense.scoring.probe import load_task

#: Scores of one mask: task -> metric -> value.
MaskScores = dict[str, dict[str, float]]


class MaskEvaluator:
    """Scores masks (flat head index sets) on every probe with one loaded model."""

    def __init__(self, model, probes: dict, batch_size: int, masks_per_forward: int, prefix_reuse: bool,
                 extra: dict | None = None) -> None:
        from capsense.core.arch import head_layout

        self.layout = head_layout(model)
        self.scorers = {
            name: scorer_class(probe, masks_per_forward, prefix_reuse)(
                model, probe, batch_size=batch_size, masks_per_forward=masks_per_forward)
            for name, probe in probes.items()
        }
        self.extra = dict(extra or {})  # task -> a scorer adding metrics (e.g. TaskMetricScorer)

    @property
    def reuse_share(self) -> float:
        """Share of the run's tokens scored with prefix reuse (the rest pays full forwards)."""
        from capsense.scoring.prefix import PrefixReuseScorer

        tokens = {name: sum(len(x) for x in s._inputs) for name, s in self.scorers.items()}
        reused = sum(t for name, t in tokens.items()
                     if isinstance(self.scorers[name], PrefixReuseScorer) and self.scorers[name].enabled)
        return reused / max(1, sum(tokens.values()))

    def cost(self, heads) -> float:
        """Forward-equivalents of evaluating one mask (flat head indices; :mod:`capsense.scoring.cost`)."""
        from capsense.scoring.cost import mask_cost

        return mask_cost(list(heads), self.layout.n_layers, self.layout.n_heads, self.reuse_share)

    def knockouts(self, masks: np.ndarray):
        """``masks`` [m, layers * heads] as a boolean tensor [m, layers, heads]."""
        import torch

        return torch.from_numpy(np.asarray(masks, dtype=bool).reshape(-1, self.layout.n_layers, self.layout.n_heads).copy())

    def __call__(self, masks: np.ndarray) -> list[MaskScores]:
        ko = self.knockouts(masks)
        per_task = {name: s.score(ko) for name, s in self.scorers.items()}
        for name, s in self.extra.items():
            per_task[name] = {**per_task.get(name, {}), **s.score(ko)}
        return [
            {name: {k: float(v[i]) for k, v in r.items()} for name, r in per_task.items()} for i in range(len(masks))
        ]


def scorer_class(probe, masks_per_forward: int, prefix_reuse: bool) -> type:
    """The fastest exact scorer for ``probe``: shared context for multiple choice, else prefix reuse."""
    from capsense.scoring.prefix import PrefixReuseScorer
    from capsense.scoring.probe import ProbeScorer
    from capsense.scoring.shared_context import SharedContextScorer, shared_context_groups

    if masks_per_forward > 1:
        return ProbeScorer
    if shared_context_groups(probe) is not None:  # multiple choice: each context once per mask
        return SharedContextScorer
    return PrefixReuseScorer if prefix_reuse else ProbeScorer


class MaskRunner:
    """Evaluates masks in order, reusing what the run folder already holds (resume)."""

    def __init__(self, store: RunStore, evaluate: Callable[[np.ndarray], list[MaskScores]], masks_per_forward: int,
                 bar: Any = None) -> None:
        self.store, self.evaluate = store, evaluate
        self.mpf = max(1, masks_per_forward)
        self.cursor = 0
        self.bar = bar
        self.forward_equivalents = 0.0  # of every mask this runner returned, stored or new
        self.extra_cost = 0.0  # forward-equivalents spent outside masks (gradient attribution)

    def _count(self, heads: list[int]) -> None:
        cost = getattr(self.evaluate, "cost", None)
        if cost is not None:
            self.forward_equivalents += cost(heads)

    def __call__(self, masks: np.ndarray, round_index: int = 0) -> list[Evaluation]:
        """The evaluations of ``masks`` (rows of flat 0/1 knockouts), stored ones first."""
        out: list[Evaluation] = []
        masks = np.atleast_2d(np.asarray(masks, dtype=bool))
        pending: list[np.ndarray] = []
        for mask in masks:
            if self.cursor + len(pending) < len(self.store.evaluations):
                out.append(self._stored(mask))
                continue
            pending.append(mask)
            if len(pending) == self.mpf:
                out.extend(self._flush(pending, round_index))
                pending = []
        if pending:
            out.extend(self._flush(pending, round_index))
        return out

    def _stored(self, mask: np.ndarray) -> Evaluation:
        ev = self.store.evaluations[self.cursor]
        if ev.heads != [int(h) for h in np.flatnonzero(mask)]:
            raise RunStoreError(
                f"mask {ev.index} in {self.store.path} knocks out other heads than this run's mask "
                f"{ev.index}: the settings or capsense changed; choose another --out"
            )
        self.cursor += 1
        self._count(ev.heads)
        return ev

    def _flush(self, masks: list[np.ndarray], round_index: int) -> list[Evaluation]:
        t0 = time.perf_counter()
        scores = self.evaluate(np.stack(masks))
        dt = (time.perf_counter() - t0) / len(masks)
        out = []
        for mask, sc in zip(masks, scores):
            ev = Evaluation(self.cursor, [int(h) for h in np.flatnonzero(mask)], sc, dt, round_index)
            self.store.append(ev)
            self.cursor += 1
            self._count(ev.heads)
            out.append(ev)
            if self.bar is not None:  # a phase of the run's display (capsense.core.progress)
                self.bar.label(f"{self.forward_equivalents + self.extra_cost:.1f} FE")
                self.bar.update(1)
        return out


def task_metric_scorers(cfg: LocateConfig, model, tokenizer, probes: dict) -> dict:
    """With ``metric`` one of the target task's own lm-eval metrics (not nll/acc): a scorer that
    runs the task through lm-eval under each mask on the probe's documents (faithful, slow).

    Sets ``cfg.task_metric_higher_is_better`` from the task.
    """
    from capsense.scoring.task_metric import TaskMetricScorer, resolve_task_metric

    if cfg.metric in METRICS:
        return {}
    task_obj = load_task(cfg.task, cfg.include_path, tokenizer)
    scorer = TaskMetricScorer(model, tokenizer, cfg.task, probes[cfg.task].doc_ids, None, cfg.metric,
                              batch_size=cfg.batch_size, include_path=cfg.include_path,
                              confirm_run_unsafe_code=cfg.confirm_run_unsafe_code)
    try:
        try:
            tm = resolve_task_metric(cfg.task, task_obj, cfg.metric)
        except ValueError:  # maybe a name a metric function reports at run time: run the clean model once
            tm = resolve_task_metric(cfg.task, task_obj, cfg.metric, reported=scorer.reported())
    except ValueError as e:
        raise LocateError(str(e)) from None
    scorer.metric = tm
    cfg.task_metric_higher_is_better = tm.higher_is_better
    return {cfg.task: scorer}

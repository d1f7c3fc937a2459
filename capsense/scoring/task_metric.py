"""Masks scored by a task's own lm-eval metric: generation under each mask (faithful, slow).

Probes (:mod:`capsense.scoring.probe`) score log-likelihood fast; a generation task's real metric
(GSM8K's ``exact_match`` after answer extraction, HumanEval's ``pass@1``) needs the model
to generate under the ablation. :class:`TaskMetricScorer` does exactly what ``lm_eval
--model capsense-masked`` does, on the run's documents, once per mask, with the model
locate already loaded (:func:`capsense.evaluation.evaluate.evaluate_head_sets`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from capsense.core.heads import HeadSet
from capsense.errors import CapsenseError


@dataclass(frozen=True)
class TaskMetric:
    """A task's metric as ``evaluate_head_sets`` labels it (``name`` or ``name,filter``)."""

    label: str
    higher_is_better: bool


def task_metrics(task_obj) -> dict[str, TaskMetric]:
    """Every metric label the task reports, with its direction."""
    cfg = task_obj.config
    filters = [f.get("name", "none") for f in (getattr(cfg, "filter_list", None) or [])] or ["none"]
    out: dict[str, TaskMetric] = {}
    for entry in getattr(cfg, "metric_list", None) or []:
        name = entry["metric"] if isinstance(entry["metric"], str) else getattr(entry["metric"], "__name__", str(entry["metric"]))
        hib = entry.get("higher_is_better")
        if hib is None:
            hib = _registry_direction(name)
        for f in filters:
            label = name if f == "none" else f"{name},{f}"
            out[label] = TaskMetric(label, bool(hib))
    return out


def _registry_direction(name: str) -> bool:
    try:
        from lm_eval.api.registry import is_higher_better

        value = is_higher_better(name)
    except Exception:  # unregistered metric: lm-eval itself assumes higher is better
        value = None
    return True if value is None else bool(value)


def resolve_task_metric(task: str, task_obj, metric: str, reported: Sequence[str] = ()) -> TaskMetric:
    """``metric`` (``exact_match`` or ``exact_match,flexible-extract``) among the task's own.

    ``reported``: labels an lm-eval run of the task reported; they add the names a metric
    function expands to at run time (HumanEval's ``pass_at_k`` reports ``pass@1``).
    """
    metrics = task_metrics(task_obj)
    for label in reported:
        if label not in metrics:
            name = label.split(",", 1)[0]
            hib = (task_obj.higher_is_better() or {}).get(name)
            metrics[label] = TaskMetric(label, _registry_direction(name) if hib is None else bool(hib))
    if metric in metrics:
        return metrics[metric]
    by_name = [m for label, m in metrics.items() if label.split(",", 1)[0] == metric]
    if by_name:
        return by_name[0]
    valid = ", ".join(metrics) or "none"
    choices = (", choice_nll (nats per document of the gold choice among the document's choices)"
               if getattr(task_obj, "OUTPUT_TYPE", None) == "multiple_choice" else "")
    raise CapsenseError(
        f"unknown `metric` {metric!r} for task {task!r}: valid metrics are nll (nats/token of the reference "
        f"continuation, the default), acc (greedy exact match or multiple-choice accuracy){choices} and the task's "
        f"own: {valid}"
    )


class TaskMetricScorer:
    """Scores masks by running the task through lm-eval under each one (same ``score`` API as probes)."""

    def __init__(self, model, tokenizer, task: str, doc_ids: Sequence[int], metric: TaskMetric | None, name: str,
                 batch_size: int = 16, include_path: Sequence[str] = (), confirm_run_unsafe_code: bool = False,
                 ablation: str = "zero", mean_reference: str | None = None, ablator=None) -> None:
        """``ablator``: the run's :class:`~capsense.core.ablation.HeadAblator` to share (its means computed once)."""
        from capsense.core.arch import head_layout
        from capsense.evaluation.lm_eval_model import CapsenseMaskedLM

        self.lm = CapsenseMaskedLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, ablation=ablation,
                                   mean_reference=mean_reference, ablator=ablator)
        self.layout = head_layout(model)
        self.task, self.metric, self.name = task, metric, name
        self.samples = {task: sorted(int(d) for d in doc_ids)}
        self.include_path = list(include_path)
        self.confirm = confirm_run_unsafe_code
        self._clean: dict[str, float] | None = None  # the clean model's metrics, kept from reported()

    def _run(self, heads: HeadSet) -> dict[str, float]:
        from capsense.evaluation.evaluate import evaluate_head_sets

        if not heads and self._clean is not None:
            return self._clean
        rows = evaluate_head_sets(self.lm, {"mask": heads}, [self.task], samples=self.samples,
                                  include_path=self.include_path, metrics=None, confirm_run_unsafe_code=self.confirm)
        return {r.metric: r.values["mask"] for r in rows}

    def reported(self) -> list[str]:
        """The metric labels lm-eval reports for the task (runs the clean model once, kept)."""
        self._clean = self._run(HeadSet())
        return list(self._clean)

    def score(self, knockouts) -> dict[str, np.ndarray]:
        """``{name: value per mask}`` for boolean ``knockouts`` [m, layers, heads]."""
        ko = np.asarray(knockouts, dtype=bool)
        values = []
        for grid in ko:
            heads = HeadSet.from_pairs([(int(l), int(h)) for l, h in zip(*np.nonzero(grid))])
            out = self._run(heads)
            got = [v for label, v in out.items() if label == self.metric.label]
            if not got:
                raise CapsenseError(f"lm-eval reported no {self.metric.label!r} for {self.task!r}: "
                                 f"it reported {', '.join(out)}")
            values.append(got[0])
        return {self.name: np.array(values, dtype=float)}

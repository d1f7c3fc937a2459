"""Evaluate one model under several head ablations with stock lm-eval tasks.

The model is loaded once as ``capsense-masked`` and its head set swapped between runs;
every number comes from lm-eval's own metrics for the task.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from capsense.core.heads import HeadSet
from capsense.tasks import task_manager


@dataclass
class MetricRow:
    task: str
    metric: str
    values: dict[str, float]  # label (e.g. "base", "ablated") -> value


def load_lm(model: str, ablation: str = "zero", batch_size: int = 16, device: str = "cpu", dtype: str = "float32",
            device_map: str | None = None, **kwargs: Any):
    """Build a ``capsense-masked`` LM once (no heads yet); ``device_map`` spreads it over devices
    (lm-eval's ``parallelize=True``; see :mod:`capsense.core.placement`)."""
    from capsense.core.placement import check_device, placement_kwargs
    from capsense.evaluation.lm_eval_model import CapsenseMaskedLM

    if device_map:
        placed = placement_kwargs(device_map)
        kwargs.update(parallelize=True, device_map=placed["device_map"], offload_folder=placed.get("offload_folder"))
    else:
        check_device(device)
    return CapsenseMaskedLM(
        pretrained=model, ablation=ablation, batch_size=batch_size, device=device, dtype=dtype, **kwargs
    )


def evaluate_head_sets(
    lm,
    head_sets: Mapping[str, HeadSet],
    tasks: Sequence[str],
    limit: int | None = None,
    samples: dict[str, list[int]] | None = None,
    include_path: Sequence[str] = (),
    metrics: Sequence[str] | None = None,
    confirm_run_unsafe_code: bool = False,
) -> list[MetricRow]:
    """Run ``tasks`` once per labelled head set; one row per (task, metric).

    Rows cover every metric lm-eval reports for the task (or those named in ``metrics``),
    under every filter: labelled ``name`` for the default filter, ``name,filter`` otherwise
    (GSM8K: ``exact_match,strict-match``, ``exact_match,flexible-extract``).
    """
    import lm_eval

    manager = task_manager(include_path, tasks, metadata={"tokenizer": lm.tokenizer})
    results: dict[str, dict[str, dict[str, float]]] = {}
    elsewhere = False  # lm-eval's data parallel (accelerate launch on GPUs) hands results to the main process only
    for label, heads in head_sets.items():
        lm.set_heads(heads)
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks),
            limit=limit,
            samples=samples,
            task_manager=manager,
            log_samples=False,
            verbosity="WARNING",
            confirm_run_unsafe_code=confirm_run_unsafe_code,
        )
        if out is None:
            elsewhere = True
            continue
        results[label] = out["results"]
    lm.set_heads(HeadSet())
    if elsewhere:
        return []
    rows = []
    for task in tasks:
        base = results[next(iter(head_sets))][task]
        for key, value in base.items():
            name, _, filt = key.partition(",")
            if not filt or name.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            if metrics is not None and name not in metrics:
                continue
            label = name if filt == "none" else key
            rows.append(MetricRow(task, label, {lab: float(results[lab][task][key]) for lab in head_sets}))
    return rows


def relative_change(base: float, value: float) -> float:
    """(value - base) / |base|, NaN when base is 0."""
    return (value - base) / abs(base) if base else math.nan


def format_table(rows: Sequence[MetricRow], base: str = "base") -> str:
    """A markdown table: task, metric, each label's value, and each label's change vs ``base``."""
    labels = list(rows[0].values) if rows else []
    others = [lab for lab in labels if lab != base]
    head = ["task", "metric", *labels, *(f"change ({lab})" for lab in others)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        vals = [f"{r.values[lab]:.4f}" for lab in labels]
        changes = [f"{100 * relative_change(r.values[base], r.values[lab]):+.1f}%" for lab in others]
        lines.append("| " + " | ".join([r.task, r.metric, *vals, *changes]) + " |")
    return "\n".join(lines)

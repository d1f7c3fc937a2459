"""Evaluate one model under several head ablations with stock lm-eval tasks.

The model is loaded once as ``capsense-masked`` and its head set swapped between runs;
every number comes from lm-eval's own metrics for the task.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from capsense.core.batching import check_batch_size, lm_eval_batch_size
from capsense.core.files import atomic_write_json, check_output_file
from capsense.core.heads import HeadSet
from capsense.core.model_config import config_head_layout
from capsense.core.models import check_model
from capsense.core.tables import format_percent, relative_change
from capsense.errors import CapsenseError
from capsense.localize.store import used_documents
from capsense.tasks import check_task_names, lm_eval_warnings_only, task_data_errors, task_manager


def check_limit(limit: int | None) -> None:
    """``limit`` (documents per task) is None or at least 1."""
    if limit is not None and limit < 1:
        raise CapsenseError(f"`limit` must be at least 1, got {limit}")


def check_evaluate(
    model: str, heads: str | None, top_k: int | None, tasks: Sequence[str], limit: int | None,
    include_path: Sequence[str] = (), out: str | os.PathLike | None = None, revision: str | None = None,
    ablation: str | None = None, mean_reference: str | os.PathLike | None = None,
) -> HeadSet:
    """Every check that needs neither torch nor lm-eval nor the model; returns the head set to ablate. ``revision``:
    the model's, resolved (:func:`~capsense.core.heads.located_revision`). ``top_k``, ``ablation`` and
    ``mean_reference`` say which heads are knocked out and how: without ``heads`` none is, and each is an error (until
    round 53 the model as is was evaluated without a word)."""
    given = [f"`{n}`" for n, v in (("top_k", top_k), ("ablation", ablation), ("mean_reference", mean_reference))
             if v is not None]
    if not heads and given:
        says = "says" if len(given) == 1 else "say"
        raise CapsenseError(f"{', '.join(given)} {says} which heads are knocked out and "
                            "how, and no `heads` are given (the model is evaluated as is): give `heads` or leave "
                            f"{'it' if len(given) == 1 else 'them'} out")
    head_set = HeadSet.parse(heads, top_k=top_k) if heads else HeadSet()
    check_limit(limit)
    check_output_file(out, (model, heads, mean_reference))
    check_task_names(tasks, include_path)
    check_model(model, revision)
    layout = config_head_layout(model, revision)
    if layout is not None:
        head_set.check_fits(layout)  # out-of-range heads, before the model loads
    return head_set


def run_evaluate(
    model: str, head_set: HeadSet, tasks: Sequence[str], *, ablation: str = "zero", mean_reference: str | None = None,
    limit: int | None = None, batch_size: int | str = 16, device: str = "cpu", device_map: str | None = None,
    dtype: str = "float32", include_path: Sequence[str] = (), out: str | os.PathLike | None = None,
    heads_file: str | os.PathLike | None = None, revision: str | None = None, progress: bool = True,
) -> tuple[str, list[Path]]:
    """Evaluate ``model`` as is and with ``head_set`` ablated (``ablation``: zero, or mean over ``mean_reference``'s
    texts, by default capsense's neutral prose); the markdown table and the files written. ``device_map`` spreads
    the model over devices (:func:`load_lm`); ``revision``: of a Hub model (resolved: the caller passes
    :func:`~capsense.core.heads.located_revision`'s). ``heads_file``: the heads file ``head_set`` came from; the table then
    says which evaluated documents its locate run scored (:func:`in_sample_lines`). ``progress`` False: a line per
    phase instead of a bar (:class:`~capsense.core.progress.RunProgress`), for logs."""
    check_batch_size(batch_size)
    task_manager(include_path, tasks)  # tasks only lm-eval knows fail before the model loads
    lm = load_lm(model, ablation=ablation, batch_size=batch_size, device=device, dtype=dtype, device_map=device_map,
                 mean_reference=mean_reference, revision=revision)
    sets = {"base": HeadSet()}
    if head_set:
        lm.set_heads(head_set)  # validates against the model before any evaluation
        named = str(head_set) if len(head_set) <= 6 else f"{len(head_set)} heads"
        sets[f"ablated ({named})" if ablation == "zero" else f"mean-ablated ({named})"] = head_set
    from capsense.core.progress import Phase, RunProgress

    display = RunProgress([Phase("evaluate", len(sets), "conditions")], enabled=progress)
    with display.phase("evaluate") as phase:
        rows = evaluate_head_sets(lm, sets, tasks, limit=limit, include_path=include_path, progress=phase)
    display.close()
    written = [atomic_write_json(out, [asdict(r) for r in rows])] if out else []
    notes = in_sample_lines(used_documents(heads_file), tasks, limit) if heads_file is not None else []
    return "\n".join([format_table(rows), *notes]), written


def in_sample_lines(used: Mapping[str, Sequence[int]], tasks: Sequence[str], limit: int | None) -> list[str]:
    """What to say under the table where the locate run behind the heads file scored documents evaluate evaluated
    (the first ``limit`` of each task, or all): there the ablated score is in-sample, the set chosen on those very
    documents, and only ``capsense validate`` (held-out documents, random sets) supports a selectivity claim."""
    counts = {t: sum(1 for d in used.get(t, ()) if limit is None or d < limit) for t in tasks}
    named = [f"{t} {n}" for t, n in counts.items() if n]
    if not named:
        return []
    return ["", f"In-sample: the locate run behind the heads file scored documents evaluated here ({', '.join(named)}"
                f"{'' if limit is None else f' of the first {limit}'}); for held-out numbers use capsense validate."]


@dataclass
class MetricRow:
    task: str
    metric: str
    values: dict[str, float]  # label (e.g. "base", "ablated") -> value
    higher_is_better: bool | None = None  # as the task declares the metric (None: not declared)


def load_lm(model: str, ablation: str = "zero", batch_size: int | str = 16, device: str = "cpu", dtype: str = "float32",
            device_map: str | None = None, revision: str | None = None, **kwargs: Any):
    """Build a ``capsense-masked`` LM once (no heads yet); ``device_map`` spreads it over devices
    (lm-eval's ``parallelize=True``; see :mod:`capsense.core.placement`); ``batch_size`` ``auto`` is lm-eval's
    own on GPUs, 16 on a CPU (:func:`capsense.core.batching.lm_eval_batch_size`); ``revision``: of a Hub model
    (None: its default branch)."""
    from capsense.core.placement import check_placement, placement_kwargs
    from capsense.core.progress import without_library_bars
    from capsense.evaluation.lm_eval_model import CapsenseMaskedLM

    check_placement(device, device_map)  # a device beside a map is refused, not ignored
    if device_map:
        placed = placement_kwargs(device_map)
        kwargs.update(parallelize=True, device_map=placed["device_map"], offload_folder=placed.get("offload_folder"))
    if revision:
        kwargs["revision"] = revision
    with without_library_bars():
        return CapsenseMaskedLM(
            pretrained=model, ablation=ablation, batch_size=lm_eval_batch_size(batch_size, device, device_map), device=device,
            dtype=dtype, **kwargs
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
    progress: Any = None,
    display_names: Mapping[str, str] | None = None,
    store: Any = None,
) -> list[MetricRow]:
    """Run ``tasks`` once per labelled head set; one row per (task, metric).

    ``store`` (a :class:`capsense.evaluation.conditions.ConditionStore`, opened): head sets it has finished are
    read from it, not evaluated again, and each one evaluated here is recorded in it as it ends.

    Rows cover every metric lm-eval reports for the task (or those named in ``metrics``),
    under every filter: labelled ``name`` for the default filter, ``name,filter`` otherwise
    (GSM8K: ``exact_match,strict-match``, ``exact_match,flexible-extract``).
    ``progress`` (a :class:`capsense.core.progress.PhaseProgress`) is labelled with each head
    set and advanced after it; lm-eval's own per-request bars are then off.
    """
    manager = task_manager(include_path, tasks, metadata={"tokenizer": lm.tokenizer})
    lm.quiet_requests = progress is not None
    from capsense.scoring.requests import quiet_request_building

    with quiet_request_building(progress is not None):
        results, direction = _run_conditions(lm, head_sets, tasks, manager, progress, display_names, store, limit=limit,
                                             samples=samples, confirm_run_unsafe_code=confirm_run_unsafe_code)
    lm.set_heads(HeadSet())
    lm.quiet_requests = False
    if results is None:  # lm-eval's data parallel (accelerate launch on GPUs): the main process has the results
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
            hib = direction.get(task, {}).get(name)
            rows.append(MetricRow(task, label, {lab: float(results[lab][task][key]) for lab in head_sets},
                                  None if hib is None else bool(hib)))
    return rows


def _run_conditions(lm, head_sets, tasks, manager, progress, display_names, store,
                    **kwargs: Any) -> tuple[dict[str, Any] | None, dict[str, dict[str, bool]]]:
    """lm-eval's results per head set (None on a process that lm-eval's data parallel gives none),
    and each task's metric directions (lm-eval's ``higher_is_better``); finished ones from ``store``."""
    import lm_eval

    results: dict[str, Any] = {}
    direction: dict[str, dict[str, bool]] = {}
    elsewhere = False
    for label, heads in head_sets.items():
        if progress is not None:
            progress.label((display_names or {}).get(label, label))
        out = None if store is None else store.get(label, str(heads))
        if out is None:
            lm.set_heads(heads)
            # (not verbosity=: lm-eval's handler would keep this moment's stderr)
            with lm_eval_warnings_only(), _git_hash_quietly(), task_data_errors(tasks):
                out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, log_samples=False,
                                              verbosity=None, **kwargs)
            if out is None:  # a process other than the main one under lm-eval's data parallel
                elsewhere = True
                continue
            if store is not None:
                store.put(label, str(heads), out["results"], out.get("higher_is_better") or {})
        results[label] = out["results"]
        direction.update(out.get("higher_is_better") or {})
        if progress is not None:
            progress.update()
    return (None if elsewhere else results), direction


@contextmanager
def _git_hash_quietly() -> Iterator[None]:
    """lm-eval's results record the git commit of the working directory (``git describe --always``), and git writes
    "fatal: not a git repository" to the terminal wherever capsense evaluates outside a checkout: a line that reads
    like a failure, once per condition. Within capsense's own calls the same question is asked with git's stderr
    discarded (None where there is no repository, as lm-eval records it there)."""
    import subprocess

    import lm_eval.evaluator as evaluator

    def git_hash() -> str | None:
        try:
            return subprocess.run(["git", "describe", "--always"], capture_output=True, text=True,
                                  check=True).stdout.strip() or None
        except (subprocess.CalledProcessError, OSError):
            return None

    original = getattr(evaluator, "get_git_commit_hash", None)
    if original is None:  # (another lm-eval: nothing to replace)
        yield
        return
    evaluator.get_git_commit_hash = git_hash
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = original


def format_table(rows: Sequence[MetricRow], base: str = "base") -> str:
    """A markdown table: task, metric, each label's value, and each label's change vs ``base``."""
    labels = list(rows[0].values) if rows else []
    others = [lab for lab in labels if lab != base]
    head = ["task", "metric", *labels, *(f"change ({lab})" for lab in others)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        vals = [f"{r.values[lab]:.4f}" for lab in labels]
        changes = [format_percent(relative_change(r.values[base], r.values[lab])) for lab in others]
        lines.append("| " + " | ".join([r.task, r.metric, *vals, *changes]) + " |")
    return "\n".join(lines)

"""Run a recipe: for each target, locate (resumable), then validate its top heads on held-out documents.

One progress display covers the whole recipe (:mod:`capsense.core.progress`): ``locate``,
``refine`` and ``validate`` phases of every target, with a total ETA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capsense.core.ablation import resolve_ablation
from capsense.core.batching import check_batch_size
from capsense.core.models import DTYPES
from capsense.core.placement import check_placement
from capsense.errors import CapsenseError
from capsense.evaluation.preflight import check_locate, check_output_folder
from capsense.tasks import check_task_names
from capsense.tasks.suite import expand_controls

Step = tuple[Any, "dict[str, Any] | None"]  # (LocateConfig, validate settings)


@dataclass
class StepResult:
    """What one target of a recipe produced."""

    task: str
    heads_path: Path
    validation_table: str | None = None
    validation_info: dict[str, Any] | None = None
    written: list[Path] = field(default_factory=list)


def check_steps(steps: list[Step]) -> None:
    """Every step's settings, tasks, model and folders, before anything heavy is imported: validate's too, which until
    round 53 were read only once its locate had run (a validate ``limit: 0`` failed after the search)."""
    for cfg, val in steps:
        check_locate(cfg)
        if val:
            _check_validate_numbers(val)
            kwargs = validate_kwargs(cfg, val)
            check_placement(kwargs["device"], kwargs["device_map"])
            check_batch_size(val.get("batch_size", 16), "validate `batch_size`")
            # validate's ablation (and texts), by the rule validate applies to the run's heads.json
            resolve_ablation({"ablation": cfg.ablation, "mean_reference": cfg.mean_reference}, val.get("ablation"),
                             val.get("mean_reference"))
            if val["tasks"]:
                check_task_names(expand_controls(val["tasks"], cfg.task), val.get("include_path", cfg.include_path))
            check_output_folder(val["out"], "validate `out`")


def _check_validate_numbers(val: dict[str, Any]) -> None:
    """A validate section's counts and tolerance: what :func:`~capsense.evaluation.validate.check_validate` refuses
    (its heads file does not exist yet)."""
    for key, low, default in (("top_k", 1, None), ("random", 0, 3), ("limit", 1, 100), ("seed", 0, 0),
                              ("tolerance", 0, 0.10)):
        value = val.get(key, default)
        kind = float if key == "tolerance" else int
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < low
                                  or (kind is int and value != int(value))):
            raise CapsenseError(f"validate `{key}` must be {'a number' if kind is float else 'an integer'} >= {low}, "
                                f"got {value!r}")
    if val.get("dtype", "float32") not in DTYPES[1:]:
        raise CapsenseError(f"validate `dtype` {val['dtype']!r}: valid are {', '.join(DTYPES[1:])}")


def validate_kwargs(cfg: Any, val: dict[str, Any]) -> dict[str, Any]:
    """The :func:`capsense.evaluation.validate.validate` settings of a recipe's validate section. Where it places the
    model (``device`` or ``device_map``) it does not take locate's other one: a map places every module itself."""
    own = "device" in val or "device_map" in val
    return dict(
        n_random=int(val.get("random", 3)), limit=val.get("limit", 100), seed=int(val.get("seed", 0)),
        tolerance=float(val.get("tolerance", 0.10)),
        batch_size=val.get("batch_size", 16), device=val.get("device", "cpu" if own else cfg.device),
        dtype=val.get("dtype", "float32"), include_path=val.get("include_path", cfg.include_path),
        confirm_run_unsafe_code=bool(val.get("confirm_run_unsafe_code", cfg.confirm_run_unsafe_code)),
        device_map=val.get("device_map", None if own else cfg.device_map),
        ablation=val.get("ablation"), mean_reference=val.get("mean_reference"),  # None: the run's (heads.json)
    )


def run_steps(steps: list[Step], log: Callable[[str], None] = print, progress: bool = True) -> list[StepResult]:
    """Run every (locate, validate) step in order; each locate resumes its run folder."""
    from capsense.core.distributed import is_main_process
    from capsense.core.progress import Phase, RunProgress
    from capsense.evaluation.validate import format_validation, validate, write_validation
    from capsense.localize.methods import refine_budget
    from capsense.localize.run import locate

    results = []
    for i, (cfg, val) in enumerate(steps):
        tag = f"{cfg.task}: " if len(steps) > 1 else ""
        # the clean (unablated) pass is an evaluation too: masks + 1, as the run folder counts them
        # counts are provisional: locate sets them from its method once the model is loaded
        phases = [Phase("locate", cfg.masks + 1, "evaluations"), Phase("refine", refine_budget(cfg), "sets")]
        if val:
            phases.append(Phase("validate", 2 + int(val.get("random", 3)), "conditions"))
        display = RunProgress(phases, enabled=progress)
        log(f"{tag}locate 1/{len(phases)}, refine 2/{len(phases)}" + (f", validate 3/{len(phases)}" if val else ""))
        _, heads_path = locate(cfg, log=display.write if progress else log, progress=display)
        outputs = ("report.md", "heatmap.png", "scores.csv", "manifest.json", "evaluations.jsonl")
        result = StepResult(cfg.task, heads_path, written=[heads_path, *(heads_path.parent / f for f in outputs
                                                                            if (heads_path.parent / f).is_file())])
        if val:
            with display.phase("validate") as phase:
                rows, info = validate(cfg.model, heads_path, val.get("top_k", cfg.top_k), val["tasks"],
                                      log=display.write, progress=phase, out=val["out"], **validate_kwargs(cfg, val))
            if not is_main_process():  # under accelerate launch every process evaluates, the main one writes
                display.close()
                continue
            result.written += write_validation(Path(val["out"]), rows, info)
            result.validation_table = format_validation(rows)
            result.validation_info = info
        display.close()
        results.append(result)
    return results

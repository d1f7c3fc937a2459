"""Offline capability tasks: deterministic data built in code, served to lm-eval.

The YAML configs live in the repository's ``lm_eval_tasks/`` (shipped inside the wheel as
``capsense/lm_eval_tasks``); each names a builder from this package through
``custom_dataset: !function capsense_tasks.<name>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def tasks_dir() -> Path:
    """The folder to pass to lm-eval's ``--include_path`` for capsense's offline tasks."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "lm_eval_tasks", here.parent / "lm_eval_tasks"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("capsense's lm_eval_tasks folder is missing from this installation")


def task_manager(include_path: Sequence[str] = (), tasks: Sequence[str] = (), metadata: dict | None = None):
    """An lm-eval TaskManager with capsense's tasks; skips indexing lm-eval's own when unneeded.

    ``metadata`` reaches ``custom_dataset`` builders (capsense tasks count continuation
    tokens with ``metadata["tokenizer"]``).
    """
    from lm_eval.tasks import TaskManager

    paths = [str(tasks_dir()), *map(str, include_path)]
    quick = TaskManager(include_path=paths, include_defaults=False, metadata=metadata)
    if all(t in quick.all_tasks for t in tasks):
        return quick
    full = TaskManager(include_path=paths, metadata=metadata)
    missing = [t for t in tasks if t not in full.all_tasks]
    if missing:
        raise ValueError(
            f"unknown task(s) {', '.join(missing)}: use lm-eval task names or add YAMLs with "
            "--include-path; capsense's own tasks are "
            + ", ".join(sorted(t for t in quick.all_tasks if t.startswith("capsense_")))
        )
    return full

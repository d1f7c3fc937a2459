"""Checks of a locate or recipe request that need no torch, no lm-eval and no model.

Every command calls these before its first heavy import, so a bad argument, task name,
model name, output path or recipe field fails in well under two seconds with one message.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from capsense.core.models import check_model
from capsense.errors import CapsenseError
from capsense.tasks import check_task_names

if TYPE_CHECKING:
    from capsense.localize.config import LocateConfig


def check_output_folder(out: str | Path, what: str = "`out`") -> Path:
    """``out`` is a folder or does not exist yet, and nothing above it is a file."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise CapsenseError(f"{what} {str(p)!r} is a file, not a folder")
    for parent in p.parents:
        if parent.exists() and not parent.is_dir():
            raise CapsenseError(f"{what} {str(p)!r} cannot be created: {str(parent)!r} is a file")
    return p


def check_locate(cfg: LocateConfig) -> None:
    """A locate run's settings, task names, model name and run folder, cheaply."""
    cfg.check()
    check_output_folder(cfg.out)
    check_task_names([cfg.task, *cfg.controls], cfg.include_path)
    check_model(cfg.model, cfg.revision)

"""What every export format shares: its error, its result, the dtype names and the format registry.

A format is a function ``(model, heads, out, *, checked=None, **settings) -> ExportResult`` declared in
:data:`FORMATS` (or registered with :func:`register_format`); ``capsense export --format NAME`` and
:func:`capsense.ship.export.export_model` look it up in :data:`FORMATS`, check the request once
(:func:`capsense.ship.preflight.check_export_inputs`) and hand the format its result as ``checked``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capsense.core.heads import HeadSet
from capsense.core.registry import Registry
from capsense.errors import CapsenseError

from capsense.core.models import DTYPES


@dataclass
class ExportResult:
    """What an export wrote: the folder, its files and the ``capsense.json`` metadata."""

    out: Path
    format: str
    heads: HeadSet
    files: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)


Exporter = Callable[..., ExportResult]
FORMATS: Registry[Exporter] = Registry("format", "formats", CapsenseError)
FORMATS.register_lazy("adapter", "capsense.ship.adapter:export_adapter")
FORMATS.register_lazy("checkpoint", "capsense.ship.checkpoint:export_checkpoint")


def register_format(name: str) -> Callable[[Exporter], Exporter]:
    """Register an export function under ``name`` (a decorator; capsense's own formats are declared
    above, lazily, so naming them imports nothing)."""
    return FORMATS.register(name)


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise CapsenseError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")


def noop(msg: str) -> None:
    """The default ``log``: say nothing."""

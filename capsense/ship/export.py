"""Ship an ablated model in a stock format: ``checkpoint`` (:mod:`capsense.ship.checkpoint`) or
``adapter`` (:mod:`capsense.ship.adapter`), looked up by name in :data:`capsense.ship.base.FORMATS`.

Every format writes ``capsense.json`` (:mod:`capsense.ship.metadata`) and a ``README.md`` model
card (:mod:`capsense.ship.card`), atomically (:mod:`capsense.core.files`). Importing this module imports
no torch: :func:`export_model` checks a request before the format's module is imported, and the formats'
own functions are imported when first named here.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from capsense.core.heads import HeadsLike, located_revision
from capsense.ship.base import DTYPES, FORMATS, ExportResult
from capsense.ship.metadata import METADATA_FILE
from capsense.ship.preflight import MEAN_FOLD_SUPPORT, ExportInputs, check_export_inputs, resolve_heads

__all__ = [
    "DTYPES", "FORMATS", "MEAN_FOLD_SUPPORT", "METADATA_FILE", "ExportResult", "export_adapter",
    "export_checkpoint", "export_model", "fold_means_into_bias", "ia3_vectors", "projection_names", "resolve_heads",
]

#: The formats' names re-exported here, by module (torch and the format's libraries load on first use).
_FORMAT_NAMES = {"export_adapter": "adapter", "ia3_vectors": "adapter", "projection_names": "adapter",
                 "export_checkpoint": "checkpoint", "fold_means_into_bias": "checkpoint"}


def __getattr__(name: str) -> Any:
    if name in _FORMAT_NAMES:
        return getattr(importlib.import_module(f"capsense.ship.{_FORMAT_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def export_model(model: str, heads: HeadsLike, out: str | os.PathLike, *, format: str,
                 checked: ExportInputs | None = None, **kwargs: Any) -> ExportResult:
    """Export in the registered ``format`` (``checkpoint`` or ``adapter``): the request checked once
    (:func:`~capsense.ship.preflight.check_export_inputs`, before the format's module is imported; ``checked``:
    its result where the caller ran it, as the CLI does before its push check), then handed to the format.
    ``revision`` (of a Hub model): by default the one the heads file's run loaded, where ``model`` is its model
    (:func:`~capsense.core.heads.located_revision`)."""
    kwargs["revision"] = located_revision(heads, model, kwargs.get("revision"))
    if checked is None:
        checked = check_export_inputs(model, heads, out, format=format, **kwargs)
    return FORMATS[format](model, heads, out, checked=checked, **kwargs)

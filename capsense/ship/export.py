"""Ship an ablated model in a stock format: ``checkpoint`` (:mod:`capsense.ship.checkpoint`) or
``adapter`` (:mod:`capsense.ship.adapter`), looked up by name in :data:`capsense.ship.base.FORMATS`.

Every format writes ``capsense.json`` (:mod:`capsense.ship.metadata`) and a ``README.md`` model
card (:mod:`capsense.ship.card`), atomically (:mod:`capsense.core.files`).
"""

from __future__ import annotations

import os
from typing import Any

from capsense.core.heads import HeadsLike
from capsense.ship.adapter import export_adapter, ia3_vectors, projection_names
from capsense.ship.base import DTYPES, FORMATS, ExportResult
from capsense.ship.checkpoint import export_checkpoint, fold_means_into_bias
from capsense.ship.metadata import METADATA_FILE
from capsense.ship.preflight import MEAN_FOLD_SUPPORT, resolve_heads

__all__ = [
    "DTYPES", "FORMATS", "MEAN_FOLD_SUPPORT", "METADATA_FILE", "ExportResult", "export_adapter",
    "export_checkpoint", "export_model", "fold_means_into_bias", "ia3_vectors", "projection_names", "resolve_heads",
]


def export_model(model: str, heads: HeadsLike, out: str | os.PathLike, *, format: str, **kwargs: Any) -> ExportResult:
    """Export in the registered ``format`` (``checkpoint`` or ``adapter``)."""
    return FORMATS[format](model, heads, out, **kwargs)

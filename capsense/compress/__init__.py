"""Compression with the capability in view.

Methods (all written here, each small and tested): magnitude and Wanda pruning
(:mod:`.prune`), symmetric round-to-nearest quantization (:mod:`.quantize`), truncated SVD,
activation-aware SVD and SVD-LLM (:mod:`.lowrank`), each a typed setting in the registry of
:mod:`.methods` that validates, names, sizes and applies itself. :mod:`.budget` holds budget
files with per-layer/per-matrix overrides and protected heads (:mod:`.protect`: output columns,
or whole heads under GQA); :mod:`.apply` compresses in memory or to a checkpoint with exact
accounting (:mod:`.accounting`); :mod:`.measure` gives per-capability nats/token.
Capability-guided compression: :mod:`.sensitivity` (Fisher of a capability's loss),
:mod:`.allocate` (least-cost levels at a size) and :mod:`.guided` (``--keep``).
:mod:`.distill` recovers a pruned student from its teacher. ``study/``: resumable grids,
the compact pruning relation and other predictors, budgeted selection, reports.
"""

from capsense.compress.apply import CompressionError, CompressionResult, compress_checkpoint, compress_model
from capsense.compress.budget import METHODS, Budget, BudgetError, load_budget, normalize_setting, uniform_budget
from capsense.compress.measure import CAPABILITIES, MeasureError, build_probes, measure
from capsense.compress.targets import find_targets

__all__ = [
    "CAPABILITIES", "METHODS", "Budget", "BudgetError", "CompressionError", "CompressionResult", "MeasureError",
    "build_probes", "compress_checkpoint", "compress_model", "find_targets", "load_budget", "measure",
    "normalize_setting", "uniform_budget",
]

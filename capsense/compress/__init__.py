"""Compression with the capability in view.

Methods (all written here, each small and tested): magnitude and Wanda pruning
(:mod:`.prune`), symmetric round-to-nearest quantization (:mod:`.quantize`), truncated SVD,
activation-aware SVD and SVD-LLM (:mod:`.lowrank`). :mod:`.budget` holds settings, budget
files with per-layer/per-matrix overrides and protected heads; :mod:`.apply` compresses in
memory or to a checkpoint; :mod:`.measure` gives per-capability nats/token; :mod:`.grid`
runs resumable grids; :mod:`.predictors` and :mod:`.analysis` fit the compact pruning
relation, the per-density baseline and the stable-rank predictor; :mod:`.select` picks a
setting under a size budget.
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

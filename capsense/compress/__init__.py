"""Compression with the capability in view; the modules read as the data flow, imports go one way.

1. Math (each small and tested): magnitude and Wanda pruning (:mod:`.prune`), symmetric
   round-to-nearest quantization (:mod:`.quantize`), truncated SVD, activation-aware SVD and
   SVD-LLM (:mod:`.lowrank`).
2. Settings: :mod:`.methods`, the registry of typed settings that validate, name, size and
   apply themselves.
3. Budget: :mod:`.budget` (budget files, per-layer/per-matrix overrides, protected heads via
   :mod:`.protect`: output columns, or whole heads under GQA).
4. Engine: :mod:`.engine` plans a budget over the target matrices (:mod:`.targets`), calibrates
   (:mod:`.calibration`) and compresses in memory with exact accounting (:mod:`.accounting`);
   :mod:`.sequential` calibrates and compresses one decoder layer at a time (one layer's statistics).
5. Guided allocation: :mod:`.sensitivity` (Fisher of a capability's loss), :mod:`.allocate`
   (least-cost levels at a size), :mod:`.measured_sensitivity` (levels priced by measured loss)
   and :mod:`.guided` (``--keep``); :mod:`.guided_sequential` prices and compresses one decoder layer at a time.
6. Pipeline: :mod:`.pipeline` loads a model, runs the above and writes the checkpoint.

Beside the flow: :mod:`.capabilities` (capability names; probes read a task's first documents,
calibration its last), :mod:`.capability_loss` (per-capability nats/token on the probes),
:mod:`.distill` (recovers a pruned student from its teacher) and ``study/`` (resumable grids,
the compact pruning relation and other predictors, budgeted selection, reports).
"""

import importlib

# Package-level names, imported on first use: ``capsense.compress.capabilities`` (checked by the
# CLI before anything heavy loads) must not pull torch in through this package's __init__.
_NAMES = {
    "METHODS": "budget", "Budget": "budget", "BudgetError": "budget", "load_budget": "budget",
    "normalize_setting": "budget", "uniform_budget": "budget",
    "CAPABILITIES": "capabilities",
    "build_probes": "capability_loss", "measure": "capability_loss",
    "CompressionResult": "engine", "compress_model": "engine",
    "compress_checkpoint": "pipeline",
    "compress_sequential": "sequential",
    "find_targets": "targets",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module 'capsense.compress' has no attribute {name!r}")
    return getattr(importlib.import_module(f"capsense.compress.{_NAMES[name]}"), name)

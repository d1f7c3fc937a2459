"""The compression pipeline: load a model, calibrate, (guide,) compress and write a checkpoint.

:func:`compress_checkpoint` is what ``capsense compress`` runs: it loads ``model_name``,
calibrates if the method needs it, lets a :class:`~capsense.compress.guided.Guide` choose the
allocation when given, compresses with :func:`capsense.compress.engine.compress_model` and saves
the result atomically with ``capsense.json`` describing what was done (and ``budget.yaml`` for a
guided allocation) in a form stock transformers loads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from capsense.compress.budget import Budget, setting_label, write_budget_file
from capsense.compress.calibration import DEFAULT_CALIBRATION
from capsense.compress.engine import CompressionResult, calibrate, check_plan, compress_model, needs_calibration, plan


def compress_checkpoint(
    model_name: str,
    budget: Budget,
    out: str | Path,
    calibration: str = DEFAULT_CALIBRATION,
    calibration_samples_n: int = 64,
    dtype: str = "float32",
    save_dtype: str | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
    guide=None,
    device_map: str | dict[str, Any] | None = None,
) -> CompressionResult:
    """Load ``model_name``, compress it under ``budget`` and write a checkpoint to ``out`` atomically.

    With ``guide`` (a :class:`capsense.compress.guided.Guide`), ``budget``'s default setting names
    the size and the method; the guided allocation replaces it and is also written as ``budget.yaml``.
    ``device_map`` (:mod:`capsense.core.placement`) spreads the model over devices: calibration
    and gradients run where the layers live, each matrix is compressed on CPU and written back to
    its device, so the checkpoint equals the one compressed without a map; a map that offloads
    weights to CPU memory or disk is refused before anything is computed or written.
    """
    from capsense.core.files import check_output_dir
    from capsense.core.models import load_model
    from capsense.core.placement import check_weights_in_memory

    log = log or (lambda _m: None)
    check_output_dir(out, overwrite)  # fail before the slow part
    model, tokenizer = load_model(model_name, dtype=dtype, device_map=device_map)
    check_weights_in_memory(model, "compression edits every weight in place and saves the whole model")
    planned = plan(model, budget)  # validates every setting before any work
    check_plan(model, budget, planned)
    needed, _ = needs_calibration(planned)
    stats, calib_info = {}, []
    if needed:
        log(f"calibrating on {calibration} ({calibration_samples_n} samples)")
        stats, calib_info = calibrate(model, tokenizer, budget, calibration, calibration_samples_n)
    allocation = None
    if guide is not None:
        from capsense.compress.guided import guided_budget  # the Fisher and measured sensitivities: only when guided

        allocation = guided_budget(model, tokenizer, budget, stats, guide, log)
        budget = allocation.budget
    log(f"compressing: {setting_label(budget.default)}")
    result = compress_model(model, budget, stats)
    result.calibration = calib_info
    if save_dtype and save_dtype != "auto":
        model = model.to(getattr(torch, save_dtype))
    _write_checkpoint(model, tokenizer, model_name, budget, result, allocation, out, overwrite)
    return result


def _write_checkpoint(model, tokenizer, model_name: str, budget: Budget, result: CompressionResult, allocation,
                      out: str | Path, overwrite: bool) -> None:
    """The checkpoint, ``capsense.json`` and (guided) ``budget.yaml``, written atomically."""
    from capsense.core.files import atomic_output_dir
    from capsense.core.models import model_fingerprint

    meta = {
        "capsense_compress": 1,
        "base_model": model_fingerprint(model_name),
        "method": budget.default.get("method"),
        "setting": budget.default,
        "label": result.summary["label"],
        **result.to_dict(per_matrix=True),
        **({"allocation": allocation.info} if allocation is not None else {}),
        "note": "weights are stored dense: pruned weights are zeros, RTN weights are dequantized, low-rank "
        "matrices are the reconstructed products; accounting counts what a sparse/quantized/factored store needs",
    }
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "capsense.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
        if allocation is not None:
            write_budget_file(tmp / "budget.yaml", allocation.budget)

"""Every fit a grid file (or one grid file per model) supports, and predictions from them.

The top of ``study/``'s fitting flow: :mod:`~capsense.compress.study.analysis` fits each
family of one model's grid (pruning, low rank, quantization), :mod:`~capsense.compress.study.crossmodel`
pools several models; :func:`fit_grid` collects both, :func:`predict_pruning` reads the compact
relation at a new density, and :func:`fit_grid_file` is what ``capsense fit`` calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capsense.compress.study.analysis import lowrank_evaluation, pruning_evaluation, quant_evaluation
from capsense.compress.study.crossmodel import cross_model_fits, read_grids
from capsense.compress.study.predictors import CompactFit
from capsense.errors import FitError


def fit_grid(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Every fit the grid supports, JSON-ready."""
    if not any(r["method"] == "none" for r in records):
        raise FitError("the grid file has no dense baseline (method none): run capsense grid on it first")
    fits = {
        "n_records": len(records),
        "models": sorted({r["model_state"]["model"] for r in records}),
        "capabilities": sorted({r["capability"] for r in records}),
        "pruning": pruning_evaluation(records),
        "lowrank": lowrank_evaluation(records),
        "lowrank_acc": lowrank_evaluation(records, metric="dacc"),
        "quant": quant_evaluation(records),
    }
    cross = cross_model_fits(records)  # several models: held-out-model and shared-response fits
    if cross is not None:
        fits["cross_model"] = cross
    return fits


def predict_pruning(
    fits: Mapping[str, Any], method: str, density: float, capabilities: Sequence[str] | None = None,
    allow_extrapolation: bool = False, which: str = "compact_all",
) -> dict[str, dict[str, Any]]:
    """Predicted dL per capability at an (unmeasured) density, from :func:`fit_grid`'s output."""
    if method not in fits["pruning"]:
        raise FitError(f"no pruning fit for {method!r}: the grid has {', '.join(fits['pruning']) or 'none'}")
    out = {}
    for cap, entry in fits["pruning"][method]["capabilities"].items():
        if capabilities and cap not in capabilities:
            continue
        if "skipped" in entry:
            continue
        fit = CompactFit(**{**entry[which], "density_range": tuple(entry[which]["density_range"])})
        lo, hi = fit.density_range
        extrapolated = not (lo - 1e-9 <= density <= hi + 1e-9)
        if fit.features:
            raise FitError("this fit depends on model-state features; predicting for a new model state needs them")
        pred = fit.predict(density, allow_extrapolation=allow_extrapolation)
        out[cap] = {"dL": float(pred[0]), "extrapolated": extrapolated, "range": [lo, hi]}
    return out


@dataclass
class GridFits:
    """A grid file's records, :func:`fit_grid` of them and the predictions asked for (one row
    per method, density and capability: ``dL``, ``extrapolated``, the measured ``range``)."""

    records: list[dict[str, Any]]
    fits: dict[str, Any]
    predictions: list[dict[str, Any]]


def fit_grid_file(path: str | Path | Sequence[str | Path], predict_densities: Sequence[float] = (),
                  method: str | None = None, allow_extrapolation: bool = False) -> GridFits:
    """Fit the predictors to the grid file at ``path`` (``capsense fit``; several files, one per
    model, are pooled and also fitted across models) and predict dL at ``predict_densities`` for
    pruning ``method`` (None: every fitted pruning method). A density is the fraction of weights kept, in (0, 1];
    ``method`` and ``allow_extrapolation`` apply only to predictions, and are refused without densities."""
    bad = [d for d in predict_densities if not 0 < d <= 1]
    if bad:
        raise FitError(f"a density to predict is the fraction of weights kept, in (0, 1]; got {bad[0]:g}")
    if not predict_densities and (method is not None or allow_extrapolation):
        raise FitError("`method` and `allow_extrapolation` apply to predictions: give the densities to predict "
                       "(`capsense fit --predict 0.75,0.65`)")
    records = read_grids([path] if isinstance(path, (str, Path)) else list(path))
    fits = fit_grid(records)
    rows: list[dict[str, Any]] = []
    if predict_densities:
        methods = [method] if method else list(fits["pruning"])
        if not methods:
            raise FitError("the grid has no pruning measurements to predict from")
        for m in methods:
            for d in predict_densities:
                for cap, p in predict_pruning(fits, m, d, allow_extrapolation=allow_extrapolation).items():
                    rows.append({"method": m, "density": d, "capability": cap, **p})
    return GridFits(records, fits, rows)


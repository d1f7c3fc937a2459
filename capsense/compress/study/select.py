"""Budgeted choice: the (method, setting) with the lowest predicted capability loss that fits
a size budget, and its regret against the best measured setting under the same budget.

Predictions are honest out-of-sample numbers from :func:`capsense.compress.study.fits.fit_grid`:
pruning uses the compact relation fitted on half the densities, low-rank the stable-rank
predictor's leave-one-out prediction, RTN the bits predictor's leave-one-out prediction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from capsense.core.registry import Registry
from capsense.errors import CapsenseError, FitError
from capsense.compress.study.analysis import _scope_tag, quant_method
from capsense.compress.study.fits import fit_grid
from capsense.compress.study.predictors import CompactFit


SIZE_KEYS: Registry = Registry("size_key", "size measures", CapsenseError)
for _key in ("size_ratio", "target_size_ratio", "model_param_ratio", "target_param_ratio"):
    SIZE_KEYS.register(_key, _key)


def _predict_prune(r: Mapping[str, Any], fits: Mapping[str, Any]) -> float | None:
    method = r["label"].split("@")[0] + _scope_tag(r)
    entry = fits["pruning"].get(method, {}).get("capabilities", {}).get(r["capability"])
    if not entry or "compact_half" not in entry:
        return None
    c = entry["compact_half"]
    fit = CompactFit(**{**c, "density_range": tuple(c["density_range"])})
    if fit.features:
        return None
    return float(fit.predict(r["setting"]["density"])[0])


def _predict_lowrank(r: Mapping[str, Any], fits: Mapping[str, Any]) -> float | None:
    groups = fits["lowrank"]["groups"]
    cap = r["capability"]
    for key in (f"{cap}|{r['targets']}|{r['method']}", f"{cap}|{r['targets']}"):  # per method first
        g = groups.get(key)
        if g and "labels" in g and r["label"] in g["labels"]:
            return float(g["loo_pred"][g["labels"].index(r["label"])])
    return None


def _predict_quant(r: Mapping[str, Any], fits: Mapping[str, Any]) -> float | None:
    g = fits["quant"].get(quant_method(r), {}).get(r["capability"])
    if not g or "bits" not in g:
        return None
    return float(g["loo_pred"][g["bits"].index(r["setting"]["bits"])])


#: Method family -> the fitted predictor of a record's dL.
PREDICTORS: Registry = Registry("family", "families", CapsenseError)
for _family, _fn in (("prune", _predict_prune), ("lowrank", _predict_lowrank), ("quant", _predict_quant)):
    PREDICTORS.register(_family, _fn)


def _predicted(r: Mapping[str, Any], fits: Mapping[str, Any]) -> float | None:
    """The fitted prediction of a grid record's dL (None when its family has no fit for it)."""
    predictor = PREDICTORS.get(r["family"])
    return predictor(r, fits) if predictor else None


def candidates(
    records: Sequence[Mapping[str, Any]], fits: Mapping[str, Any], capabilities: Sequence[str],
    weights: Mapping[str, float] | None = None, size_key: str = "size_ratio",
) -> list[dict[str, Any]]:
    """Every measured setting with all ``capabilities`` measured: size, predicted and measured loss."""
    SIZE_KEYS.check(size_key)
    w = {c: float((weights or {}).get(c, 1.0)) for c in capabilities}
    total = sum(w.values())
    by: dict[tuple[str, str], dict[str, Mapping[str, Any]]] = {}
    for r in records:
        if r["method"] != "none" and r["capability"] in capabilities:
            by.setdefault((r["label"], r["targets"]), {})[r["capability"]] = r
    out = []
    for (label, targets), caps in by.items():
        if set(caps) != set(capabilities):
            continue
        preds = {c: _predicted(caps[c], fits) for c in capabilities}
        any_r = next(iter(caps.values()))
        out.append({
            "label": label, "targets": targets, "method": any_r["method"], "setting": any_r["setting"],
            "size": float(any_r["summary"][size_key]),
            "measured": sum(w[c] * caps[c]["dL"] for c in capabilities) / total,
            "predicted": None if any(p is None for p in preds.values()) else sum(w[c] * preds[c] for c in capabilities) / total,
            "measured_by_capability": {c: caps[c]["dL"] for c in capabilities},
            "predicted_by_capability": preds,
        })
    return out


def select(
    records: Sequence[Mapping[str, Any]], fits: Mapping[str, Any], budget: float,
    capabilities: Sequence[str] | None = None, weights: Mapping[str, float] | None = None,
    size_key: str = "size_ratio",
) -> dict[str, Any]:
    """Choose by prediction under ``size <= budget``; report the regret against the best measured."""
    if not 0 < budget <= 1:
        raise CapsenseError(f"`budget` {budget} is outside (0, 1]: it is the largest allowed {size_key} (1 = dense size)")
    caps = list(capabilities or sorted({r["capability"] for r in records}))
    cands = candidates(records, fits, caps, weights, size_key)
    if not cands:
        raise FitError("the grid has no setting measured on all of " + ", ".join(caps))
    feasible = [c for c in cands if c["size"] <= budget + 1e-12]
    if not feasible:
        smallest = min(cands, key=lambda c: c["size"])
        raise FitError(
            f"no measured setting fits {size_key} <= {budget:g}: the smallest is {smallest['label']} "
            f"({smallest['targets']}) at {smallest['size']:.3f}"
        )
    predictable = [c for c in feasible if c["predicted"] is not None]
    if not predictable:
        raise FitError("no feasible setting has a prediction: the grid needs enough points per method to fit")
    chosen = min(predictable, key=lambda c: c["predicted"])
    best = min(feasible, key=lambda c: c["measured"])
    return {
        "budget": budget, "size_key": size_key, "capabilities": caps, "weights": dict(weights or {}),
        "chosen": chosen, "best_measured": best, "regret": chosen["measured"] - best["measured"],
        "n_feasible": len(feasible), "n_predictable": len(predictable),
        "ranking": sorted(predictable, key=lambda c: c["predicted"]),
    }


def select_from_grid(
    path: str | Path, budget: float, size_key: str = "size_ratio", capabilities: Sequence[str] | None = None,
    weights: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """:func:`select` over the grid file at ``path`` (``capsense select``), its predictors fitted
    here; every capability named in ``capabilities`` or ``weights`` must be in the grid."""
    from capsense.compress.study.grid import read_records

    records = read_records(path)
    known = {r["capability"] for r in records}
    bad = [c for c in [*(capabilities or []), *(weights or {})] if c not in known]
    if bad:
        raise CapsenseError(f"capability {', '.join(bad)} is not in the grid: it has {', '.join(sorted(known))}")
    return select(records, fit_grid(records), budget, capabilities, weights, size_key)


def regret_curve(
    records: Sequence[Mapping[str, Any]], fits: Mapping[str, Any], budgets: Sequence[float], **kw: Any
) -> list[dict[str, Any]]:
    """:func:`select` at several budgets (skipping those nothing fits)."""
    out = []
    for b in budgets:
        try:
            s = select(records, fits, b, **kw)
        except FitError:  # nothing fits this budget, or too few points
            continue
        out.append({"budget": b, "chosen": s["chosen"]["label"], "best": s["best_measured"]["label"], "regret": s["regret"]})
    return out


def regret_summary(curve: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    r = np.array([c["regret"] for c in curve]) if curve else np.array([])
    return {"mean_regret": float(r.mean()) if r.size else float("nan"), "max_regret": float(r.max()) if r.size else float("nan")}

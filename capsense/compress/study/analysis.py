"""Fits over a grid file: the compact pruning relation vs the per-density baseline, the
stable-rank predictor for low-rank methods, the bits predictor per quantizer (RTN, GPTQ), and predictions.

Held-out protocol for pruning (per method and capability):

* **half densities**: the compact relation is fitted on every other measured density
  (sorted, the ends included) and judged on the densities it did not see;
* **document split**: each probe set is split into even and odd documents; a fit on one
  half predicts the other half's measurements (both ways, averaged). The compact relation
  (half the densities) and the per-density regression (all densities) are compared on the
  same held-out documents, so the baseline's error is the measurement noise floor.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from capsense.compress.study.predictors import (
    CompactFit, LinearFit, fit_compact, fit_linear_loo, fit_per_density, model_state_features, quant_feature, stable_rank_feature,
)
from capsense.errors import FitError


def _baselines(records: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], Mapping[str, Any]]:
    return {(r["model_state"]["model"], r["capability"]): r for r in records if r["method"] == "none"}


def _half_dL(r: Mapping[str, Any], base: Mapping[str, Any], half: int) -> float:
    def loss(rec):
        nats = np.asarray(rec["doc_nats"])[half::2]
        tok = np.asarray(rec["doc_tokens"])[half::2]
        return nats.sum() / max(tok.sum(), 1)

    return float(loss(r) - loss(base))


def half_densities(densities: Sequence[float]) -> list[float]:
    """Every other density, sorted, keeping both ends (so the rest are interpolations)."""
    ds = sorted(set(float(d) for d in densities))
    half = ds[::2]
    if ds[-1] not in half:
        half.append(ds[-1])
    return half


def _doc_split(rs, bases, cap: str, method: str, d, X, sel, held) -> dict[str, Any] | None:
    """Document split: fit on one half of each probe set, judge on the other (None without per-doc data)."""
    have_docs = all("doc_nats" in r for r in rs) and all(
        "doc_nats" in bases.get((r["model_state"]["model"], cap), {}) for r in rs
    )
    if not have_docs:
        return None
    errs_c, errs_c_held, errs_p = [], [], []
    for fit_half in (0, 1):
        yf = np.array([_half_dL(r, bases[(r["model_state"]["model"], cap)], fit_half) for r in rs])
        ye = np.array([_half_dL(r, bases[(r["model_state"]["model"], cap)], 1 - fit_half) for r in rs])
        Xf = X.copy()
        Xf[:, 1] = np.nan  # L0 differs between halves; the split is within one model state
        c = fit_compact(d[sel], yf[sel], Xf[sel], capability=cap, method=method)
        p = fit_per_density(d, yf, Xf, capability=cap, method=method)
        pc = c.predict(d, _used(c, Xf))
        errs_c.extend(np.abs(pc - ye))
        errs_c_held.extend(np.abs(pc - ye)[held])
        errs_p.extend(np.abs(p.predict(d, _used(p, Xf)) - ye))
    return {
        "mae_compact_half_densities": float(np.mean(errs_c)),
        "mae_compact_half_densities_heldout_only": float(np.mean(errs_c_held)) if errs_c_held else None,
        "mae_per_density_all_densities": float(np.mean(errs_p)),
    }


def pruning_evaluation(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Compact relation vs per-density regression for every pruning method and capability."""
    bases = _baselines(records)
    out: dict[str, Any] = {}
    prune = [r for r in records if r.get("family") == "prune"]
    for method in sorted({r["label"].split("@")[0] + _scope_tag(r) for r in prune}):
        rows = [r for r in prune if r["label"].split("@")[0] + _scope_tag(r) == method]
        per_cap: dict[str, Any] = {}
        for cap in sorted({r["capability"] for r in rows}):
            rs = [r for r in rows if r["capability"] == cap]
            d = np.array([r["setting"]["density"] for r in rs])
            y = np.array([r["dL"] for r in rs])
            X = np.array([model_state_features(r) for r in rs])
            if len(set(d.tolist())) < 3:
                per_cap[cap] = {"skipped": f"only {len(set(d.tolist()))} densities measured (need 3)"}
                continue
            full = fit_compact(d, y, X, capability=cap, method=method)
            hd = half_densities(d)
            sel = np.isin(d, hd)
            half = fit_compact(d[sel], y[sel], X[sel], capability=cap, method=method)
            held = ~sel
            pred_held = half.predict(d[held], _used(half, X[held]))
            entry = {
                "densities": sorted(set(d.tolist())),
                "fit_densities": hd,
                "compact_all": full.to_dict(),
                "compact_half": half.to_dict(),
                "mae_heldout_densities": float(np.abs(pred_held - y[held]).mean()) if held.any() else None,
                "mean_abs_dL_heldout": float(np.abs(y[held]).mean()) if held.any() else None,
                "points": [
                    {"density": float(di), "dL": float(yi), "pred_half": float(pi), "pred_all": float(pa), "held_out": bool(h)}
                    for di, yi, pi, pa, h in zip(
                        d, y, half.predict(d, _used(half, X)), full.predict(d, _used(full, X)), held
                    )
                ],
            }
            split = _doc_split(rs, bases, cap, method, d, X, sel, held)
            if split is not None:
                entry["doc_split"] = split
            per_cap[cap] = entry
        good = [v for v in per_cap.values() if "doc_split" in v]
        out[method] = {
            "capabilities": per_cap,
            "mae_heldout_densities": _mean([v.get("mae_heldout_densities") for v in per_cap.values()]),
            "mean_abs_dL_heldout": _mean([v.get("mean_abs_dL_heldout") for v in per_cap.values()]),
            "doc_split_mae_compact_half": _mean([v["doc_split"]["mae_compact_half_densities"] for v in good]),
            "doc_split_mae_per_density_all": _mean([v["doc_split"]["mae_per_density_all_densities"] for v in good]),
            "measurements_compact": sum(len(v.get("fit_densities", [])) for v in per_cap.values()),
            "measurements_per_density": sum(len(v.get("densities", [])) for v in per_cap.values()),
        }
    return out


def _scope_tag(r: Mapping[str, Any]) -> str:
    scope = r["setting"].get("scope", "row")
    return "" if scope == "row" else f"/{scope}"


def _mean(xs: Sequence[Any]) -> float | None:
    xs = [x for x in xs if x is not None and np.isfinite(x)]
    return float(np.mean(xs)) if xs else None


def _used(fit, X: np.ndarray) -> np.ndarray | None:
    from capsense.compress.study.predictors import FEATURES

    return X[:, [FEATURES.index(f) for f in fit.features]] if fit.features else None


def lowrank_evaluation(records: Sequence[Mapping[str, Any]], metric: str = "dL") -> dict[str, Any]:
    """Stable-rank predictor with leave-one-out Pearson r, per capability and target set and pooled."""
    rows = [r for r in records if r.get("family") == "lowrank" and "stable_rank" in r]
    out: dict[str, Any] = {"metric": metric, "groups": {}}
    if not rows:
        return out

    def y_of(r):
        return r["dL"] if metric == "dL" else -r["dacc"]

    # capability|targets[|method]: the predictor pooled over methods and per method; with
    # several target sets (attn-only, mlp-only, both) the mean stable rank varies too.
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        cap, tg, m = r["capability"], r["targets"], r["method"]
        for key in (f"{cap}|{tg}", f"{cap}|{tg}|{m}", f"{cap}|all-targets", f"{cap}|all-targets|{m}", f"all|{tg}"):
            groups.setdefault(key, []).append(r)
    for name, rs in sorted(groups.items()):
        if name.startswith("all|"):
            # pooled over capabilities: centre each capability's response so scales compare
            ys = _centre_by(rs, y_of)
        else:
            ys = [y_of(r) for r in rs]
        xs = [stable_rank_feature(r) for r in rs]
        try:
            fit = fit_linear_loo(xs, ys, name=f"stable-rank {name}")
        except FitError as e:
            out["groups"][name] = {"skipped": str(e)}
            continue
        out["groups"][name] = {
            **fit.to_dict(), "x": xs, "y": ys, "labels": [r["label"] for r in rs],
            "methods": sorted({r["method"] for r in rs}),
        }
    return out


def _centre_by(rs, y_of) -> list[float]:
    by: dict[str, list[float]] = {}
    for r in rs:
        by.setdefault(r["capability"], []).append(y_of(r))
    means = {c: float(np.mean(v)) for c, v in by.items()}
    return [y_of(r) - means[r["capability"]] for r in rs]


def quant_method(record: Mapping[str, Any]) -> str:
    """The quantizer a record's bits fit belongs to: its label without the bit width
    (``rtn/g128``, ``gptq/g64``, ``gptq/g128/natural``). RTN and GPTQ, or two group sizes, lose
    very differently at the same bits (GPTQ 3b g128 on SmolLM2: 15-38% of RTN's dL), so they
    are fitted apart."""
    return re.sub(r"@\d+b", "", record["label"])


def quant_evaluation(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``dL = c * 4^-B`` per quantizer (:func:`quant_method`) and capability (through the origin),
    with leave-one-out errors: ``{quantizer: {capability: fit}}``."""
    rows = [r for r in records if r.get("family") == "quant"]
    out: dict[str, Any] = {}
    for method in sorted({quant_method(r) for r in rows}):
        per_cap = out.setdefault(method, {})
        for cap in sorted({r["capability"] for r in rows if quant_method(r) == method}):
            rs = [r for r in rows if r["capability"] == cap and quant_method(r) == method]
            xs = [quant_feature(r) for r in rs]
            ys = [r["dL"] for r in rs]
            try:
                fit = fit_linear_loo(xs, ys, name=f"bits {method} {cap}", through_origin=True)
            except FitError as e:
                per_cap[cap] = {"skipped": str(e)}
                continue
            per_cap[cap] = {**fit.to_dict(), "bits": [r["setting"]["bits"] for r in rs], "y": ys}
    return out


def fit_grid(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Every fit the grid supports, JSON-ready."""
    from capsense.compress.study.crossmodel import cross_model_fits

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
    pruning ``method`` (None: every fitted pruning method)."""
    from capsense.compress.study.crossmodel import read_grids

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


__all__ = [
    "FitError", "GridFits", "LinearFit", "fit_grid", "fit_grid_file", "half_densities", "lowrank_evaluation",
    "predict_pruning", "pruning_evaluation", "quant_evaluation",
]

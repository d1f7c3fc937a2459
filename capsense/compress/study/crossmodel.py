"""Fits across model states: grid files of several models read together and judged across models.

``capsense fit A.jsonl B.jsonl`` reads one grid per model (:func:`read_grids`); the ordinary fits
(:func:`capsense.compress.study.fits.fit_grid`) then pool them, and :func:`cross_model_fits`
adds what only several models can show:

* **Pruning, shared density response** (per method and capability): the compact relation with
  its model-state features fitted on every model jointly at half the densities (one ``gamma_c``,
  ``A_c(x)`` linear in the standardized features), against each model's own fit on the same
  densities; MAE at the held-out densities, per model.
* **Pruning, a held-out model**: (i) *plain transfer*, the other models' fit (no features)
  predicts the held-out model at every density; (ii) *gamma transfer*, the other models' ``gamma_c``
  with the held-out model's amplitude from one measured density (the middle one), scored on its
  other densities; (iii) *L0 across capabilities*: ``A = a_0 + a_1 L0`` with one ``gamma`` fitted
  on the other models' capabilities together (their reference losses differ), then the held-out
  model's dL predicted from its own L0 per capability, with no measurement of it. With two model
  states the three features of ``A_c(x)`` are each one two-valued column per capability
  (collinear), so (iii) is the only way a feature can predict a model it has not seen.
* **Stable-rank predictor, leave one model out** (per target set and capability): the line
  ``dL ~ gamma * mean(rho_s)`` fitted on the other models' low-rank rows (every method) predicts
  the held-out model's; MAE and Pearson r there. The pooled leave-one-out Pearson over all
  models is :func:`~capsense.compress.study.analysis.lowrank_evaluation`'s ``CAP|TARGETS`` group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from capsense.compress.study.analysis import _mean, _scope_tag, half_densities
from capsense.compress.study.predictors import (
    FEATURES, fit_compact, fit_linear_loo, model_state_features, pearson, stable_rank_feature,
)
from capsense.errors import FitError


def read_grids(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """The records of every grid file in ``paths``, checked to pool: each file has a dense baseline,
    and one model's records come from one grid (probe count, calibration, dtype), since each model's
    dL and its document split are taken against that model's baseline."""
    from capsense.compress.study.grid import read_records

    if not paths:
        raise FitError("give at least one grid file")
    records: list[dict[str, Any]] = []
    grid_of: dict[str, tuple[Any, str]] = {}
    for p in paths:
        recs = read_records(p)
        if not recs:
            raise FitError(f"{p} holds no measurements")
        if not any(r["method"] == "none" for r in recs):
            raise FitError(f"{p} has no dense baseline (method none): run capsense grid on it first")
        for r in recs:
            model, fp = r["model_state"]["model"], r.get("grid")
            seen = grid_of.setdefault(model, (fp, str(p)))
            if seen[0] != fp:
                raise FitError(
                    f"{model} is measured by two different grids ({seen[1]}: {seen[0]}; {p}: {fp}): "
                    "give one grid file per model"
                )
        records.extend(recs)
    return records


def _model(r: Mapping[str, Any]) -> str:
    return r["model_state"]["model"]


def _method(r: Mapping[str, Any]) -> str:
    return r["label"].split("@")[0] + _scope_tag(r)


def _arrays(rs: Sequence[Mapping[str, Any]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    d = np.array([r["setting"]["density"] for r in rs], dtype=float)
    y = np.array([r["dL"] for r in rs], dtype=float)
    X = np.array([model_state_features(r) for r in rs], dtype=float)
    m = np.array([_model(r) for r in rs])
    return d, y, X, m


def _mae(pred: np.ndarray, y: np.ndarray) -> float | None:
    return float(np.abs(pred - y).mean()) if len(y) else None


def _predict(fit, d: np.ndarray, X: np.ndarray) -> np.ndarray:
    cols = [FEATURES.index(f) for f in fit.features]
    return fit.predict(d, X[:, cols] if cols else None, allow_extrapolation=True)


def _shared_response(d, y, X, m, cap: str, method: str) -> dict[str, Any]:
    """Joint fit with features vs one fit per model, both on half the densities, scored on the rest."""
    sel = np.isin(d, half_densities(d))
    joint = fit_compact(d[sel], y[sel], X[sel], capability=cap, method=method)
    pj = _predict(joint, d, X)
    out: dict[str, Any] = {"joint": {"gamma": joint.gamma, "features": joint.features, "coef": joint.coef},
                           "per_model": {}}
    for model in sorted(set(m)):
        k = m == model
        own = fit_compact(d[k & sel], y[k & sel], capability=cap, method=method)
        held = k & ~sel
        out["per_model"][model] = {
            "gamma_own": own.gamma, "A_own": own.coef[0],
            "mae_joint": _mae(pj[held], y[held]),
            "mae_own": _mae(own.predict(d[held], allow_extrapolation=True), y[held]),
            "mean_abs_dL": _mae(np.zeros(held.sum()), y[held]),
        }
    return out


def _held_out_model(d, y, m, model: str, cap: str, method: str) -> dict[str, Any]:
    """Plain transfer and gamma transfer (one measured density of the held-out model) to ``model``."""
    k = m == model
    train = fit_compact(d[~k], y[~k], capability=cap, method=method)
    plain = train.predict(d[k], allow_extrapolation=True)
    ds = sorted(set(d[k].tolist()))
    anchor = ds[len(ds) // 2]
    at = k & np.isclose(d, anchor)
    rest = k & ~np.isclose(d, anchor)
    shape = (np.clip(1 - d, 0, None) / 0.3) ** train.gamma
    amp = float((y[at] * shape[at]).sum() / max((shape[at] ** 2).sum(), 1e-300))
    return {
        "gamma_train": train.gamma, "A_train": train.coef[0],
        "mae_plain_transfer": _mae(plain, y[k]),
        "anchor_density": anchor, "A_from_anchor": amp,
        "mae_gamma_transfer": _mae(amp * shape[rest], y[rest]),
        "mean_abs_dL": _mae(np.zeros(k.sum()), y[k]),
        "mean_abs_dL_gamma_transfer": _mae(np.zeros(rest.sum()), y[rest]),
    }


def _l0_across_capabilities(rows: Sequence[Mapping[str, Any]], method: str) -> dict[str, Any]:
    """Leave one model out: ``A = a_0 + a_1 L0`` and one gamma over the other models' capabilities."""
    d, y, X, m = _arrays(rows)
    caps = np.array([r["capability"] for r in rows])
    L0 = X[:, [FEATURES.index("L0")]]
    out: dict[str, Any] = {}
    for model in sorted(set(m)):
        k = m == model
        if len(set(caps[~k].tolist())) < 2:
            out[model] = {"skipped": "the other models have fewer than two capabilities: L0 does not vary"}
            continue
        fit = fit_compact(d[~k], y[~k], L0[~k], feature_names=("L0",), capability="all", method=method)
        if not fit.features:
            out[model] = {"skipped": "L0 does not vary over the training rows"}
            continue
        pred = fit.predict(d[k], L0[k], allow_extrapolation=True)
        out[model] = {
            "gamma": fit.gamma, "coef": fit.coef, "train_mae": fit.train_mae,
            "capabilities": {c: {"mae": _mae(pred[k2], y[k][k2]), "mean_abs_dL": _mae(np.zeros(k2.sum()), y[k][k2]),
                                 "L0": float(L0[k][k2][0, 0])}
                             for c in sorted(set(caps[k].tolist())) for k2 in [caps[k] == c]},
        }
        out[model]["mae"] = _mae(pred, y[k])
    return out


def cross_model_pruning(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Shared density response and held-out-model predictions, per pruning method and capability."""
    prune = [r for r in records if r.get("family") == "prune"]
    out: dict[str, Any] = {}
    for method in sorted({_method(r) for r in prune}):
        rows = [r for r in prune if _method(r) == method]
        models = sorted({_model(r) for r in rows})
        if len(models) < 2:
            continue
        per_cap: dict[str, Any] = {}
        for cap in sorted({r["capability"] for r in rows}):
            d, y, X, m = _arrays([r for r in rows if r["capability"] == cap])
            counts = {mo: len(set(d[m == mo].tolist())) for mo in models}
            if min(counts.values()) < 3:
                per_cap[cap] = {"skipped": f"densities per model {counts}: every model needs 3"}
                continue
            per_cap[cap] = {**_shared_response(d, y, X, m, cap, method),
                            "held_out_model": {mo: _held_out_model(d, y, m, mo, cap, method) for mo in models}}
        good = [v for v in per_cap.values() if "skipped" not in v]
        out[method] = {
            "models": models, "capabilities": per_cap,
            "mae_joint": _mean([p["mae_joint"] for v in good for p in v["per_model"].values()]),
            "mae_own": _mean([p["mae_own"] for v in good for p in v["per_model"].values()]),
            "l0_across_capabilities": _l0_across_capabilities(rows, method),
        }
    return out


def cross_model_lowrank(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Stable-rank line fitted on the other models' rows (all low-rank methods) scored on the held-out one."""
    rows = [r for r in records if r.get("family") == "lowrank" and "stable_rank" in r]
    out: dict[str, Any] = {}
    for key in sorted({f"{r['capability']}|{r['targets']}" for r in rows}):
        rs = [r for r in rows if f"{r['capability']}|{r['targets']}" == key]
        m = np.array([_model(r) for r in rs])
        x = np.array([stable_rank_feature(r) for r in rs])
        y = np.array([r["dL"] for r in rs])
        if len(set(m.tolist())) < 2:
            continue
        entry: dict[str, Any] = {}
        for model in sorted(set(m.tolist())):
            k = m == model
            try:
                fit = fit_linear_loo(x[~k], y[~k], name=f"stable-rank {key} without {model}")
            except FitError as e:
                entry[model] = {"skipped": str(e)}
                continue
            pred = fit.predict(x[k])
            entry[model] = {"n_train": int((~k).sum()), "n": int(k.sum()), "slope": fit.slope,
                            "intercept": fit.intercept, "mae": _mae(pred, y[k]), "pearson": pearson(pred, y[k]),
                            "mean_abs_dL": _mae(np.zeros(k.sum()), y[k])}
        out[key] = entry
    return out


def cross_model_fits(records: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Both cross-model evaluations, or None when the records hold one model."""
    models = sorted({_model(r) for r in records})
    if len(models) < 2:
        return None
    return {"models": models, "pruning": cross_model_pruning(records), "lowrank": cross_model_lowrank(records)}


__all__ = ["cross_model_fits", "cross_model_lowrank", "cross_model_pruning", "read_grids"]

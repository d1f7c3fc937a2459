"""Fits over a grid file: the compact pruning relation vs the per-density baseline, the
stable-rank predictor for low-rank methods, the bits predictor per quantizer (RTN, GPTQ); one model's
records (several models pooled: :mod:`~capsense.compress.study.crossmodel`; all fits and predictions
together: :mod:`~capsense.compress.study.fits`).

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
from typing import Any

import numpy as np

from capsense.compress.study.predictors import (
    LinearFit, fit_compact, fit_linear_loo, fit_per_density, model_state_features, quant_feature, stable_rank_feature,
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
    rows = [r for r in records if r.get("family") == "lowrank" and "stable_rank" in r
            and (metric == "dL" or r.get("dacc") is not None)]  # (a perplexity capability has no accuracy)
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


__all__ = [
    "FitError", "LinearFit", "half_densities", "lowrank_evaluation", "pruning_evaluation", "quant_evaluation",
]

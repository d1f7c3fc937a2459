"""Compress a model in place under a budget, and write a checkpoint stock transformers loads.

:func:`compress_model` edits the weights of the target matrices in memory and returns exact
accounting; :func:`compress_checkpoint` loads a model, calibrates if the method needs it,
compresses and saves the result atomically with ``capsense.json`` describing what was done.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from capsense.errors import CapsenseError
from capsense.compress import accounting as acc
from capsense.compress.budget import CALIBRATED, Budget, BudgetError, method_family, protected_columns, setting_label
from capsense.compress.calibration import DEFAULT_CALIBRATION, InputStats, calibration_samples, collect_stats
from capsense.compress.lowrank import factorize, rank_for_ratio, reconstruct, stable_rank
from capsense.compress.prune import apply_mask, global_masks, magnitude_scores, mask_from_scores, wanda_scores
from capsense.compress.quantize import rtn_bits, rtn_quantize
from capsense.compress.targets import Target, find_targets


class CompressionError(CapsenseError):
    """A compression request that cannot be carried out."""


@dataclass
class CompressionResult:
    """Per-matrix accounts and model totals of one compression."""

    accounts: list[acc.MatrixAccount]
    summary: dict[str, Any]
    budget: dict[str, Any]
    calibration: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self, per_matrix: bool = True) -> dict[str, Any]:
        d = {"summary": self.summary, "budget": self.budget, "calibration": self.calibration, "seconds": round(self.seconds, 2)}
        if per_matrix:
            d["matrices"] = [a.to_dict() for a in self.accounts]
        return d


def plan(model: nn.Module, budget: Budget) -> list[tuple[Target, dict[str, Any] | None]]:
    """Each target matrix with its setting (None = stays dense). Validates every setting."""
    try:
        return [(t, budget.setting_for(t)) for t in find_targets(model, budget.targets)]
    except ValueError as e:
        raise CompressionError(str(e)) from None


def needs_calibration(planned: Sequence[tuple[Target, dict[str, Any] | None]]) -> tuple[bool, bool]:
    """(any method needs calibration statistics, any needs the Gram matrix)."""
    methods = {s["method"] for _, s in planned if s}
    return bool(methods & CALIBRATED), "svd-llm" in methods


def calibrate(
    model: nn.Module,
    tokenizer,
    budget: Budget,
    calibration: str = DEFAULT_CALIBRATION,
    n_samples: int = 64,
    max_tokens: int = 512,
    progress: Callable[[int], None] | None = None,
) -> tuple[dict[str, InputStats], list[dict[str, Any]]]:
    """Input statistics of the matrices whose method needs them (empty if none does)."""
    planned = plan(model, budget)
    needed, gram = needs_calibration(planned)
    if not needed:
        return {}, []
    samples, info = calibration_samples(calibration, tokenizer, n_samples, max_tokens)
    targets = [t for t, s in planned if s and s["method"] in CALIBRATED]
    return collect_stats(model, targets, samples, gram=gram, progress=progress), info


def mean_stable_rank(model: nn.Module, targets: str | Sequence[str] | None = None) -> dict[str, float]:
    """Mean stable rank of the target matrices, overall and per kind, from the weights alone."""
    ranks: dict[str, list[float]] = {}
    for t in find_targets(model, targets):
        ranks.setdefault(t.kind, []).append(stable_rank(t.get()))
    out = {k: sum(v) / len(v) for k, v in ranks.items()}
    allr = [r for v in ranks.values() for r in v]
    out["all"] = sum(allr) / len(allr)
    return out


def _stats_for(t: Target, s: Mapping[str, Any], stats: Mapping[str, InputStats] | None) -> InputStats | None:
    if s["method"] not in CALIBRATED:
        return None
    st = (stats or {}).get(t.name)
    if st is None or st.n_tokens == 0:
        raise CompressionError(f"{s['method']} needs calibration statistics for {t.name}: run calibrate() first")
    if s["method"] == "svd-llm" and st.gram is None:
        raise CompressionError(f"svd-llm needs the calibration Gram matrix for {t.name}: calibrate with gram=True")
    return st


def _lowrank(
    t: Target, w: torch.Tensor, s: Mapping[str, Any], st: InputStats | None, free: torch.Tensor,
    cache: dict | None = None,
) -> tuple[torch.Tensor, int]:
    """Low-rank approximation of the free columns of ``w``; returns (new weight, factor parameters)."""
    sub = w[:, free]
    rank = rank_for_ratio(tuple(sub.shape), s["ratio"])
    m = s["method"]
    key = (m, t.name, s.get("alpha", 0.5), int(free.sum()))
    factors = cache.get(key) if cache is not None else None
    if factors is None:
        factors = factorize(
            sub, m,
            input_abs_mean=st.abs_mean[free] if st is not None else None,
            gram=st.gram[free][:, free] if st is not None and st.gram is not None else None,
            alpha=s.get("alpha", 0.5),
        )
        if cache is not None:
            factors = tuple(f.float() for f in factors)
            cache[key] = factors
    out = w.clone()
    out[:, free] = reconstruct(factors, rank).to(w.dtype)
    return out, rank * (sub.shape[0] + sub.shape[1])


@torch.no_grad()
def compress_model(
    model: nn.Module,
    budget: Budget,
    stats: Mapping[str, InputStats] | None = None,
    base_bits: int = acc.BASE_BITS,
    progress: Callable[[int], None] | None = None,
    factor_cache: dict | None = None,
) -> CompressionResult:
    """Compress ``model``'s target matrices in place under ``budget``.

    ``factor_cache`` (a dict the caller keeps) stores each matrix's low-rank factorization,
    so compressing the same weights at several ratios factorizes once.
    """
    t0 = time.time()
    planned = plan(model, budget)
    try:
        protected = protected_columns(model, budget, [t for t, _ in planned])
    except BudgetError as e:
        raise CompressionError(str(e)) from None
    for t, s in planned:  # every rank must exist before any weight changes
        if s is not None and method_family(s["method"]) == "lowrank":
            prot = protected.get(t.name)
            n_free = t.shape[1] - (int(prot.sum()) if prot is not None else 0)
            try:
                rank_for_ratio((t.shape[0], n_free), s["ratio"])
            except ValueError as e:
                raise CompressionError(f"{t.name}: {e}") from None
    accounts: dict[str, acc.MatrixAccount] = {}
    global_groups: dict[tuple, list[Target]] = {}
    for t, s in planned:
        prot = protected.get(t.name)
        n_prot = int(prot.sum()) if prot is not None else 0
        if s is None:
            w = t.get()
            accounts[t.name] = acc.dense_account(t.name, t.kind, t.shape, int((w != 0).sum()), base_bits)
            if progress:
                progress(1)
            continue
        st = _stats_for(t, s, stats)
        fam = method_family(s["method"])
        w = t.get()
        if fam == "prune":
            scores = magnitude_scores(w) if s["method"] == "magnitude" else wanda_scores(w, st.input_norm)
            if s["scope"] == "global":
                global_groups.setdefault((s["method"], s["density"]), []).append(t)
                continue
            mask = mask_from_scores(scores, s["density"], s["scope"], prot)
            t.set(apply_mask(w, mask))
            a = acc.pruned_account(t.name, t.kind, t.shape, s, int(mask.sum()), base_bits)
        elif fam == "quant":
            if prot is None:
                new, bits = rtn_quantize(w, s["bits"], s["group_size"]), rtn_bits(t.shape, s["bits"], s["group_size"])
            else:
                new = w.clone()
                new[:, ~prot] = rtn_quantize(w[:, ~prot], s["bits"], s["group_size"])
                sub_shape = (t.shape[0], t.shape[1] - n_prot)
                bits = rtn_bits(sub_shape, s["bits"], s["group_size"]) + t.shape[0] * n_prot * base_bits
            t.set(new)
            n = t.n_params
            a = acc.MatrixAccount(t.name, t.kind, t.shape, s["method"], s, n, n, int((t.get() != 0).sum()), bits)
        else:
            free = ~prot if prot is not None else torch.ones(t.shape[1], dtype=torch.bool)
            try:
                new, factor_params = _lowrank(t, w, s, st, free, factor_cache)
            except ValueError as e:
                raise CompressionError(f"{t.name}: {e}") from None
            t.set(new)
            stored = factor_params + t.shape[0] * n_prot
            a = acc.MatrixAccount(
                t.name, t.kind, t.shape, s["method"], s, t.n_params, stored, int((t.get() != 0).sum()), stored * base_bits
            )
        a.protected_cols = n_prot
        accounts[t.name] = a
        if progress:
            progress(1)
    for (method, density), group in global_groups.items():
        ws = [t.get() for t in group]
        scores = [
            magnitude_scores(w) if method == "magnitude" else wanda_scores(w, _stats_for(t, {"method": method}, stats).input_norm)
            for t, w in zip(group, ws)
        ]
        masks = global_masks(scores, density, [protected.get(t.name) for t in group])
        for t, w, mask in zip(group, ws, masks):
            t.set(apply_mask(w, mask))
            s = {"method": method, "density": density, "scope": "global"}
            a = acc.pruned_account(t.name, t.kind, t.shape, s, int(mask.sum()), base_bits)
            prot = protected.get(t.name)
            a.protected_cols = int(prot.sum()) if prot is not None else 0
            accounts[t.name] = a
            if progress:
                progress(1)
    ordered = [accounts[t.name] for t, _ in planned]
    summary = acc.summarize(ordered, acc.model_param_count(model), base_bits)
    summary["label"] = setting_label(budget.default)
    summary["protected_heads"] = str(budget.protect_heads) if budget.protect_heads is not None else None
    return CompressionResult(ordered, summary, budget.describe(), seconds=time.time() - t0)


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
) -> CompressionResult:
    """Load ``model_name``, compress it under ``budget`` and write a checkpoint to ``out`` atomically."""
    from capsense.core.files import atomic_output_dir, check_output_dir
    from capsense.core.models import load_model, model_fingerprint

    log = log or (lambda _m: None)
    check_output_dir(out, overwrite)  # fail before the slow part
    model, tokenizer = load_model(model_name, dtype=dtype)
    planned = plan(model, budget)  # validates every setting before any work
    protected_columns(model, budget, [t for t, _ in planned])
    needed, _ = needs_calibration(planned)
    stats, calib_info = {}, []
    if needed:
        log(f"calibrating on {calibration} ({calibration_samples_n} samples)")
        stats, calib_info = calibrate(model, tokenizer, budget, calibration, calibration_samples_n)
    log(f"compressing: {setting_label(budget.default)}")
    result = compress_model(model, budget, stats)
    result.calibration = calib_info
    if save_dtype and save_dtype != "auto":
        model = model.to(getattr(torch, save_dtype))
    meta = {
        "capsense_compress": 1,
        "base_model": model_fingerprint(model_name),
        "method": budget.default.get("method"),
        "setting": budget.default,
        "label": result.summary["label"],
        **result.to_dict(per_matrix=True),
        "note": "weights are stored dense: pruned weights are zeros, RTN weights are dequantized, low-rank "
        "matrices are the reconstructed products; accounting counts what a sparse/quantized/factored store needs",
    }
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "capsense.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return result

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
import capsense.compress.accounting as acc
from capsense.compress.budget import Budget, BudgetError, protections, setting_label
from capsense.compress.calibration import DEFAULT_CALIBRATION, InputStats, calibration_samples, collect_stats
from capsense.compress.lowrank import stable_rank
from capsense.compress.methods import Applied, Setting
from capsense.compress.protect import Protection
from capsense.compress.prune import apply_mask, global_masks
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


def plan(model: nn.Module, budget: Budget) -> list[tuple[Target, Setting | None]]:
    """Each target matrix with its setting (None = stays dense). Validates every setting."""
    try:
        return [(t, budget.setting_for(t)) for t in find_targets(model, budget.targets)]
    except ValueError as e:
        raise CompressionError(str(e)) from None


def needs_calibration(planned: Sequence[tuple[Target, Setting | None]]) -> tuple[bool, bool]:
    """(any method needs calibration statistics, any needs the Gram matrix)."""
    return any(s.calibrated for _, s in planned if s), any(s.needs_gram for _, s in planned if s)


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
    targets = [t for t, s in planned if s and s.calibrated]
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


def stats_for(t: Target, s: Setting, stats: Mapping[str, InputStats] | None) -> InputStats | None:
    """The calibration statistics ``s`` needs for ``t`` (None when it needs none)."""
    if not s.calibrated:
        return None
    st = (stats or {}).get(t.name)
    if st is None or st.n_tokens == 0:
        raise CompressionError(f"{s.method} needs calibration statistics for {t.name}: run calibrate() first")
    if s.needs_gram and st.gram is None:
        raise CompressionError(f"{s.method} needs the calibration Gram matrix for {t.name}: calibrate with gram=True")
    return st


def check_plan(model: nn.Module, budget: Budget, planned) -> dict[str, Protection]:
    """Protections of the planned targets; every setting's size must exist before any weight changes."""
    try:
        protected = protections(model, budget, [t for t, _ in planned])
    except BudgetError as e:
        raise CompressionError(str(e)) from None
    for t, s in planned:
        if s is not None and getattr(s, "scope", None) != "global":
            try:
                s.size(t.shape, protected.get(t.name), acc.BASE_BITS)
            except BudgetError as e:
                raise CompressionError(f"{t.name}: {e}") from None
    return protected


def _account(t: Target, s: Setting, out: Applied, prot: Protection | None) -> acc.MatrixAccount:
    a = acc.MatrixAccount(
        t.name, t.kind, t.shape, s.method, s.to_dict(), t.n_params, out.stored, int((t.get() != 0).sum()), out.bits
    )
    if s.family == "prune":
        a.nonzero = out.stored  # the mask's count, as stored by a sparse format
    a.protected_cols = int(prot.cols.sum()) if prot is not None and prot.cols is not None else 0
    a.protected_rows = int(prot.rows.sum()) if prot is not None and prot.rows is not None else 0
    return a


def _compress_global(model, group: list[Target], s: Setting, stats, protected, base_bits) -> dict[str, acc.MatrixAccount]:
    """Global-scope pruning: every matrix of ``group`` ranked against one threshold."""
    ws = [t.get() for t in group]
    scores = [s.scores(w, stats_for(t, s, stats)) for t, w in zip(group, ws)]
    prots = [protected.get(t.name) or Protection() for t in group]
    masks = global_masks(scores, s.density, [p.cols for p in prots], [p.rows for p in prots])
    out = {}
    for t, w, mask, p in zip(group, ws, masks, prots):
        t.set(apply_mask(w, mask))
        kept = int(mask.sum())
        out[t.name] = _account(t, s, Applied(t.get(), kept, kept * base_bits), p)
    return out


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
    protected = check_plan(model, budget, planned)
    accounts: dict[str, acc.MatrixAccount] = {}
    global_groups: dict[Setting, list[Target]] = {}
    for t, s in planned:
        if s is None:
            w = t.get()
            accounts[t.name] = acc.dense_account(t.name, t.kind, t.shape, int((w != 0).sum()), base_bits)
        elif getattr(s, "scope", None) == "global":
            global_groups.setdefault(s, []).append(t)
            continue
        else:
            prot = protected.get(t.name)
            try:
                out = s.apply(t.name, t.get(), stats_for(t, s, stats), prot, base_bits, factor_cache)
            except ValueError as e:
                raise CompressionError(f"{t.name}: {e}") from None
            t.set(out.weight)
            accounts[t.name] = _account(t, s, out, prot)
        if progress:
            progress(1)
    for s, group in global_groups.items():
        accounts.update(_compress_global(model, group, s, stats, protected, base_bits))
        if progress:
            progress(len(group))
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
        from capsense.compress.guided import guided_budget

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
            from capsense.compress.guided import write_budget_file

            write_budget_file(tmp / "budget.yaml", allocation.budget)

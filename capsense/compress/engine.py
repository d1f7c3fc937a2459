"""The compression engine: plan a budget over a model's matrices and compress them in place.

:func:`plan` pairs every target matrix with its validated setting, :func:`check_plan` checks
every size before any weight changes, :func:`calibrate` collects the input statistics the
methods need (:func:`stats_for` hands each matrix its own), and :func:`compress_model` edits
the weights in memory and returns exact accounting. The guided allocations
(:mod:`.guided`, :mod:`.measured_sensitivity`) build on this; :mod:`.pipeline` loads a model,
runs them and writes the checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from capsense.errors import BudgetError, CapsenseError
import capsense.compress.accounting as acc
from capsense.compress.budget import Budget, protections, setting_label
from capsense.compress.calibration import DEFAULT_CALIBRATION, InputStats, calibration_samples, collect_stats
from capsense.compress.gptq import output_errors_memory
from capsense.compress.lowrank import stable_rank
from capsense.compress.methods import Applied, Setting
from capsense.compress.protect import Protection
from capsense.compress.prune import apply_mask, global_masks
from capsense.compress.targets import Target, find_targets
from capsense.core.memory import return_freed_memory
from capsense.core.placement import check_device_memory


@dataclass
class CompressionResult:
    """Per-matrix accounts and model totals of one compression."""

    accounts: list[acc.MatrixAccount]
    summary: dict[str, Any]
    budget: dict[str, Any]
    calibration: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    scales: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # quantized matrices' (packing)
    sequential: dict[str, Any] | None = None  # layer by layer (:mod:`.sequential`): {"propagate": ...}; None: one pass

    def to_dict(self, per_matrix: bool = True) -> dict[str, Any]:
        d = {"summary": self.summary, "budget": self.budget, "calibration": self.calibration, "seconds": round(self.seconds, 2)}
        if self.sequential is not None:
            d["sequential"] = self.sequential
        if per_matrix:
            d["matrices"] = [a.to_dict() for a in self.accounts]
        return d


def plan(model: nn.Module, budget: Budget) -> list[tuple[Target, Setting | None]]:
    """Each target matrix with its setting (None = stays dense). Validates every setting."""
    return [(t, budget.setting_for(t)) for t in find_targets(model, budget.targets)]


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
    samples: tuple[list[list[int]], list[dict[str, Any]]] | None = None,
) -> tuple[dict[str, InputStats], list[dict[str, Any]]]:
    """Input statistics of the matrices whose method needs them (empty if none does).

    ``samples``: the calibration token ids and their provenance, already built by
    :func:`~capsense.compress.calibration.calibration_samples` (then ``calibration``, ``n_samples`` and
    ``max_tokens`` are not read), so a caller that needs them before calibrating (the one-pass guided
    memory check, :mod:`.pipeline`) builds them once; None builds them here."""
    planned = plan(model, budget)
    needed, gram = needs_calibration(planned)
    if not needed:
        return {}, []
    samples, info = samples if samples is not None else calibration_samples(calibration, tokenizer, n_samples, max_tokens)
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
        raise CapsenseError(f"{s.method} needs calibration statistics for {t.name}: run calibrate() first")
    if s.needs_gram and st.gram is None:
        raise CapsenseError(f"{s.method} needs the calibration Gram matrix for {t.name}: calibrate with gram=True")
    return st


def check_plan(model: nn.Module, budget: Budget, planned) -> dict[str, Protection]:
    """Protections of the planned targets; every setting's size must exist before any weight changes, and
    ``solve_on: layer`` must have a layer off the CPU (:func:`check_solve_on`)."""
    check_solve_on(planned)
    protected = protections(model, budget, [t for t, _ in planned])
    for t, s in planned:
        if s is not None and getattr(s, "scope", None) != "global":
            try:
                s.size(t.shape, protected.get(t.name), acc.BASE_BITS)
            except BudgetError as e:
                raise BudgetError(f"{t.name}: {e}") from None
    return protected


def check_solve_on(planned, n_levels: int = 1, itemsize: int = 8, available: Callable[[Any], int | None] | None = None
                   ) -> None:
    """``solve_on: layer`` where every matrix it solves is on the CPU changes nothing: an error, not silence. And on
    each device, the largest solve there (:func:`~capsense.compress.gptq.output_errors_memory` of ``n_levels``
    stacked levels of ``itemsize`` bytes: one float64 level to compress a matrix, a guided pricing's levels in
    float32) must fit in what that device has free beside the model (``available(device)``, default
    :func:`~capsense.core.placement.available_device_memory`): refused before any weight changes, not out of
    memory mid-run (a 70B down projection's float64 solve holds up to about 32 GiB; 8B's 8 GiB)."""
    on_layer = [t for t, s in planned if s is not None and s.solves_on_layer]
    if on_layer and all(t.module.weight.device.type == "cpu" for t in on_layer):
        raise BudgetError(f"`solve_on` layer solves each matrix on its layer's device, and all {len(on_layer)} it "
                          "would solve are on the CPU (no device map placing layers on an accelerator): it changes "
                          "nothing. Place the layers with a device map or leave `solve_on` out (cpu)")
    by_device: dict[Any, list[Target]] = {}
    for t in on_layer:
        by_device.setdefault(t.module.weight.device, []).append(t)
    for device, ts in by_device.items():
        need = {"the largest matrix's solve": max(output_errors_memory(n_levels, *t.shape, itemsize) for t in ts)}
        check_device_memory(device, need, "`solve_on` layer", "leave `solve_on` out (each matrix solved on a CPU "
                            "copy), or leave that much free on the device (the device map's max_memory)",
                            None if available is None else available(device))


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


def compress_targets(
    planned: Sequence[tuple[Target, Setting | None]],
    stats: Mapping[str, InputStats] | None,
    protected: Mapping[str, Protection],
    base_bits: int = acc.BASE_BITS,
    factor_cache: dict | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[dict[str, acc.MatrixAccount], dict[str, torch.Tensor]]:
    """Compress each of ``planned`` (target, setting) in place with its own statistics: (accounts,
    quantization scales) by name. What :func:`compress_model` does per matrix, and
    :mod:`.sequential` per decoder layer; global-scope settings are not handled here."""
    accounts: dict[str, acc.MatrixAccount] = {}
    scales: dict[str, torch.Tensor] = {}
    for t, s in planned:
        if s is None:
            w = t.get()
            accounts[t.name] = acc.dense_account(t.name, t.kind, t.shape, int((w != 0).sum()), base_bits)
        else:
            prot = protected.get(t.name)
            try:
                out = s.apply(t.name, t.get(s.solves_on_layer), stats_for(t, s, stats), prot, base_bits, factor_cache)
            except CapsenseError as e:  # e.g. a Gram matrix the calibration data leaves singular
                raise CapsenseError(f"{t.name}: {e}") from None
            t.set(out.weight)
            accounts[t.name] = _account(t, s, out, prot)
            if out.scales is not None:
                scales[t.name] = out.scales.cpu()  # solved on the layer's device under solve_on: layer
            del out
            return_freed_memory()  # the method's temporaries (GPTQ's float64 solve): handed back (capsense.core.memory)
        if progress:
            progress(1)
    return accounts, scales


def is_global(s: Setting | None) -> bool:
    """Whether ``s`` ranks every matrix of its group against one threshold (global-scope pruning)."""
    return getattr(s, "scope", None) == "global"


def compression_result(model: nn.Module, budget: Budget, planned, accounts: Mapping[str, acc.MatrixAccount],
                       scales: dict[str, torch.Tensor], t0: float, base_bits: int = acc.BASE_BITS) -> CompressionResult:
    """The :class:`CompressionResult` of ``planned``'s ``accounts``, in plan order, timed from ``t0``."""
    ordered = [accounts[t.name] for t, _ in planned]
    summary = acc.summarize(ordered, acc.model_param_count(model), base_bits)
    summary["label"] = setting_label(budget.default)
    summary["protected_heads"] = str(budget.protect_heads) if budget.protect_heads is not None else None
    return CompressionResult(ordered, summary, budget.describe(), seconds=time.time() - t0, scales=scales)


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
    accounts, scales = compress_targets([(t, s) for t, s in planned if not is_global(s)], stats, protected,
                                        base_bits, factor_cache, progress)
    global_groups: dict[Setting, list[Target]] = {}
    for t, s in planned:
        if is_global(s):
            global_groups.setdefault(s, []).append(t)
    for s, group in global_groups.items():
        accounts.update(_compress_global(model, group, s, stats, protected, base_bits))
        if progress:
            progress(len(group))
    return compression_result(model, budget, planned, accounts, scales, t0, base_bits)

"""The error-compensating methods as settings: GPTQ (quantization) and SparseGPT (pruning).

They store exactly what RTN and Wanda store (same sizes, same packed checkpoint for GPTQ), but
choose the values with the calibration inputs' Gram matrix (:mod:`.gptq`), so they need
calibration with ``gram``; a run without it is refused before any weight changes.

Pricing levels for a guided allocation: GPTQ's levels are priced with RTN's weight error, and
SparseGPT's with Wanda's scores. Running the solver at every level of every matrix would cost
~30 solves per matrix, and its weight error is the wrong measure anyway: compensation moves
error into directions the inputs do not excite, which raises ``sum F (W - W')^2`` while it lowers
the loss. The allocation then applies the real solver at the chosen level.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from capsense.compress.gptq import PATTERNS, gptq_quantize, sparsegpt_prune
from capsense.compress.prune import check_density, wanda_scores
from capsense.compress.settings import Applied, PruneSetting, QuantSetting, Setting, _free_block, _put_block
from capsense.errors import BudgetError

DAMP = 0.01


def _check_damp(value) -> float:
    d = float(value)
    if not 0.0 < d < 1.0:
        raise BudgetError(f"damp {value} is outside (0, 1): the fraction of the mean Hessian diagonal added (default {DAMP})")
    return d


def _gram(name: str, stats, fc: torch.Tensor) -> torch.Tensor:
    if stats is None or stats.gram is None:
        raise BudgetError(f"{name}: GPTQ and SparseGPT need the calibration Gram matrix (calibrate with gram=True)")
    return stats.gram[fc][:, fc]


@dataclass(frozen=True)
class GPTQSetting(QuantSetting):
    """GPTQ at ``bits`` with a scale per ``group_size`` columns; ``damp`` and activation order."""

    damp: float = DAMP
    act_order: bool = True
    fields: ClassVar[tuple[str, ...]] = ("bits", "group_size", "damp", "act_order")
    calibrated_methods: ClassVar[frozenset[str]] = frozenset({"gptq"})

    @classmethod
    def parse(cls, method: str, d: Mapping[str, Any]) -> GPTQSetting:
        base = QuantSetting.parse(method, d)
        order = d.get("act_order", True)
        if not isinstance(order, bool):
            raise BudgetError(f"act_order {order!r} must be true or false")
        return cls(method, base.bits, base.group_size, _check_damp(d.get("damp", DAMP)), order)

    @property
    def needs_gram(self) -> bool:
        return True

    @property
    def label(self) -> str:
        extra = ("" if self.damp == DAMP else f"/damp{self.damp:g}") + ("" if self.act_order else "/natural")
        return f"{super().label}{extra}"

    def apply(self, name, w, stats, prot, base_bits, cache=None):
        fr, fc = _free_block(w, prot)
        new, scales = gptq_quantize(w[fr][:, fc], _gram(name, stats, fc), self.bits, self.group_size, self.damp, self.act_order)
        stored, bits = self.size(tuple(w.shape), prot, base_bits)
        whole = bool(fr.all() and fc.all())
        return Applied(new.to(w.dtype) if whole else _put_block(w, fr, fc, new), stored, bits, scales if whole else None)

    def levels(self):
        return [GPTQSetting(self.method, s.bits, s.group_size, self.damp, self.act_order) for s in super().levels()]

    def level_costs(self, levels, name, w, sensitivity, stats, prot, base_bits, cache=None):
        rtn = {QuantSetting("rtn", s.bits, s.group_size): s for s in levels}
        priced = Setting.level_costs(next(iter(rtn)), list(rtn), name, w, sensitivity, None, prot, base_bits, cache)
        return [(rtn[r], bits, cost) for r, bits, cost in priced]


@dataclass(frozen=True)
class SparseGPTSetting(PruneSetting):
    """SparseGPT at ``density``: per row (``scope`` row) or two of every four weights (``scope`` 2:4)."""

    damp: float = DAMP
    fields: ClassVar[tuple[str, ...]] = ("density", "scope", "damp")
    calibrated_methods: ClassVar[frozenset[str]] = frozenset({"sparsegpt"})

    @classmethod
    def parse(cls, method: str, d: Mapping[str, Any]) -> SparseGPTSetting:
        if d.get("density") is None:
            raise BudgetError(f"{method} needs a density (fraction of weights kept, in (0, 1]; 0.5 for scope 2:4)")
        scope = d.get("scope") or "row"
        if scope not in PATTERNS:
            raise BudgetError(f"sparsegpt scope {scope!r}: valid scopes are {', '.join(PATTERNS)} "
                              "(its mask is chosen block by block, so not matrix or global)")
        density = check_density(d["density"])
        if scope == "2:4" and density != 0.5:
            raise BudgetError(f"scope 2:4 keeps two of every four weights: density must be 0.5, not {density:g}")
        return cls(method, density, scope, _check_damp(d.get("damp", DAMP)))

    @property
    def needs_gram(self) -> bool:
        return True

    @property
    def label(self) -> str:
        return super().label + ("" if self.damp == DAMP else f"/damp{self.damp:g}")

    def scores(self, w, stats):
        return wanda_scores(w, stats.input_norm)  # pricing only (see the module docstring)

    def size(self, shape, prot, base_bits):
        if self.scope == "2:4":
            kept = shape[0] * shape[1] // 2
            return kept, kept * base_bits
        return super().size(shape, prot, base_bits)

    def apply(self, name, w, stats, prot, base_bits, cache=None):
        n_in = w.shape[1]
        gram = _gram(name, stats, torch.ones(n_in, dtype=torch.bool))
        rows, cols = (prot.rows, prot.cols) if prot is not None else (None, None)
        try:
            new, keep = sparsegpt_prune(w, gram, self.density, self.scope, self.damp, rows, cols)
        except BudgetError as e:
            raise BudgetError(f"{name}: {e}") from None
        kept = int(keep.sum())
        return Applied(new.to(w.dtype), kept, kept * base_bits)

    def levels(self):
        if self.scope == "2:4":
            return [self]
        return [SparseGPTSetting(self.method, s.density, s.scope, self.damp) for s in super().levels()]


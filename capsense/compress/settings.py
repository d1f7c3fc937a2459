"""Compression settings as typed objects, one class per family (pruning, RTN, low rank).

A setting validates itself (:meth:`parse`), names itself (:attr:`label`), states its exact
size before touching a weight (:meth:`size`), and applies itself to one ``[out, in]`` matrix
(:meth:`apply`), leaving protected rows/columns (:class:`~capsense.compress.protect.Protection`)
dense and at full precision. The error-compensating methods (GPTQ, SparseGPT) subclass these
in :mod:`.compensated`; :mod:`.methods` is the registry of method names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from capsense.errors import BudgetError, CapsenseError
from capsense.compress.lowrank import check_ratio, factorize, rank_for_ratio, reconstruct
from capsense.compress.prune import apply_mask, check_density, check_scope, magnitude_scores, mask_from_scores, wanda_scores
from capsense.compress.protect import Protection
from capsense.compress.quantize import check_bits, check_group_size, rtn_bits, rtn_quantize, rtn_quantize_scaled

TYPICAL_SHAPE = (512, 1536)


@dataclass(frozen=True)
class Applied:
    """One matrix after compression: the new weight, parameters stored and bits; for a quantized
    matrix without protection also its ``[out, groups]`` scales (what a packed checkpoint stores)."""

    weight: torch.Tensor
    stored: int
    bits: int
    scales: torch.Tensor | None = None


def _free_block(w: torch.Tensor, prot: Protection | None) -> tuple[torch.Tensor, torch.Tensor]:
    n_out, n_in = w.shape
    p = prot or Protection()
    return p.free_rows(n_out), p.free_cols(n_in)


def _block_key(fr: torch.Tensor, fc: torch.Tensor) -> tuple[int, int]:
    """A cache key of a free block: which rows and columns, not only how many."""
    return hash(fr.numpy().tobytes()), hash(fc.numpy().tobytes())


def _n_protected(shape: tuple[int, int], prot: Protection | None) -> int:
    return prot.n_protected(shape) if prot is not None else 0


def _put_block(w: torch.Tensor, fr: torch.Tensor, fc: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    out = w.clone()
    out[fr.nonzero()[:, 0][:, None], fc.nonzero()[:, 0][None, :]] = block.to(w.dtype)
    return out


@dataclass(frozen=True)
class Setting:
    """Base of the compression settings: ``method`` plus the family's own fields."""

    method: str
    family: ClassVar[str] = ""
    fields: ClassVar[tuple[str, ...]] = ()
    calibrated_methods: ClassVar[frozenset[str]] = frozenset()
    # Solvers that minimise output error on the calibration inputs (GPTQ, SparseGPT): guided to keep a
    # capability, they calibrate on it too (capsense.compress.calibration.kept_calibration).
    compensating: ClassVar[bool] = False
    # Heads a guided allocation protects whole by default: protected weights stay at base bits, dear
    # next to 3-4-bit codes (on SmolLM2 protecting 8 heads under RTN cost more than it saved).
    protect_heads_default: ClassVar[int] = 8

    @property
    def calibrated(self) -> bool:
        """Whether the method needs calibration statistics of the matrix inputs."""
        return self.method in self.calibrated_methods

    @property
    def needs_gram(self) -> bool:
        return False

    @property
    def solves_on_layer(self) -> bool:
        """Whether :meth:`apply` gets the weight on its layer's device, not a CPU copy (GPTQ/SparseGPT's ``solve_on``)."""
        return False

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, **{k: getattr(self, k) for k in self.fields}}

    @classmethod
    def parse(cls, method: str, d: Mapping[str, Any]) -> Setting:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def label(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def size(self, shape: tuple[int, int], prot: Protection | None, base_bits: int) -> tuple[int, int]:
        """Exact (stored parameters, bits) of a matrix of ``shape`` under this setting."""
        raise NotImplementedError  # pragma: no cover

    def typical_bits(self, base_bits: int = 16) -> int:
        """Exact bits on a typical matrix (512 x 1536, where group-size levels differ in size):
        how allocations order and compare the method's levels."""
        return self.size(TYPICAL_SHAPE, None, base_bits)[1]

    def apply(self, name: str, w: torch.Tensor, stats, prot: Protection | None, base_bits: int,
              cache: dict | None = None) -> Applied:
        """Compress ``w`` (``[out, in]``); ``stats`` is the matrix's InputStats when calibrated."""
        raise NotImplementedError  # pragma: no cover

    def levels(self) -> list[Setting]:
        """Candidate settings of this method, cheapest first, for non-uniform allocation."""
        raise NotImplementedError  # pragma: no cover

    def level_costs(self, levels: list[Setting], name: str, w: torch.Tensor, sensitivity: torch.Tensor, stats,
                    prot: Protection | None, base_bits: int, cache: dict | None = None) -> list[tuple[Setting, int, float]]:
        """(level, exact bits, ``sum F (W - W')^2``) of each level that fits this matrix."""
        out = []
        f = sensitivity.float()
        for s in levels:
            try:
                applied = s.apply(name, w, stats, prot, base_bits, cache)
            except CapsenseError:
                continue  # a level this matrix cannot take (a rank below 1)
            out.append((s, applied.bits, float((f * (w.float() - applied.weight.float()).pow(2)).sum())))
        return out


@dataclass(frozen=True)
class PruneSetting(Setting):
    """Unstructured pruning (magnitude or Wanda) at ``density`` compared per ``scope``."""

    density: float = 1.0
    scope: str = "row"
    family: ClassVar[str] = "prune"
    fields: ClassVar[tuple[str, ...]] = ("density", "scope")
    calibrated_methods: ClassVar[frozenset[str]] = frozenset({"wanda"})

    @classmethod
    def parse(cls, method: str, d: Mapping[str, Any]) -> PruneSetting:
        if d.get("density") is None:
            raise BudgetError(f"{method} needs a density (fraction of weights kept, in (0, 1])")
        return cls(method, check_density(d["density"]), check_scope(d.get("scope") or "row"))

    @property
    def label(self) -> str:
        scope = "" if self.scope == "row" else f"/{self.scope}"
        return f"{self.method}@d{self.density:g}{scope}"

    def scores(self, w: torch.Tensor, stats) -> torch.Tensor:
        return wanda_scores(w, stats.input_norm) if self.calibrated else magnitude_scores(w)

    def size(self, shape, prot, base_bits):
        """Every protected weight (dense, at ``base_bits``) plus the unprotected ones kept at ``density``
        among themselves: per free row (``row``) or over the free block (``matrix``)."""
        n_out, n_in = shape
        fr, fc = (prot.free_shape(shape) if prot is not None else (n_out, n_in))
        if self.scope == "row":
            free_kept = fr * round(self.density * fc)
        elif self.scope == "matrix":
            free_kept = round(self.density * fr * fc)
        else:
            raise BudgetError("the size of global-scope pruning depends on every matrix: use scope row or matrix")
        kept = free_kept + _n_protected(shape, prot)
        return kept, kept * base_bits

    def apply(self, name, w, stats, prot, base_bits, cache=None):
        p = prot or Protection()
        mask = mask_from_scores(self.scores(w, stats), self.density, self.scope, p.cols, p.rows)
        kept = int(mask.sum())
        return Applied(apply_mask(w, mask), kept, kept * base_bits)

    def levels(self):
        return [PruneSetting(self.method, round(0.1 + 0.025 * i, 3), self.scope) for i in range(37)]

    def level_costs(self, levels, name, w, sensitivity, stats, prot, base_bits, cache=None):
        """Row scope: one sort per matrix prices every density (cumulative cost of the lowest scores)."""
        if self.scope != "row":
            return super().level_costs(levels, name, w, sensitivity, stats, prot, base_bits, cache)
        p = prot or Protection()
        n_out, n_in = w.shape
        scores = self.scores(w, stats)
        order = torch.argsort(scores, dim=1)
        contrib = (sensitivity.float() * w.float().pow(2)).gather(1, order)
        cum = torch.cat([torch.zeros(n_out, 1), contrib.cumsum(1)], 1).double()
        free_rows = p.free_rows(n_out)
        n_free_cols = int(p.free_cols(n_in).sum())
        out = []
        for s in levels:
            n_pruned = n_free_cols - round(s.density * n_free_cols)  # per free row, as apply() prunes
            # protected columns score +inf in apply(), so they are never among the pruned lowest
            cost = float(cum[free_rows, n_pruned].sum()) if p.cols is None else self._cost_cols(
                scores, sensitivity, w, p, n_pruned, free_rows)
            out.append((s, s.size(tuple(w.shape), prot, base_bits)[1], cost))
        return out

    @staticmethod
    def _cost_cols(scores, sensitivity, w, p: Protection, n_pruned: int, free_rows) -> float:
        sc = scores.clone()
        sc[:, p.cols] = float("inf")
        order = torch.argsort(sc, dim=1)[:, :n_pruned]
        return float((sensitivity.float() * w.float().pow(2)).gather(1, order)[free_rows].sum())


@dataclass(frozen=True)
class QuantSetting(Setting):
    """Symmetric round-to-nearest quantization at ``bits`` with one scale per ``group_size`` columns."""

    bits: int = 16
    group_size: int = 128
    family: ClassVar[str] = "quant"
    fields: ClassVar[tuple[str, ...]] = ("bits", "group_size")
    protect_heads_default: ClassVar[int] = 0

    @classmethod
    def parse(cls, method: str, d: Mapping[str, Any]) -> QuantSetting:
        if d.get("bits") is None:
            raise BudgetError(f"{method} needs bits (2-16)")
        gs = d.get("group_size")
        return cls(method, check_bits(d["bits"]), check_group_size(128 if gs is None else gs))

    @property
    def label(self) -> str:
        return f"{self.method}@{self.bits}b/g{self.group_size}"

    def size(self, shape, prot, base_bits):
        fr, fc = prot.free_shape(shape) if prot is not None else shape
        n = shape[0] * shape[1]
        return n, rtn_bits((fr, fc), self.bits, self.group_size) + (n - fr * fc) * base_bits

    def apply(self, name, w, stats, prot, base_bits, cache=None):
        fr, fc = _free_block(w, prot)
        if not (fr.any() and fc.any()):  # wholly protected (one key/value head, protected): nothing to quantize
            return Applied(w.clone(), *self.size(tuple(w.shape), prot, base_bits), None)
        scales = None
        if _n_protected(tuple(w.shape), prot) == 0:
            new, scales = rtn_quantize_scaled(w, self.bits, self.group_size)
        else:
            new = _put_block(w, fr, fc, rtn_quantize(w[fr][:, fc], self.bits, self.group_size))
        stored, bits = self.size(tuple(w.shape), prot, base_bits)
        return Applied(new, stored, bits, scales)

    def levels(self):
        """Bit widths 2-8, each with groups of 32, 64, 128, 256 columns or one scale per row (finer steps of size)."""
        return [QuantSetting(self.method, b, g) for b in (2, 3, 4, 5, 6, 8) for g in (0, 256, 128, 64, 32)]


@dataclass(frozen=True)
class LowRankSetting(Setting):
    """Rank truncation (svd, asvd, svd-llm) keeping a ``ratio`` of the parameters in factors."""

    ratio: float = 1.0
    alpha: float | None = None  # asvd only
    family: ClassVar[str] = "lowrank"
    calibrated_methods: ClassVar[frozenset[str]] = frozenset({"asvd", "svd-llm"})

    @classmethod
    def parse(cls, method: str, d: Mapping[str, Any]) -> LowRankSetting:
        if d.get("ratio") is None:
            raise BudgetError(f"{method} needs a parameter ratio in (0, 1]")
        alpha = float(d.get("alpha", 0.5)) if method == "asvd" else None
        return cls(method, check_ratio(d["ratio"]), alpha)

    @property
    def needs_gram(self) -> bool:
        return self.method == "svd-llm"

    def to_dict(self):
        return {"method": self.method, "ratio": self.ratio, **({"alpha": self.alpha} if self.alpha is not None else {})}

    @property
    def label(self) -> str:
        return f"{self.method}@r{self.ratio:g}"

    def rank(self, shape, prot) -> int:
        fr, fc = prot.free_shape(shape) if prot is not None else shape
        if fr * fc == 0:  # wholly protected: nothing factorized, the matrix stored whole
            return 0
        try:
            return rank_for_ratio((fr, fc), self.ratio)
        except CapsenseError as e:
            raise BudgetError(str(e)) from None

    def size(self, shape, prot, base_bits):
        fr, fc = prot.free_shape(shape) if prot is not None else shape
        stored = self.rank(shape, prot) * (fr + fc) + shape[0] * shape[1] - fr * fc
        return stored, stored * base_bits

    def apply(self, name, w, stats, prot, base_bits, cache=None):
        fr, fc = _free_block(w, prot)
        if not (fr.any() and fc.any()):  # wholly protected: no factors to take
            return Applied(w.clone(), *self.size(tuple(w.shape), prot, base_bits))
        key = (self.method, name, self.alpha, _block_key(fr, fc))
        factors = cache.get(key) if cache is not None else None
        if factors is None:
            factors = factorize(
                w[fr][:, fc], self.method,
                input_abs_mean=stats.abs_mean[fc] if stats is not None else None,
                gram=stats.gram[fc][:, fc] if stats is not None and stats.gram is not None else None,
                alpha=self.alpha if self.alpha is not None else 0.5,
            )
            if cache is not None:
                factors = tuple(f.float() for f in factors)
                cache[key] = factors
        new = _put_block(w, fr, fc, reconstruct(factors, self.rank(tuple(w.shape), prot)))
        stored, bits = self.size(tuple(w.shape), prot, base_bits)
        return Applied(new, stored, bits)

    def levels(self):
        return [LowRankSetting(self.method, round(0.1 + 0.05 * i, 3), self.alpha) for i in range(19)]

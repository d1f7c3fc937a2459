"""The error-compensating methods as settings: GPTQ (quantization) and SparseGPT (pruning).

They store exactly what RTN and Wanda store (same sizes, same packed checkpoint for GPTQ), but
choose the values with the calibration inputs' Gram matrix (:mod:`.gptq`), so they need
calibration with ``gram``; a run without it is refused before any weight changes. Both solve the
free block alone (rows and columns not protected) with the Gram matrix's free block and put it back,
so protected weights stay bit-identical; :func:`_free_block_costs` prices that same solve.

Pricing levels for a guided allocation (``Guide.pricing``, :data:`PRICINGS`): by **the method's
own result**. Per matrix, all levels are solved together (:func:`~capsense.compress.gptq.gptq_output_errors`,
:func:`~capsense.compress.gptq.sparsegpt_output_errors`: one column loop over the levels' stacked
rows, about the work of the levels' separate passes but without their Python overhead), and a
level costs

    sum_i r_i (dW_i G dW_i^T),   r_i = sum_j F_ij / trace(G),

``dW`` the weight minus its GPTQ result, ``G`` the calibration Gram matrix and ``F`` the kept
capability's Fisher diagonal: the Kronecker-factored reading of the Fisher (``F_ij ~ r_i G_jj``,
output rows' sensitivity times the inputs' second moment), under which the loss change of ``dW``
is that sum. It reduces to ``sum F dW^2`` when the inputs are uncorrelated, but it sees what
compensation does: error moved into input directions the calibration data do not excite costs
little, whereas ``sum F dW^2`` of the GPTQ weight *rises* with compensation. Measured on
SmolLM2-135M, 4 bits g64, equal size (recipes/results/RESULTS-compress.md): keeping math, math's
dL is +0.015 vs uniform's +0.020 (-25%); RTN's weight error under ``F`` (the earlier pricing,
RTN's error at 4 bits being ~8x GPTQ's) gave +0.033, worse than uniform. At 3 bits it is the other
way round: +0.381 vs uniform's +0.393, where the RTN pricing reached +0.218; so that pricing stays
available (:func:`rtn_level_costs`, ``Guide(pricing="rtn")``). Calibrated on the kept
capability too (:func:`capsense.compress.calibration.kept_calibration`), 3 bits still favours it
(keep code -24% vs -13%, keep math -59% vs -42% vs uniform), so the calibrating Gram is not why
the output pricing loses there. The solved errors depend on
the weights, Gram, level and protected block only, so they are cached (``cache``) across
allocations of the same weights; the capability enters only through ``r``.

SparseGPT's densities were priced by Wanda's weight error until round 10 (``pricing="wanda"``,
:func:`wanda_level_costs`, still available); its own output error (the default) costs a solve of
every density (33 in the 0.4x-2x band; ~10 min for SmolLM2 on one core). Measured at density 0.5
with the kept-capability calibration, vs uniform at equal size: keep math -48.4% (Wanda -25.4%) on
SmolLM2 and +26.6% (Wanda +51.1%) on Gemma 3 270M, keep code -18.2% (Wanda -31.1%) on SmolLM2:
neither pricing is better on every row; ``output`` on two of three and on the row measured on
both models (recipes/results/RESULTS-compress.md, round 10).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from capsense.compress.gptq import (PATTERNS, check_pattern, gptq_output_errors, gptq_quantize, row_output_errors,
                                    sparsegpt_output_errors, sparsegpt_prune)
from capsense.compress.prune import check_density, wanda_scores
from capsense.compress.settings import (Applied, PruneSetting, QuantSetting, Setting, _block_key, _free_block, _n_protected,
                                       _put_block)
from capsense.errors import BudgetError

DAMP = 0.01
#: Where a compensating method solves each matrix: ``cpu`` (the default: a CPU copy, one matrix at a time, so the
#: result does not depend on where the layers live) or ``layer`` (on the device its layer lives on, where a device
#: map put it: two CPU cores took 125 s for GPTQ of Llama-3.1-8B's 14,336-wide down projection, round 26,
#: ``recipes/bench/bench_gptq_solve.py``; a GPU has tens of float64 TFLOP/s; not yet timed on one). The codes may
#: then differ from the CPU's in the last bits, as they already do between CPUs (round 23); ``capsense.json``
#: records the device (``made_with``) and the setting ``solve_on: layer``.
SOLVE_ON = ("cpu", "layer")


def _check_damp(value) -> float:
    d = float(value)
    if not 0.0 < d < 1.0:
        raise BudgetError(f"damp {value} is outside (0, 1): the fraction of the mean Hessian diagonal added (default {DAMP})")
    return d


def _check_solve_on(value) -> str:
    if value not in SOLVE_ON:
        raise BudgetError(f"solve_on {value!r}: valid are {', '.join(SOLVE_ON)} (where GPTQ/SparseGPT solve each matrix)")
    return value


class _Solved:
    """What GPTQ and SparseGPT share about their ``solve_on`` field (each declares the field itself, after its own)."""

    solve_on: str

    @property
    def solves_on_layer(self) -> bool:
        return self.solve_on == "layer"

    def to_dict(self) -> dict[str, Any]:
        """``solve_on`` recorded only where it is not the default (CPU runs' records unchanged)."""
        d = super().to_dict()  # type: ignore[misc]
        if d.get("solve_on") == "cpu":
            del d["solve_on"]
        return d


def _gram(name: str, stats, fc: torch.Tensor) -> torch.Tensor:
    if stats is None or stats.gram is None:
        raise BudgetError(f"{name}: GPTQ and SparseGPT need the calibration Gram matrix (calibrate with gram=True)")
    return stats.gram[fc][:, fc]


@dataclass(frozen=True)
class GPTQSetting(_Solved, QuantSetting):
    """GPTQ at ``bits`` with a scale per ``group_size`` columns; ``damp`` and activation order."""

    damp: float = DAMP
    act_order: bool = True
    solve_on: str = "cpu"
    fields: ClassVar[tuple[str, ...]] = ("bits", "group_size", "damp", "act_order", "solve_on")
    calibrated_methods: ClassVar[frozenset[str]] = frozenset({"gptq"})
    compensating: ClassVar[bool] = True

    @classmethod
    def parse(cls, method: str, d: Mapping[str, Any]) -> GPTQSetting:
        base = QuantSetting.parse(method, d)
        order = d.get("act_order", True)
        if not isinstance(order, bool):
            raise BudgetError(f"act_order {order!r} must be true or false")
        return cls(method, base.bits, base.group_size, _check_damp(d.get("damp", DAMP)), order,
                   _check_solve_on(d.get("solve_on") or "cpu"))

    @property
    def needs_gram(self) -> bool:
        return True

    @property
    def label(self) -> str:
        extra = ("" if self.damp == DAMP else f"/damp{self.damp:g}") + ("" if self.act_order else "/natural")
        return f"{super().label}{extra}{'/on-layer' if self.solves_on_layer else ''}"

    def apply(self, name, w, stats, prot, base_bits, cache=None):
        fr, fc = _free_block(w, prot)
        if not (fr.any() and fc.any()):  # every row or every column protected: nothing to quantize
            return Applied(w.clone(), *self.size(tuple(w.shape), prot, base_bits), None)
        new, scales = gptq_quantize(w[fr][:, fc], _gram(name, stats, fc), self.bits, self.group_size, self.damp, self.act_order)
        stored, bits = self.size(tuple(w.shape), prot, base_bits)
        whole = bool(fr.all() and fc.all())
        return Applied(new.to(w.dtype) if whole else _put_block(w, fr, fc, new), stored, bits, scales if whole else None)

    def levels(self):
        return [GPTQSetting(self.method, s.bits, s.group_size, self.damp, self.act_order, self.solve_on)
                for s in super().levels()]

    def level_costs(self, levels, name, w, sensitivity, stats, prot, base_bits, cache=None):
        """(level, exact bits, ``sum_i r_i dW_i G dW_i^T`` of GPTQ's result): see the module docstring."""
        return _free_block_costs(self, levels, name, w, sensitivity, stats, prot, base_bits, cache)

    @staticmethod
    def _output_errors(levels, name, w, gram, free, cache) -> dict:
        """``{level: [rows] dW G dW^T}``, solved once per (matrix, free block, level) per ``cache``;
        the activation-order levels of one damping together."""
        where = _block_key(*free)
        key = {s: ("gptq-output-error", name, s.bits, s.group_size, s.damp, s.act_order, s.solve_on, where) for s in levels}
        cache = {} if cache is None else cache
        todo = [s for s in levels if key[s] not in cache]
        for damp in sorted({s.damp for s in todo if s.act_order}):
            batch = [s for s in todo if s.act_order and s.damp == damp]
            solved = gptq_output_errors(w, gram, [(s.bits, s.group_size) for s in batch], damp)
            cache.update({key[s]: e.double() for s, e in zip(batch, solved)})
        for s in (s for s in todo if not s.act_order):  # natural order: group scales from the updated weights
            cache[key[s]] = row_output_errors(w.double() - gptq_quantize(w, gram, s.bits, s.group_size, s.damp, False)[0].double(), gram)
        return {s: cache[key[s]] for s in levels}


def _free_block_costs(setting, levels, name, w, sensitivity, stats, prot, base_bits, cache):
    """Both methods' pricing: ``setting._output_errors`` of the free block (rows and columns not
    protected, solved with the Gram matrix's free block, as :meth:`apply` solves it), weighted by
    :func:`_output_costs`."""
    fr, fc = _free_block(w, prot)
    gram = _gram(name, stats, fc)
    if fr.any() and fc.any():
        errors = setting._output_errors(levels, name, w[fr][:, fc], gram, (fr, fc), cache)
    else:  # every row or every column protected: no level changes a weight
        errors = {s: torch.zeros(int(fr.sum()), dtype=torch.float64, device=w.device) for s in levels}
    return _output_costs(levels, errors, sensitivity.float()[fr][:, fc], gram, tuple(w.shape), prot, base_bits)


def _output_costs(levels, errors, sensitivity, gram, shape, prot, base_bits) -> list[tuple[Setting, int, float]]:
    """(level, exact bits, ``sum_i r_i errors[level]_i``), ``r_i = sum_j F_ij / trace(G)``."""
    trace = float(torch.diag(gram).sum())
    rows = sensitivity.sum(1).double() / (trace if trace > 0 else 1.0)
    return [(s, s.size(shape, prot, base_bits)[1], float((rows * errors[s].double()).sum())) for s in levels]


def rtn_level_costs(levels, name, w, sensitivity, stats, prot, base_bits, cache=None):
    """GPTQ levels priced as RTN at the same bits and group (``sum F (W - W_rtn)^2``), no solve."""
    rtn = {QuantSetting("rtn", s.bits, s.group_size): s for s in levels}
    priced = Setting.level_costs(next(iter(rtn)), list(rtn), name, w, sensitivity, None, prot, base_bits, cache)
    return [(rtn[r], bits, cost) for r, bits, cost in priced]


@dataclass(frozen=True)
class SparseGPTSetting(_Solved, PruneSetting):
    """SparseGPT at ``density``: per row (``scope`` row) or two of every four weights (``scope`` 2:4)."""

    damp: float = DAMP
    solve_on: str = "cpu"
    fields: ClassVar[tuple[str, ...]] = ("density", "scope", "damp", "solve_on")
    calibrated_methods: ClassVar[frozenset[str]] = frozenset({"sparsegpt"})
    compensating: ClassVar[bool] = True

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
        return cls(method, density, scope, _check_damp(d.get("damp", DAMP)), _check_solve_on(d.get("solve_on") or "cpu"))

    @property
    def needs_gram(self) -> bool:
        return True

    @property
    def label(self) -> str:
        extra = ("" if self.damp == DAMP else f"/damp{self.damp:g}") + ("/on-layer" if self.solves_on_layer else "")
        return super().label + extra

    def scores(self, w, stats):
        return wanda_scores(w, stats.input_norm)  # pricing only (see the module docstring)

    def size(self, shape, prot, base_bits):
        if self.scope == "2:4":  # two of every four free weights; protected ones dense, on top
            check_pattern(self.scope, self.density, shape[1], prot.cols if prot is not None else None)
            fr, fc = prot.free_shape(shape) if prot is not None else shape
            kept = fr * fc // 2 + shape[0] * shape[1] - fr * fc
            return kept, kept * base_bits
        return super().size(shape, prot, base_bits)

    def _check_pattern(self, name, shape, prot) -> None:
        """2:4 needs protected columns in whole groups of four (so the free ones are whole groups too)."""
        try:
            check_pattern(self.scope, self.density, shape[1], prot.cols if prot is not None else None)
        except BudgetError as e:
            raise BudgetError(f"{name}: {e}") from None

    def apply(self, name, w, stats, prot, base_bits, cache=None):
        """SparseGPT of the free block with its Gram block, put back: protected weights bit-identical."""
        self._check_pattern(name, tuple(w.shape), prot)
        fr, fc = _free_block(w, prot)
        new, keep = sparsegpt_prune(w[fr][:, fc], _gram(name, stats, fc), self.density, self.scope, self.damp)
        kept = int(keep.sum()) + _n_protected(tuple(w.shape), prot)
        return Applied(_put_block(w, fr, fc, new), kept, kept * base_bits)

    def level_costs(self, levels, name, w, sensitivity, stats, prot, base_bits, cache=None):
        """(level, exact bits, ``sum_i r_i dW_i G dW_i^T`` of SparseGPT's result): as GPTQ's, module docstring."""
        for s in {s for s in levels if s.scope == "2:4"}:
            s._check_pattern(name, tuple(w.shape), prot)
        return _free_block_costs(self, levels, name, w, sensitivity, stats, prot, base_bits, cache)

    @staticmethod
    def _output_errors(levels, name, w, gram, free, cache) -> dict:
        """``{level: [rows] dW G dW^T}`` of the free block ``w``, solved once per (matrix, free block,
        level) per ``cache``; the row-pattern densities of one damping together."""
        where = _block_key(*free)
        key = {s: ("sparsegpt-output-error", name, s.density, s.scope, s.damp, s.solve_on, where) for s in levels}
        cache = {} if cache is None else cache
        todo = [s for s in levels if key[s] not in cache]
        for scope, damp in sorted({(s.scope, s.damp) for s in todo}):
            batch = [s for s in todo if (s.scope, s.damp) == (scope, damp)]
            if scope == "2:4":  # one level (density 0.5): its own solve
                solved = [row_output_errors(w.double() - sparsegpt_prune(w, gram, 0.5, scope, damp)[0].double(), gram)]
            else:
                solved = sparsegpt_output_errors(w, gram, [s.density for s in batch], damp)
            cache.update({key[s]: e.double() for s, e in zip(batch, solved)})
        return {s: cache[key[s]] for s in levels}

    def levels(self):
        if self.scope == "2:4":
            return [self]
        return [SparseGPTSetting(self.method, s.density, s.scope, self.damp, self.solve_on) for s in super().levels()]



def wanda_level_costs(levels, name, w, sensitivity, stats, prot, base_bits, cache=None):
    """SparseGPT levels priced as Wanda's mask at the same density (``sum F (W - W_wanda)^2``), no solve."""
    return PruneSetting.level_costs(levels[0], levels, name, w, sensitivity, stats, prot, base_bits, cache)


#: How a guided allocation prices a compensating method's levels, per method (the first: its default):
#: ``output`` (the Fisher-weighted output error of the method's own solved weights, module docstring),
#: ``rtn`` (GPTQ as RTN at the same bits and group) or ``wanda`` (SparseGPT as Wanda's mask at the
#: same density): the cheaper proxies, kept as options because they were measured better on some rows.
PRICINGS: dict[str, dict[str, Any]] = {
    "gptq": {"output": None, "rtn": rtn_level_costs},
    "sparsegpt": {"output": None, "wanda": wanda_level_costs},
}


#: Every pricing some method has (``capsense compress --pricing`` offers these).
PRICING_NAMES = tuple(sorted({p for by in PRICINGS.values() for p in by}))


def check_pricing(pricing: str) -> str:
    """``pricing`` if some method has it, else one error naming the valid ones."""
    if pricing not in PRICING_NAMES:
        raise BudgetError(f"`pricing` {pricing!r}: valid pricings are {', '.join(PRICING_NAMES)}")
    return pricing


def level_pricer(method: str, pricing: str | None):
    """(the pricing's name, the level-cost function for :func:`~capsense.compress.allocate.matrix_candidates`
    or None for the setting's own); for a method without pricings, (None, None). ``pricing`` given
    for a method it does not apply to is an error."""
    by = PRICINGS.get(method)
    if by is None:
        if pricing is not None:
            raise BudgetError(f"`pricing` applies to methods {', '.join(PRICINGS)}, not {method}")
        return None, None
    name = next(iter(by)) if pricing is None else pricing
    if name not in by:
        raise BudgetError(f"`pricing` {name!r} does not apply to {method}: valid for {method} are {', '.join(by)}")
    return name, by[name]

"""Capability-guided compression: keep the named capabilities, shrink the rest, at a given size.

Design (why it is built this way):

* **Size to match.** The uniform setting (``wanda`` at density 0.5, ``rtn`` at 3 bits, ...) names
  the size: its exact bits over the target matrices (or a model size ratio, when given) are the
  budget the allocation may not exceed. The allocation fills it to within one level step.
* **Sensitivity from gradients.** One backward pass per calibration text of the kept
  capabilities (their last documents, never the probe documents that measure them) gives the
  Fisher diagonal ``F`` of their loss for every weight, so every matrix, layer and head gets a
  sensitivity from the same few seconds of compute, for any capability and model. The estimate
  is second order: it underprices large perturbations (2-3-bit RTN). ``sensitivity="measured"``
  (:mod:`capsense.compress.measured_sensitivity`) prices each layer's attention/MLP levels by the kept
  capabilities' loss measured in the uniformly compressed model instead; on SmolLM2 at 3-bit RTN
  that did not do better (recipes/results/RESULTS-compress.md), so the default stays the Fisher.
* **Whole heads protected.** The kept capability's most important heads (by the same Fisher
  estimate, or a located heads file) keep their query rows, their KV group's key/value rows
  and their output-projection columns dense and at full precision; their cost counts in the
  size.
* **Allocation.** Each matrix takes one level of the method (density, bits or ratio) chosen by
  :func:`capsense.compress.allocate.allocate` minimising ``sum F (W - W')^2`` at the budget
  (GPTQ and SparseGPT: the Fisher-weighted output error of their own result, :mod:`capsense.compress.compensated`).
* **Calibration.** GPTQ and SparseGPT guided by ``keep`` calibrate on the default mix plus the kept
  capabilities unless told otherwise (:func:`capsense.compress.calibration.kept_calibration`, chosen
  by :func:`capsense.compress.request.default_calibration`): on SmolLM2 most of the guided gain.
* **Checked against uniform.** The pipeline compresses with the allocation and with the uniform
  setting (and the other pricing's allocation) and ships the lowest kept-capability loss on
  calibration documents, recording each paired difference to the allocation with its standard error
  (:mod:`capsense.compress.select`, ``Guide.check_uniform``): on Gemma 3 270M
  the Fisher-priced SparseGPT allocation measured worse on math than the uniform setting it was meant to beat.

The result is an ordinary :class:`~capsense.compress.budget.Budget` (per-matrix overrides plus
whole-head protection), written as a budget file that reproduces it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import capsense.compress.accounting as acc
from capsense.core.registry import Registry
from capsense.compress.allocate import Candidate, allocate, matrix_candidates
from capsense.compress.budget import Budget, Override, protections
from capsense.errors import BudgetError
from capsense.compress.capabilities import parse_capabilities
from capsense.compress.compensated import check_pricing, level_pricer
from capsense.compress.measured_sensitivity import check_unit, measured_allocation
from capsense.compress.methods import Setting, parse_setting
from capsense.compress.packed import unstorable
from capsense.compress.targets import find_targets

#: How levels are priced (see :class:`Guide`).
SENSITIVITIES: Registry[str] = Registry("sensitivity", "sensitivities", BudgetError)
for _name in ("kept", "generic", "flat", "measured"):
    SENSITIVITIES.register(_name, _name)


@dataclass
class Guide:
    """How to guide an allocation.

    ``keep``: capabilities to keep. ``sensitivity``: ``kept`` (Fisher of the kept capabilities'
    loss), ``generic`` (Fisher on the generic calibration text: a capability-agnostic control) or
    ``flat`` (``F = 1`` and only the uniform level and the one below it: protection's cost spread
    as evenly as the levels allow) or ``measured`` (each ``unit``'s levels priced by the kept
    capabilities' measured loss in the uniformly compressed model, ``n_levels`` levels per unit:
    :mod:`capsense.compress.measured_sensitivity`). ``protect_top_k``: heads protected per kept capability
    (0: none; None: the method's default); ``heads`` overrides the gradient's choice with given heads.
    ``pricing`` (GPTQ and SparseGPT only): ``output`` (default; the method's own solved output error),
    or the cheaper proxy ``rtn`` (GPTQ) / ``wanda`` (SparseGPT) (:mod:`capsense.compress.compensated`).
    ``check_uniform`` (a run at the uniform setting's size): compress with the allocation and with the
    uniform setting, keep the one with the lowest kept-capability loss on the calibration documents
    (:mod:`capsense.compress.select`; the Fisher estimate picked allocations worse than uniform), on
    ``check_docs`` documents per kept capability (default: the ``samples`` the Fisher read). ``fisher_groups``:
    sum the Fisher over that many runs of consecutive decoder layers in turn, a pass over the texts each:
    the sums held at once (4 bytes per target weight; 26 GiB on Llama-3.1-8B) divided by it, the backward
    passes multiplied by it, the same sums bit for bit (:mod:`capsense.compress.spill`).
    """

    keep: list[str]
    sensitivity: str = "kept"
    protect_top_k: int | None = None  # None: the method's default (8 for pruning and low-rank, 0 for RTN)
    heads: Any = None
    samples: int = 32
    size_ratio: float | None = None  # model size to match; None: the uniform setting's size
    generic: str = "prose"
    spread: tuple[float, float] = (0.4, 2.0)  # levels' size per parameter within these factors of the uniform's
    unit: str = "kind"  # measured only: "kind" (a layer's attention or MLP) or "layer"
    n_levels: int = 6  # measured only: levels per unit (one measured forward each)
    rounds: int = 1  # measured only: > 1 measures again around the previous round's allocation
    pricing: str | None = None  # gptq/sparsegpt: "output" (the default), "rtn"/"wanda" (capsense.compress.compensated)
    check_uniform: bool = True  # ship uniform (or the other pricing) when it measures better (capsense.compress.select)
    check_docs: int | None = None  # documents per kept capability that check measures; None: ``samples`` (the Fisher's)
    fisher_groups: int = 1  # the Fisher summed over this many runs of decoder layers in turn (memory / n, passes x n)
    include_path: Sequence[str] = ()  # folders of task YAMLs that declare kept capabilities (a user's tasks)

    def __post_init__(self) -> None:
        self.keep = parse_capabilities(self.keep, self.include_path)
        SENSITIVITIES.check(self.sensitivity)
        if self.protect_top_k is not None and self.protect_top_k < 0:
            raise BudgetError(f"protect_top_k must be >= 0, got {self.protect_top_k}")
        check_unit(self.unit)
        if self.fisher_groups < 1:
            raise BudgetError(f"fisher_groups must be at least 1, got {self.fisher_groups}")
        if self.rounds < 1:
            raise BudgetError(f"rounds must be at least 1, got {self.rounds}")
        if self.n_levels < 2:
            raise BudgetError(f"n_levels must be at least 2 (the uniform level and another), got {self.n_levels}")
        if self.pricing is not None:
            check_pricing(self.pricing)
        if self.check_docs is not None and (self.check_docs < 1 or not self.check_uniform):
            raise BudgetError(f"check_docs ({self.check_docs}) is the number of calibration documents the uniform check "
                              "measures: it needs check_uniform and at least 1")
        if self.size_ratio is not None and not 0 < self.size_ratio <= 1:
            raise BudgetError(f"size ratio {self.size_ratio} is outside (0, 1]: it is the model's size over its dense size")


@dataclass
class Allocation:
    """A guided budget and what chose it."""

    budget: Budget
    info: dict[str, Any] = field(default_factory=dict)


def _fisher(model, targets, source: str, n: int, log, cache: dict | None, groups: int,
            samples: Sequence[Sequence[int]]) -> Mapping[str, torch.Tensor]:
    """The Fisher diagonal of ``source``'s loss on its ``n`` calibration texts ``samples`` (:func:`fisher_texts`),
    summed over ``groups`` runs of decoder layers in turn (a pass over the texts each; the same sums) and moved to
    disk as soon as a run is summed (:func:`~capsense.compress.spill.spill_fisher`: read back one matrix at a time)."""
    from capsense.compress.sensitivity import fisher_diagonal
    from capsense.compress.spill import Spill, layer_groups, spill_fisher

    key = (source, n, tuple(t.name for t in targets))
    if cache is not None and key in cache:
        return cache[key]
    parts = layer_groups(targets, groups)
    log(f"sensitivity: {len(samples) * len(parts)} backward passes on {source}")
    fisher = Spill(f"fisher-{source}")
    for part in parts:
        spill_fisher(part, fisher_diagonal(model, part, samples), fisher)
    if cache is not None:
        cache[key] = fisher
    return fisher


def fisher_texts(tokenizer, guide: Guide, base: Setting) -> dict[str, list[list[int]]]:
    """The token ids of the texts a run guided by ``guide`` at ``base`` runs its Fisher passes over, by source
    (:func:`fisher_sources`; empty: it sums no Fisher). Built once per run (:mod:`.pipeline`): the memory check
    counts the longest (:func:`fisher_tokens`), then the passes read them (``texts`` of :func:`plan_guided`);
    round 19 tokenized them for each. Each source's ``guide.samples`` texts, cut at
    :data:`~capsense.compress.sensitivity.FISHER_MAX_TOKENS`."""
    from capsense.compress.calibration import calibration_samples
    from capsense.compress.sensitivity import FISHER_MAX_TOKENS

    return {source: calibration_samples(source, tokenizer, guide.samples, max_tokens=FISHER_MAX_TOKENS,
                                        include_path=guide.include_path)[0] for source in fisher_sources(guide, base)}


def fisher_tokens(texts: Mapping[str, Sequence[Sequence[int]]]) -> int:
    """The tokens of the longest of a run's Fisher ``texts`` (:func:`fisher_texts`; 0: it sums no Fisher): one
    backward pass per text, whose activations grow with its length
    (:func:`~capsense.compress.sensitivity.backward_memory`)."""
    return max((len(ids) for by_source in texts.values() for ids in by_source), default=0)


def _protected_heads(model, targets, guide: Guide, top_k: int, fishers: Mapping[str, Mapping[str, torch.Tensor]]):
    """The heads kept whole: ``guide.heads`` when given, else each kept capability's ``top_k`` by its Fisher
    (``fishers``, by source); None when none are."""
    from capsense.core.heads import HeadSet
    from capsense.errors import HeadSpecError
    from capsense.compress.sensitivity import head_scores, top_heads

    if top_k == 0 and guide.heads is None:
        return None
    if guide.heads is not None:
        try:
            return HeadSet.parse(guide.heads)
        except HeadSpecError as e:
            raise BudgetError(f"protect: {e}") from None
    picked: list = []
    for cap in guide.keep:
        picked += list(top_heads(head_scores(model, targets, fishers[cap]), top_k))
    return HeadSet(tuple(picked))


def target_bits(model: nn.Module, base: Setting, targets, size_ratio: float | None, base_bits: int = acc.BASE_BITS) -> int:
    """Bits the compressed matrices may use: the uniform setting's exact size, or what ``size_ratio`` leaves."""
    if size_ratio is None:
        return sum(base.size(t.shape, None, base_bits)[1] for t in targets)
    n_model = acc.model_param_count(model)
    rest = n_model - sum(t.n_params for t in targets)
    bits = int(size_ratio * n_model * base_bits) - rest * base_bits
    if bits <= 0:
        raise BudgetError(
            f"size ratio {size_ratio} is below what the uncompressed embeddings and norms alone take "
            f"({rest / n_model:.4f} of the model)"
        )
    return bits


def _levels(base: Setting, flat: bool, spread: tuple[float, float]) -> list[Setting]:
    """Candidate levels: size per parameter within ``spread`` of ``base`` (the second-order cost
    estimate is trusted only near it), or for ``flat`` just ``base`` and the level below it."""
    def bits(s: Setting) -> int:
        return s.typical_bits(acc.BASE_BITS)

    b0 = bits(base)
    if flat:
        lower = [s for s in base.levels() if bits(s) < b0]
        return ([max(lower, key=bits)] if lower else []) + [base]
    return [s for s in base.levels() if spread[0] * b0 <= bits(s) <= spread[1] * b0]


@dataclass
class GuidedPlan:
    """What a guided allocation prices every matrix's levels with, fixed before any matrix is priced: the uniform
    setting, the pricing, the size to match, the protected heads and their protections, the per-weight sensitivity
    and the levels. :func:`price_matrices` prices any subset of ``targets`` from their own calibration statistics
    (one decoder layer's, :mod:`.guided_sequential`); :func:`allocation_from_prices` allocates from all the prices."""

    guide: Guide
    base: Setting
    pricing: str | None
    price: Any
    targets: list
    goal: int
    heads: Any
    budget: Budget
    prot: dict
    fisher: Mapping[str, torch.Tensor] | None  # None for a measured sensitivity; read one matrix at a time
    levels: list[Setting]


def guided_setting(budget: Budget) -> Setting:
    """The uniform setting (``budget.default``) whose levels a guided allocation prices: refused unless its method
    has row or matrix scope."""
    base = parse_setting(budget.default)
    if base is None or getattr(base, "scope", "row") == "global":
        raise BudgetError("guided allocation needs a method with row or matrix scope (not skip or global)")
    return base


def _top_k(guide: Guide, base: Setting) -> int:
    """Heads protected per kept capability: ``guide.protect_top_k``, or the method's default when None."""
    return base.protect_heads_default if guide.protect_top_k is None else guide.protect_top_k


def fisher_sources(guide: Guide, base: Setting) -> list[str]:
    """The calibration sources whose Fisher diagonal a run guided by ``guide`` at ``base`` sums, each once, in
    the order summed: every kept capability when the sensitivity is theirs (``kept``) or their Fishers pick the
    heads to protect (a ``protect_top_k`` above 0, no ``heads`` given), then the generic text for a ``generic``
    sensitivity (once, when it is also kept: the same Fisher); none for a ``flat`` or ``measured`` run that picks
    no heads. The one rule for what :func:`plan_guided` sums and for what a guided run's checks count: the
    Fisher's memory (``check_guided_memory``) and its files on disk, one per source (``check_guided_disk``)."""
    kept = guide.keep if guide.sensitivity == "kept" or (_top_k(guide, base) and guide.heads is None) else []
    return list(dict.fromkeys([*kept, *([guide.generic] if guide.sensitivity == "generic" else [])]))


def plan_guided(model: nn.Module, tokenizer, base_budget: Budget, guide: Guide, log: Callable[[str], None],
                fisher_cache: dict | None = None, packed: bool = False,
                texts: Mapping[str, Sequence[Sequence[int]]] | None = None) -> GuidedPlan:
    """Everything :func:`guided_budget` fixes before pricing a matrix (the Fisher diagonals of
    :func:`fisher_sources` are computed here: backward passes through the whole model); no calibration
    statistics are read. ``texts``: the run's Fisher texts, built once (:func:`fisher_texts`); None
    builds them here."""
    base = guided_setting(base_budget)
    if guide.pricing is not None and guide.sensitivity == "measured":
        raise BudgetError("`pricing` applies to a Fisher, generic or flat sensitivity, not measured (which measures the loss)")
    pricing, price = level_pricer(base.method, guide.pricing)
    targets = find_targets(model, base_budget.targets)
    goal = target_bits(model, base, targets, guide.size_ratio)
    texts = texts if texts is not None else fisher_texts(tokenizer, guide, base)
    fishers = {s: _fisher(model, targets, s, guide.samples, log, fisher_cache, guide.fisher_groups, texts[s])
               for s in fisher_sources(guide, base)}
    heads = _protected_heads(model, targets, guide, _top_k(guide, base), fishers)
    budget = Budget(default=base.to_dict(), targets=base_budget.targets, protect_heads=heads, whole_heads=heads is not None)
    fisher = _sensitivity(targets, guide, fishers, fisher_cache)
    levels = guided_levels(base, guide, targets, packed)
    return GuidedPlan(guide, base, pricing, price, targets, goal, heads, budget, protections(model, budget, targets),
                      fisher, levels)


def _sensitivity(targets, guide: Guide, fishers: Mapping[str, Mapping[str, torch.Tensor]], cache: dict | None):
    """The per-weight sensitivity the levels are priced with (None: measured), from ``fishers`` (by source:
    :func:`fisher_sources`), kept in ``cache`` so that the other pricing's allocation reads the same tensors
    (:mod:`.guided_sequential`). Nothing of the model's size is held: the kept capabilities' sum is made one
    matrix at a time from their spilled Fishers when read (the same sum, in the same order, as summing them all
    at once), flat's ones too."""
    from capsense.compress.spill import Lazy

    if guide.sensitivity == "measured":
        return None
    if guide.sensitivity == "generic":
        return fishers[guide.generic]
    key = (guide.sensitivity, tuple(guide.keep), guide.samples, tuple(t.name for t in targets))
    if cache is not None and key in cache:
        return cache[key]
    names = [t.name for t in targets]
    if guide.sensitivity == "kept":
        parts = tuple(fishers[c] for c in guide.keep)
        fisher = Lazy(names, lambda name: sum(f[name] for f in parts))
    else:  # flat
        shapes = {t.name: t.shape for t in targets}
        fisher = Lazy(names, lambda name: torch.ones(shapes[name]))
    if cache is not None:
        cache[key] = fisher
    return fisher


def guided_levels(base: Setting, guide: Guide, targets, packed: bool = False) -> list[Setting]:
    """The levels a guided allocation prices for every matrix (:func:`_levels`, those packable with ``packed``)."""
    return _storable(_levels(base, guide.sensitivity == "flat", guide.spread), targets, packed)


def price_matrices(plan: GuidedPlan, targets, stats, cache: dict | None = None) -> dict[str, list[Candidate]]:
    """Each of ``targets``' levels with its exact bits and estimated cost (:func:`matrix_candidates`), from ``stats``
    (their calibration statistics: only theirs are read). ``cache``: what the prices are computed from (GPTQ's solved
    errors, low-rank factors), reused across plans of the same weights. Each solve's freed heap goes back before the
    next (without it RSS grew 45-70 MiB per SmolLM2-width layer, round 20)."""
    from capsense.core.memory import return_freed_memory
    prices = {}
    for t in targets:
        stat = stats.get(t.name) if plan.base.calibrated else None
        w = t.get(plan.price is None and plan.base.solves_on_layer)  # the method's own solve: where it runs
        prices[t.name] = matrix_candidates(t.name, w, plan.fisher[t.name], plan.levels, stat, plan.prot.get(t.name),
                                           acc.BASE_BITS, cache, dense=False, price=plan.price)
        return_freed_memory()
    return prices


def allocation_from_prices(plan: GuidedPlan, cands: Mapping[str, Sequence[Candidate]]) -> Allocation:
    """The allocation (:func:`allocate`) of every planned matrix's priced levels at the plan's size."""
    chosen = allocate(cands, plan.goal)
    budget = plan.budget
    budget.overrides = [
        Override(match=name, setting=(c.setting.to_dict() if c.setting is not None else {"skip": True}))
        for name, c in chosen.items()
        if c.setting != plan.base
    ]
    guide = plan.guide
    info = {
        "keep": guide.keep, "sensitivity": guide.sensitivity, "uniform": plan.base.to_dict(), "spread": list(guide.spread),
        "pricing": plan.pricing,
        "protected_heads": str(plan.heads) if plan.heads is not None else None, "target_bits": plan.goal,
        "allocated_bits": sum(c.bits for c in chosen.values()),
        "estimated_cost": sum(c.cost for c in chosen.values()),
        "per_matrix": {name: (c.setting.label if c.setting is not None else "dense") for name, c in chosen.items()},
    }
    return Allocation(budget, info)


def guided_budget(
    model: nn.Module, tokenizer, base_budget: Budget, stats, guide: Guide, log: Callable[[str], None] | None = None,
    fisher_cache: dict | None = None, packed: bool = False, texts: Mapping[str, Sequence[Sequence[int]]] | None = None,
) -> Allocation:
    """The allocation of ``base_budget.default``'s method at its size, guided by ``guide``.

    ``fisher_cache`` (a dict the caller keeps) reuses sensitivities and what the levels' prices are
    computed from (GPTQ's solved errors, low-rank factors) across calls on the same weights;
    ``packed`` keeps only the levels a compressed-tensors checkpoint stores for every target matrix;
    ``texts``: the run's Fisher texts (:func:`fisher_texts`; None: tokenized here).
    """
    log = log or (lambda _m: None)
    plan = plan_guided(model, tokenizer, base_budget, guide, log, fisher_cache, packed, texts)
    if guide.sensitivity == "measured":
        return _measured(model, tokenizer, plan.budget, plan.base, plan.targets, plan.goal, plan.prot, stats, guide,
                         plan.heads, log, packed)
    cache: dict = fisher_cache.setdefault("level_costs", {}) if fisher_cache is not None else {}
    log(f"pricing {len(plan.targets)} matrices x {len(plan.levels)} levels ({plan.pricing or guide.sensitivity})")
    return allocation_from_prices(plan, price_matrices(plan, plan.targets, stats, cache))


def _storable(levels: list[Setting], targets, packed: bool) -> list[Setting]:
    """With ``packed``, the levels every target can be packed at (e.g. no group of 128 on 576 columns)."""
    if not packed:
        return levels
    return [s for s in levels if all(unstorable(t.shape, s, False, not t.transposed) is None for t in targets)]


def _measured(model, tokenizer, budget: Budget, base: Setting, targets, goal: int, prot, stats, guide: Guide, heads,
              log, packed: bool = False) -> Allocation:
    overrides, info = measured_allocation(
        model, tokenizer, guide.keep, base, targets, goal, _storable(_levels(base, False, guide.spread), targets, packed),
        prot, stats, guide.unit, guide.n_levels, guide.samples, log, rounds=guide.rounds, include_path=guide.include_path)
    budget.overrides = overrides
    info = {"keep": guide.keep, "sensitivity": "measured", "uniform": base.to_dict(), "spread": list(guide.spread),
            "protected_heads": str(heads) if heads is not None else None, "target_bits": goal, **info}
    return Allocation(budget, info)

"""Ship the better of a guided allocation and the uniform setting, measured on calibration documents.

A guided allocation (:mod:`capsense.compress.guided`) is chosen by a second-order estimate of the kept
capabilities' loss (the Fisher diagonal times the squared weight or output error). That estimate can
be wrong, and when it is the allocation ships a model worse on the kept capability than the uniform
setting of the same size. Measured (recipes/results/RESULTS-compress.md, round 10-11): Gemma 3 270M,
SparseGPT density 0.5, keep math, calibrated on the kept mix: uniform +0.077 nats/token on the
held-out math probes, the guided allocation +0.108 (output-priced) or +0.128 (Wanda-priced).

So a guided run compresses the model with each candidate budget from the same weights and the same
calibration statistics (the guided allocation; for GPTQ and SparseGPT at the default pricing also the
allocation priced by the method's cheaper proxy, as neither pricing won every measured row; and the
uniform setting, whose size every allocation matches or undercuts), measures each kept capability's loss on its **calibration documents** (the last
``n_docs`` documents of its task: the ones its Fisher was computed on; never the first documents,
which are the held-out probes that report the result), and keeps the candidate with the lowest
summed dL in the model. Ties go to the first candidate (the guided allocation). What was measured
is returned as a record for ``capsense.json`` and the card.

Cost: one more compression pass and one forward over the kept capabilities' calibration documents
per candidate; memory: a copy of the target matrices (the original) and of the best candidate's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from capsense.compress.budget import Budget
from capsense.compress.engine import CompressionResult, compress_model
from capsense.compress.targets import find_targets, restore, snapshot
from capsense.errors import BudgetError


@dataclass
class Selection:
    """The candidate left in the model: its name, budget and compression result, and the measurements."""

    chosen: str
    budget: Budget
    result: CompressionResult
    record: dict[str, Any]


def compress_better(
    model: nn.Module, tokenizer, candidates: Sequence[tuple[str, Budget]], stats, keep: Sequence[str], n_docs: int,
    log: Callable[[str], None] | None = None,
) -> Selection:
    """Compress ``model`` with each of ``candidates`` (name, budget) from its current weights, measure
    ``keep``'s loss on their last ``n_docs`` documents (calibration documents, not the probes) and leave
    the candidate with the lowest summed dL in the model (ties: the earlier candidate).

    The record: ``{"documents": "last", "n_docs", "capabilities", "dL": {name: {cap: dL}}, "chosen"}``.
    """
    from capsense.compress.capability_loss import capability_probe, measure

    if len(candidates) < 1 or len({n for n, _ in candidates}) != len(candidates):
        raise BudgetError(f"candidates need distinct names, at least one; got {[n for n, _ in candidates]}")
    if n_docs < 1:
        raise BudgetError(f"`n_docs` (calibration documents measured per kept capability) must be >= 1, got {n_docs}")
    log = log or (lambda _m: None)
    sets = {cap: capability_probe(cap, tokenizer, n_docs, use="calibration") for cap in keep}
    before = {cap: m.nll for cap, m in measure(model, sets).items()}
    targets = find_targets(model, candidates[0][1].targets)
    original, best_weights = snapshot(targets), None
    dls: dict[str, dict[str, float]] = {}
    best: tuple[float, str, Budget, CompressionResult] | None = None
    for i, (name, budget) in enumerate(candidates):
        if i:
            restore(targets, original)
        result = compress_model(model, budget, stats)
        dls[name] = {cap: m.nll - before[cap] for cap, m in measure(model, sets).items()}
        score = sum(dls[name].values())
        log(f"{name}: dL on {n_docs} calibration documents of {', '.join(keep)}: {score:+.4f}")
        if best is None or score < best[0]:
            best = (score, name, budget, result)
            best_weights = snapshot(targets) if i < len(candidates) - 1 else None
    assert best is not None
    if best_weights is not None:  # the best was not the last one compressed
        restore(targets, best_weights)
    record = {"documents": "last", "n_docs": n_docs, "capabilities": list(keep), "dL": dls, "chosen": best[1]}
    return Selection(best[1], best[2], best[3], record)


def proxy_pricing(uniform: Budget, guide) -> str | None:
    """The second pricing a checked guided run also allocates with: the method's cheaper proxy (``rtn``
    for GPTQ, ``wanda`` for SparseGPT) when ``guide`` leaves the pricing at its default, checks against
    uniform at its size and prices by a Fisher (not ``measured``); else None."""
    from capsense.compress.compensated import PRICINGS
    from capsense.compress.methods import parse_setting

    base = parse_setting(uniform.default)
    by = PRICINGS.get(base.method) if base is not None else None
    if not by or guide.pricing is not None or guide.sensitivity == "measured" or not checks_uniform(guide):
        return None
    return list(by)[1]


def checks_uniform(guide) -> bool:
    """Whether a run guided by ``guide`` measures its allocations against the uniform setting."""
    return guide is not None and guide.check_uniform and guide.size_ratio is None


def guided_candidates(model: nn.Module, tokenizer, uniform: Budget, stats, guide, log=None, cache: dict | None = None,
                      packed: bool = False):
    """(name, :class:`~capsense.compress.guided.Allocation`) to measure: ``guided`` (``guide`` as given)
    and, where :func:`proxy_pricing` names one, ``guided-PRICING`` (the same Fisher, levels priced by the
    proxy: on SmolLM2 SparseGPT keep code the proxy's allocation was the better, -31% vs -18%, and on
    Gemma keep math the worse, round 10). One Fisher for both: ``cache`` (:func:`guided_budget`'s
    ``fisher_cache``; a new one when None)."""
    from dataclasses import replace

    from capsense.compress.guided import guided_budget

    cache = {} if cache is None else cache
    out = [("guided", guided_budget(model, tokenizer, uniform, stats, guide, log, cache, packed))]
    proxy = proxy_pricing(uniform, guide)
    if proxy is not None:
        out.append((f"guided-{proxy}", guided_budget(model, tokenizer, uniform, stats, replace(guide, pricing=proxy),
                                                     log, cache, packed)))
    return out


def compress_guided(model: nn.Module, tokenizer, uniform: Budget, allocations, stats, guide,
                    log: Callable[[str], None] | None = None) -> tuple[CompressionResult, Budget, Any]:
    """Compress ``model`` as a guided run ships it: (the result, the budget left in the model, the
    allocation whose ``info`` describes it, or None).

    ``allocations``: (name, :class:`~capsense.compress.guided.Allocation`) candidates, the first the
    guide's own (:func:`guided_candidates`); empty (no guide) compresses with ``uniform``. When
    :func:`checks_uniform`, the best of the candidates and ``uniform`` on the kept capabilities'
    calibration documents (:func:`compress_better`, ``guide.samples`` documents each: those the Fisher
    read), recorded in the returned allocation's ``info["selection"]`` (the chosen allocation's, or the
    first's when uniform is chosen); else the first allocation as it is.
    """
    log = log or (lambda _m: None)
    if not allocations:
        return compress_model(model, uniform, stats), uniform, None
    if not checks_uniform(guide):
        first = allocations[0][1]
        return compress_model(model, first.budget, stats), first.budget, first
    log(f"compressing with {', '.join(n for n, _ in allocations)} and uniform; keeping the best on calibration documents")
    sel = compress_better(model, tokenizer, [(n, a.budget) for n, a in allocations] + [("uniform", uniform)], stats,
                          guide.keep, guide.samples, log)
    allocation = dict(allocations).get(sel.chosen, allocations[0][1])
    allocation.info["selection"] = sel.record
    return sel.result, sel.budget, allocation

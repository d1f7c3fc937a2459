"""Ship the guided allocation or a candidate (uniform, another pricing) measured better on calibration documents.

A guided allocation (:mod:`capsense.compress.guided`) is chosen by a second-order estimate of the kept
capabilities' loss (the Fisher diagonal times the squared weight or output error). That estimate can
be wrong, and when it is the allocation ships a model worse on the kept capability than the uniform
setting of the same size. Measured (recipes/results/RESULTS-compress.md, round 10-11): Gemma 3 270M,
SparseGPT density 0.5, keep math, calibrated on the kept mix: uniform +0.077 nats/token on the
held-out math probes, the guided allocation +0.108 (output-priced) or +0.128 (Wanda-priced).

So a guided run compresses the model with each candidate budget from the same weights and the same
calibration statistics (the guided allocation; for GPTQ and SparseGPT at the default pricing also the
allocation priced by the method's cheaper proxy, as neither pricing won every measured row; and the
uniform setting, whose size every allocation matches or undercuts), measures each kept capability's
loss on its **calibration documents** (the last ``n_docs`` documents of its task: the ones its
Fisher was computed on; never the first documents, which are the held-out probes that report the
result), and ships the lowest summed dL (ties: the allocation, the first candidate). With each
challenger the record keeps its paired per-document difference to the allocation and that
difference's standard error (each kept capability's token-weighted difference over the same
documents, errors added in quadrature across capabilities), and whether the documents resolve it at
``RESOLVED_SE`` (2) standard errors, so a reader sees when the choice was a coin toss.

A noise margin was built and measured (round 12: the allocation kept unless a challenger is lower by
more than 2 standard errors; ``MARGIN_SE`` holds it, 0 = off) and is off: on SmolLM2 GPTQ 4 bits keep
math it kept the allocation where the lowest dL had shipped uniform, and the held-out probes could not
tell the two apart either (math +0.0148 vs +0.0157); on Gemma 3 270M SparseGPT 0.5 keep math it shipped
the allocation where uniform was lower by 0.011 (1.1 SE) on the calibration documents and by 0.031 on
the probes (kept math dL +26.6% vs uniform instead of -9.0%). Taking the lower measurement costs
nothing in expectation where the candidates are within noise and wins where they are not; more
calibration documents (the SE falls as 1/sqrt(n)) are the way to resolve close candidates.

Cost: one more compression pass and one forward over the kept capabilities' calibration documents
per candidate. Memory: none of the model's size beside it; the original target weights (put back before
each candidate) and the chosen candidate's (put back at the end, when it was not the last compressed) are
written to disk and read back one matrix at a time (:mod:`.spill`: the same weights bit for bit; held in
memory they were two copies of the target weights, 52 GiB on Llama-3.1-8B in float32).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from capsense.compress.budget import Budget
from capsense.compress.engine import CompressionResult, compress_model
from capsense.compress.spill import Spill, spill_weights
from capsense.compress.targets import find_targets, restore
from capsense.errors import BudgetError

MARGIN_SE = 0.0  # a challenger displaces the allocation when lower by more than this many standard errors (0: lower at all)
RESOLVED_SE = 2.0  # a paired difference beyond this many standard errors is recorded as resolved


@dataclass
class Selection:
    """The candidate left in the model: its name, budget and compression result, and the measurements."""

    chosen: str
    budget: Budget
    result: CompressionResult
    record: dict[str, Any]


def compress_better(
    model: nn.Module, tokenizer, candidates: Sequence[tuple[str, Budget]], stats, keep: Sequence[str], n_docs: int,
    log: Callable[[str], None] | None = None, compress: Callable[[Budget], CompressionResult] | None = None,
    include_path: Sequence[str] = (),
) -> Selection:
    """Compress ``model`` with each of ``candidates`` (name, budget) from its current weights (``compress``: how a
    budget compresses the model in place; default :func:`compress_model` with ``stats``), measure ``keep``'s loss
    (tasks of capsense, of the ``include_path`` folders or of lm-eval) on their last ``n_docs`` documents (calibration
    documents, not the probes) and leave the chosen one in the model: the first candidate (the allocation) unless
    another's summed dL is lower by more than ``MARGIN_SE`` standard errors (:func:`paired_vs_allocation`; 0: lower at
    all); of those, the lowest summed dL.

    The record: ``{"documents": "last", "n_docs", "capabilities", "dL": {name: {cap: dL}}, "allocation",
    "margin_se", "paired": {challenger: ...}, "chosen", "reason"}``.
    """
    from capsense.compress.capability_loss import capability_probe, measure
    from capsense.scoring.probe import model_max_length

    if len(candidates) < 1 or len({n for n, _ in candidates}) != len(candidates):
        raise BudgetError(f"candidates need distinct names, at least one; got {[n for n, _ in candidates]}")
    if n_docs < 1:
        raise BudgetError(f"`n_docs` (calibration documents measured per kept capability) must be >= 1, got {n_docs}")
    log = log or (lambda _m: None)
    sets = {cap: capability_probe(cap, tokenizer, n_docs, "calibration", include_path, model_max_length(model))
            for cap in keep}
    before = measure(model, sets)
    targets = find_targets(model, candidates[0][1].targets)
    with Spill("original") as original, Spill("chosen") as chosen_weights:
        if len(candidates) > 1:
            spill_weights(targets, original)
        dls, paired, chosen = _compress_each(model, targets, candidates, sets, before, f"{n_docs} calibration documents",
                                             log, (original, chosen_weights),
                                             compress or (lambda budget: compress_model(model, budget, stats)))
    record = {"documents": "last", "n_docs": n_docs, "capabilities": list(keep), "dL": dls,
              "allocation": candidates[0][0], "margin_se": MARGIN_SE, "paired": paired, "chosen": chosen[1],
              "reason": _reason(candidates[0][0], chosen[1], paired)}
    return Selection(chosen[1], chosen[2], chosen[3], record)


def _compress_each(model, targets, candidates, sets, before, docs: str, log, spills, compress):
    """:func:`compress_better`'s loop: each candidate compressed from the original weights (put back from
    ``spills[0]`` before each but the first) and measured on ``sets``; the chosen one's weights kept in
    ``spills[1]`` while later ones are compressed, and put back at the end. (dL by candidate, paired
    differences, (summed dL, name, budget, result) of the chosen one)."""
    from capsense.compress.capability_loss import measure

    keep, (original, chosen_weights) = list(sets), spills
    dls: dict[str, dict[str, float]] = {}
    paired: dict[str, dict[str, Any]] = {}
    first: dict = {}
    chosen: tuple[float, str, Budget, CompressionResult] | None = None
    for i, (name, budget) in enumerate(candidates):
        if i:
            restore(targets, original)
        result = compress(budget)
        after = measure(model, sets)
        dls[name] = {cap: after[cap].nll - before[cap].nll for cap in keep}
        score = sum(dls[name].values())
        msg = f"{name}: dL on {docs} of {', '.join(keep)}: {score:+.4f}"
        if i == 0:
            first, take = after, True
        else:
            p = paired[name] = paired_vs_allocation(first, after)
            take = p["clears"] and (chosen[1] == candidates[0][0] or score < chosen[0])  # type: ignore[index]
            se = "n/a" if p["se"] is None else f"{p['se']:.4f}"
            msg += f" ({p['dL_diff']:+.4f} vs {candidates[0][0]}, SE {se}{', clears' if p['clears'] else ''})"
        log(msg)
        if take:
            chosen = (score, name, budget, result)
            if i < len(candidates) - 1:
                spill_weights(targets, chosen_weights)
    assert chosen is not None
    if chosen[1] != candidates[-1][0]:  # the chosen one was not the last one compressed
        restore(targets, chosen_weights)
    return dls, paired, chosen


def paired_vs_allocation(allocation: Mapping[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
    """``other``'s summed dL minus the allocation's, from each kept capability's per-document paired
    difference (:func:`~capsense.compress.capability_loss.paired_difference`), with its standard error
    (capabilities' documents are distinct, so their errors add in quadrature; None with one document),
    whether it ``clears`` the margin (lower by more than ``MARGIN_SE`` standard errors; with a margin of
    0, lower at all, standard error or not) and whether it is ``resolved`` (beyond ``RESOLVED_SE``)."""
    from capsense.compress.capability_loss import paired_difference

    by_cap = {cap: dict(zip(("dL_diff", "se"), paired_difference(a, other[cap]))) for cap, a in allocation.items()}
    diff = sum(d["dL_diff"] for d in by_cap.values())
    ses = [d["se"] for d in by_cap.values()]
    se = None if None in ses else math.sqrt(sum(x * x for x in ses))
    margin = 0.0 if MARGIN_SE == 0 else None if se is None else MARGIN_SE * se
    return {"dL_diff": diff, "se": se, "margin": margin, "clears": margin is not None and diff < -margin,
            "resolved": se is not None and abs(diff) > RESOLVED_SE * se, "by_capability": by_cap}


def _reason(allocation: str, chosen: str, paired: Mapping[str, Mapping[str, Any]]) -> str:
    """Why ``chosen`` was shipped, in words, for the record and the card."""
    if not paired:
        return f"{allocation} is the only candidate"
    rule = f"{MARGIN_SE:g} standard errors of the paired per-document difference" if MARGIN_SE else "at all"
    within = [n for n, p in paired.items() if not p["resolved"]]
    noise = (f"; within {RESOLVED_SE:g} standard errors of {allocation}: {', '.join(within)} (not resolved by "
             f"these documents)" if within else f"; every difference beyond {RESOLVED_SE:g} standard errors")
    if chosen == allocation:
        if MARGIN_SE and any(p["se"] is None for p in paired.values()):
            return f"one document per capability gives no standard error: {allocation} kept"
        return f"no other candidate's summed dL is lower than {allocation}'s by more than {rule}: {allocation} kept{noise}"
    p = paired[chosen]
    return f"{chosen}'s summed dL is the lowest, {-p['dL_diff']:.4f} below {allocation}'s{noise}"


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
                      packed: bool = False, texts=None):
    """(name, :class:`~capsense.compress.guided.Allocation`) to measure: ``guided`` (``guide`` as given)
    and, where :func:`proxy_pricing` names one, ``guided-PRICING`` (the same Fisher, levels priced by the
    proxy: on SmolLM2 SparseGPT keep code the proxy's allocation was the better, -31% vs -18%, and on
    Gemma keep math the worse, round 10). One Fisher for both: ``cache`` (:func:`guided_budget`'s
    ``fisher_cache``; a new one when None). ``texts``: the run's Fisher texts
    (:func:`~capsense.compress.guided.fisher_texts`; None: tokenized here)."""
    from dataclasses import replace

    from capsense.compress.guided import guided_budget

    cache = {} if cache is None else cache
    out = [("guided", guided_budget(model, tokenizer, uniform, stats, guide, log, cache, packed, texts))]
    proxy = proxy_pricing(uniform, guide)
    if proxy is not None:
        out.append((f"guided-{proxy}", guided_budget(model, tokenizer, uniform, stats, replace(guide, pricing=proxy),
                                                     log, cache, packed, texts)))
    return out


def compress_guided(model: nn.Module, tokenizer, uniform: Budget, allocations, stats, guide,
                    log: Callable[[str], None] | None = None,
                    compress: Callable[[Budget], CompressionResult] | None = None) -> tuple[CompressionResult, Budget, Any]:
    """Compress ``model`` as a guided run ships it: (the result, the budget left in the model, the
    allocation whose ``info`` describes it, or None).

    ``allocations``: (name, :class:`~capsense.compress.guided.Allocation`) candidates, the first the
    guide's own (:func:`guided_candidates`); empty (no guide) compresses with ``uniform``. When
    :func:`checks_uniform`, the one of the candidates and ``uniform`` that :func:`compress_better`
    ships (the lowest dL on the kept capabilities' calibration documents, ``guide.check_docs`` each, by
    default the ``guide.samples`` the Fisher read; ties keep the first allocation), recorded in
    the returned allocation's ``info["selection"]`` (the chosen allocation's, or the first's when
    uniform is chosen); else the first allocation as it is. ``compress``: how a budget compresses the
    model (default :func:`compress_model` with ``stats``; one layer at a time: :mod:`.guided_sequential`).
    """
    log = log or (lambda _m: None)
    compress = compress or (lambda budget: compress_model(model, budget, stats))
    if not allocations:
        return compress(uniform), uniform, None
    if not checks_uniform(guide):
        first = allocations[0][1]
        return compress(first.budget), first.budget, first
    log(f"compressing with {', '.join(n for n, _ in allocations)} and uniform; the lowest dL on calibration "
        "documents ships")
    sel = compress_better(model, tokenizer, [(n, a.budget) for n, a in allocations] + [("uniform", uniform)], stats,
                          guide.keep, guide.check_docs or guide.samples, log, compress, guide.include_path)
    allocation = dict(allocations).get(sel.chosen, allocations[0][1])
    allocation.info["selection"] = sel.record
    return sel.result, sel.budget, allocation

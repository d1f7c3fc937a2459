"""Capability-guided compression one decoder layer at a time (``--keep`` with ``--sequential``).

A guided GPTQ or SparseGPT run (:mod:`.guided`) prices every matrix's levels from that matrix's
calibration Gram matrix (:mod:`.compensated`: the solved output error of each level), allocates over
all matrices at once and compresses each candidate budget (the allocation, the other pricing's, the
uniform setting) with those statistics (:mod:`.select`). In one pass that holds every matrix's Gram at
once: ~61 GiB of float64 for Llama-3.1-8B, ~610 GiB for 70B. But the allocation needs only the
*prices* of all matrices at once, not their statistics, and a matrix's prices depend on its own
weights, Gram, protection and the Fisher only. So here:

1. The Fisher diagonals and protected heads are computed first, on the whole model, exactly as in one
   pass (:func:`~capsense.compress.guided.plan_guided`, one plan per pricing); each capability's diagonal
   is moved to disk once summed (:mod:`.spill`) and read back one matrix at a time when priced.
2. One sequential pass (:mod:`.sequential`, propagate "original"): per decoder layer, its targets'
   statistics are accumulated on the uncompressed layers' outputs, each plan prices that layer's
   matrices (:func:`~capsense.compress.guided.price_matrices`; the solved errors shared by the plans),
   and the statistics are freed. Only the prices are kept: (level, bits, cost) per level and matrix.
3. Each plan allocates from all prices (:func:`~capsense.compress.guided.allocation_from_prices`: the
   same allocator and candidates as one pass).
4. Each candidate budget is compressed by a sequential pass of its own
   (:func:`~capsense.compress.sequential.compress_sequential`, from the original weights, with the run's
   propagation) and the same choice rule ships one (:func:`~capsense.compress.select.compress_guided`).

The prices are always computed on the original outputs (step 2): they exist before any allocation, and
which layers' outputs a candidate passes on depends on that candidate. The propagation
(``sequential_propagate``) applies to step 4 only: "original" (the default) compresses each candidate
on the original outputs, "compressed" on its own compressed layers' outputs (GPTQ's error-propagating
order, :mod:`.sequential`), so each candidate's weights are those of ``compress_sequential(budget,
propagate="compressed")`` alone, and the choice rule compares the candidates so compressed (the uniform
one included).

With the original outputs propagated, a layer's statistics are the one-pass statistics bit for bit
(:mod:`.sequential`), so every price, the allocations, the chosen candidate and the weights equal the
one-pass guided run's (tests/unit/compress/test_compress_guided_sequential.py; SmolLM2-135M, GPTQ 4 bits
group 64 keep math, 16 texts: all 692 checkpoint tensors equal, peak RSS 3.11 -> 2.35 GiB, wall 6:21 ->
8:03, recipes/results/RESULTS-compress.md round 16). The cost is time: a
calibration pass for the prices and one per candidate (3 for GPTQ/SparseGPT at the default pricing),
where one pass calibrates once; storing every candidate's compressed weights to calibrate once would
hold a copy of the target weights per candidate instead (the model's size, each). Memory beside the
model (:func:`check_guided_memory`): while the Fisher is summed, 4 bytes per target weight (one
capability's sums; no longer the gradients beside them) and a backward pass's activations; while pricing, one layer's Grams, the cached
hidden states, the prices, one matrix's Fisher and one layer's solved errors or low-rank factors;
while compressing the candidates, one layer's Grams, the hidden states and one layer's weights on their
way to or from disk (the original and the chosen candidate's target weights live there; round 16 held
both in memory, and the summed Fisher through pricing). The same check counts a one-pass guided run
(``sequential=False``), which holds every matrix's Grams through all three phases.

Not here: a ``measured`` sensitivity (it measures each layer's levels in the uniformly compressed model,
which needs every layer's statistics first): :func:`~capsense.compress.sequential.check_sequential`
refuses it before the model loads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import torch
from torch import nn

from capsense.compress.allocate import Candidate
from capsense.compress.budget import Budget
from capsense.compress.calibration import accumulate_stats, gram_memory
from capsense.compress.compensated import level_pricer
from capsense.compress.engine import check_solve_on, needs_calibration, plan
from capsense.compress.gptq import output_errors_memory
from capsense.compress.guided import (
    Allocation, GuidedPlan, allocation_from_prices, fisher_sources, fisher_tokens, guided_levels, guided_setting, plan_guided,
    price_matrices,
)
from capsense.compress.methods import parse_setting
from capsense.compress.select import checks_uniform, proxy_pricing
from capsense.compress.sensitivity import FISHER_MAX_TOKENS, backward_memory
from capsense.compress.sequential import cached_bytes, capture_inputs, decoder_layers, run_layer, sums_fit_device
from capsense.compress.spill import check_disk, layer_files, layer_groups
from capsense.compress.targets import find_targets
from capsense.core.placement import check_cpu_memory
from capsense.errors import CapsenseError

#: Bytes one kept price takes in memory (a Candidate, its slot in its matrix's list, the list and name by
#: matrix; its Setting is the plan's level, shared): 166 bytes each measured with tracemalloc over 400
#: matrices x 30 GPTQ levels; rounded up.
PRICE_BYTES = 200


def _pricings(uniform: Budget, guide) -> list[tuple[str, object]]:
    """(name, guide) of each allocation to price: ``guided`` and, where the method has one, ``guided-PROXY``
    (:func:`~capsense.compress.select.guided_candidates`)."""
    proxy = proxy_pricing(uniform, guide)
    return [("guided", guide)] + ([(f"guided-{proxy}", replace(guide, pricing=proxy))] if proxy is not None else [])


def _output_priced(pricings: list[tuple[str, object]], base) -> bool:
    """Whether one of ``pricings`` prices by the method's own output error (every level of a matrix solved)."""
    return any(level_pricer(base.method, g.pricing)[0] == "output" for _, g in pricings)


def check_guided_memory(model: nn.Module, uniform: Budget, samples: Sequence[Sequence[int]], guide,
                        packed: bool = False, available: int | None = None, sequential: bool = True,
                        texts: Mapping[str, Sequence[Sequence[int]]] | None = None) -> dict[str, int]:
    """Refuse, before the Fisher and the calibration passes, a guided run (``sequential``: one decoder layer at a
    time; else in one pass) whose phases (:func:`guided_memory`) hold more than ``available`` beside the model
    (default: :func:`~capsense.core.placement.available_cpu_memory`); the bytes of each phase (``sensitivity`` 0
    when the run sums no Fisher: :func:`~capsense.compress.guided.fisher_sources`). Round 17 counted a one-pass
    guided run for its Gram matrices alone (inside calibration), so a run whose Grams fit but whose Grams plus the
    Fisher sums did not ran out of memory after calibration, an hour into an 8B run. The refusal
    (:func:`~capsense.core.placement.check_cpu_memory`) names the phase, each part and what to do. With the
    run's Fisher ``texts`` (:func:`~capsense.compress.guided.fisher_texts`, the ones its passes then read) a Fisher
    pass is counted at the longest of them (:func:`~capsense.compress.guided.fisher_tokens`), without at the most
    they are cut to."""
    tokens = fisher_tokens(texts) if texts is not None else FISHER_MAX_TOKENS
    phases = guided_memory(model, uniform, samples, guide, packed, sequential, tokens)
    planned, base = plan(model, uniform), parse_setting(uniform.default)
    _, gram = needs_calibration(planned)
    if base.solves_on_layer and _output_priced(_pricings(uniform, guide), base):
        check_solve_on(planned, len(guided_levels(base, guide, find_targets(model, uniform.targets), packed)), 4)
    mode = ("one decoder layer at a time" if sequential else
            "in one pass (every matrix's calibration statistics held from calibration to the end)")
    return {phase: check_cpu_memory(held, f"a guided run {mode}, {_DOING[phase]},", _advice(phase, sequential, gram),
                                    available) if held else 0 for phase, held in phases.items()}


#: What a guided run does in each phase :func:`guided_memory` counts, for the refusal.
_DOING = {"sensitivity": "while the Fisher diagonal is summed (guided sensitivity)",
          "pricing": "while every matrix's levels are priced", "compressing": "while the candidates are compressed"}


def _advice(phase: str, sequential: bool, gram: bool) -> str:
    """What to do instead of a guided run refused in ``phase``: what lowers that phase's largest parts."""
    fixes = [] if sequential else ["run one decoder layer at a time (`sequential`: one layer's Gram matrices held, "
                                   "the Fisher summed before any)"]
    if phase == "sensitivity":
        fixes.append("sum the Fisher over more groups of layers in turn (`fisher_groups`; it lowers the sums, not the "
                     "backward pass's activations)")
        fixes.append("load the model in bfloat16 (`dtype`: half the weights, their gradients and most activations)")
    fixes.append("compress fewer matrices (`targets` attn or mlp)")
    if gram and not (sequential and phase == "sensitivity"):
        fixes.append("use a method without Gram matrices (rtn, wanda, magnitude, svd, asvd)")
    return ", ".join(fixes[:-1]) + f" or {fixes[-1]}" if len(fixes) > 1 else fixes[0]


def guided_memory(model: nn.Module, uniform: Budget, samples: Sequence[Sequence[int]], guide, packed: bool = False,
                  sequential: bool = True, fisher_length: int = FISHER_MAX_TOKENS) -> dict[str, dict[str, int]]:
    """The bytes each phase of a guided run holds at once beside the model, by what they are (no check).

    ``sensitivity`` (empty when the run sums no Fisher): one capability's Fisher sums (4 bytes per target weight of
    the largest of ``guide.fisher_groups`` runs of layers, then moved to disk, :mod:`.spill`), one layer's
    gradients and one backward pass's activations (:func:`~capsense.compress.sensitivity.backward_memory`: what
    autograd saves over a Fisher text of ``fisher_length`` tokens, the log-softmax over the vocabulary and its gradients; the run of layers
    that saves the most; counted beside the gradients, at most the logit gradients more than both at once: 2.9
    GiB at Llama-3.1-8B's shapes in float32, round 18 counted none); in one pass also every matrix's Gram matrices (calibrated first and held to the end;
    :func:`~capsense.compress.calibration.gram_memory`), where a sequential run sums the Fisher before any.
    ``pricing``: the Grams (one layer's, sequential; all), the cached hidden states (sequential), the kept prices
    (both pricings' sequential, where all are allocated at the end; one pricing's at a time in one pass), one
    matrix's Fisher read back (and summed over the kept capabilities), and what the prices are computed from, kept
    for the other pricing (:func:`~capsense.compress.guided.price_matrices`' cache: the output pricing's solved row
    errors, 8 bytes per row and level; low rank: the SVD factors), one layer's sequential, every matrix's in one
    pass; with the output pricing, one matrix's solve (every level of the largest matrix stacked, solved at once:
    :func:`~capsense.compress.gptq.output_errors_memory`, 0.25 GiB on SmolLM2's MLP matrices, where round 19 counted
    none and the solve held twice what it holds now). ``compressing`` the candidates: the Grams, the hidden states
    (sequential) and one layer's target weights written to disk or read back
    (:func:`~capsense.compress.select.compress_better`; held in memory they were two copies of all target weights).
    Resident memory is this once every step hands back what it freed (:func:`~capsense.core.memory.return_freed_memory`:
    round 19 measured 1.0 GiB more than counted on SmolLM2, most of it freed heap not returned). Not counted: one
    matrix's compression (GPTQ's float64 copies of one weight and its Gram; 0.03-0.07 GiB on SmolLM2), smaller than
    the parts above on every model measured; the no-grad forwards' activations (one layer's
    while calibrating, one decoder layer's at the largest text x batch while the candidates are measured: below
    the Fisher pass's, which saves every layer's); the Python runtime and libraries, already resident (and so
    outside the available memory) when the check runs."""
    planned = plan(model, uniform)
    _, gram = needs_calibration(planned)
    base = parse_setting(uniform.default)
    targets = find_targets(model, uniform.targets)
    calibrated = [t for t, s in planned if s and s.calibrated]
    grams = {f"Gram matrices ({k})": v for k, v in gram_memory(model, calibrated, samples[0], per_layer=sequential).items()
             } if gram and calibrated and samples else {}
    hidden = {"cached hidden states": cached_bytes(model, samples)} if sequential else {}
    layer_bytes = _most(targets, True, lambda ts: sum(t.n_params * t.module.weight.element_size() for t in ts))
    parts = layer_groups(targets, guide.fisher_groups)
    backward = max((backward_memory(model, fisher_length, {t.layer for t in part}) for part in parts),
                   key=lambda b: sum(b.values()))
    fisher = {"Fisher sums": 4 * max(sum(t.n_params for t in part) for part in parts),
              "one layer's gradients": layer_bytes} | backward
    pricings = _pricings(uniform, guide)
    levels = len(guided_levels(base, guide, targets, packed))
    scope = "one layer's" if sequential else "every matrix's"
    pricing = hidden | {"one matrix's Fisher, read back and summed": 2 * 4 * max(t.n_params for t in targets),
                        "kept prices": PRICE_BYTES * len(targets) * levels * (len(pricings) if sequential else 1)}
    if _output_priced(pricings, base):
        pricing[f"{scope} solved output errors"] = _most(targets, sequential, lambda ts: 8 * levels * sum(
            t.shape[0] for t in ts))
        if not base.solves_on_layer:  # solve_on: layer solves in the layer's device memory, not the CPU's
            pricing["one matrix's solve"] = max(output_errors_memory(levels, *t.shape) for t in targets)
    if base.family == "lowrank":
        pricing[f"{scope} low-rank factors"] = _most(targets, sequential, _factor_bytes)
    compressing = hidden | {"one layer's weights written or read back": layer_bytes if checks_uniform(guide) else 0}
    sensitivity = ({} if sequential else grams) | fisher if fisher_sources(guide, base) else {}
    return {"sensitivity": sensitivity, "pricing": grams | pricing, "compressing": grams | compressing}


def _most(targets, per_layer: bool, size: Callable[[list], int]) -> int:
    """``size`` of all ``targets`` or, ``per_layer``, of the decoder layer's targets it is largest for."""
    if not per_layer:
        return size(list(targets))
    return max(size([t for t in targets if t.layer == i]) for i in {t.layer for t in targets})


def check_guided_disk(model: nn.Module, uniform: Budget, guide, folder: str | None = None) -> int:
    """Refuse, before any pass, a guided run (one pass or sequential) whose spill (:mod:`.spill`) the temporary
    folder's disk cannot hold at its peak; the bytes counted returned. The spill has two phases, never on disk
    together (measured, round 19: the Fishers' folders are removed when the plans that read them are dropped,
    before the candidates are compressed):

    * planning: the Fishers the run sums (:func:`~capsense.compress.guided.fisher_sources`), all kept until
      both pricings are done: a float32 file per decoder layer each (4 bytes per target weight);
    * choosing, when the candidates are measured against the uniform setting
      (:func:`~capsense.compress.select.compress_better`): the original target weights and the chosen candidate's
      (in the model's dtype, a file per layer each), and, when a third candidate can replace the chosen one before
      the last (the proxy pricing's allocation, :func:`~capsense.compress.select.proxy_pricing`), one layer's file
      more while its replacement is written (the old file is replaced once the new one is complete).

    The count is the larger of the two (round 18 added them), each file as :func:`~capsense.compress.spill.file_bytes`
    writes it (safetensors header included) rounded up to the folder's disk block, and a block for each spill's
    folder: the peak measured on tiny Llama and Gemma 3 runs, one pass and sequential, exactly when the chosen
    weights are replaced, a layer's file above it when they are not (``test_compress_spill.py``). Nothing else is
    written there (the checkpoint goes beside ``--out``). ``--fisher-groups`` does not change it (the same files,
    written a group of layers at a time)."""
    import os
    import tempfile

    folder = folder or tempfile.gettempdir()
    block = os.statvfs(folder).f_frsize
    targets = find_targets(model, uniform.targets)
    fisher = block + sum(layer_files(targets, torch.float32, block))  # a Fisher's folder and its files
    fishers = len(fisher_sources(guide, guided_setting(uniform))) * fisher
    copies = 0
    if checks_uniform(guide):
        weights = layer_files(targets, block=block)
        copies = 2 * (block + sum(weights)) + (max(weights) if proxy_pricing(uniform, guide) else 0)
    what = (f"the guided run's spill (its Fisher diagonals: {fishers / 2**30:.2f} GiB; the weight copies while the "
            f"candidates are compressed: {copies / 2**30:.2f} GiB)")
    return check_disk(max(fishers, copies), what, folder, "; or spill less: fewer `--keep` capabilities or "
                      "`--targets` (each kept capability's Fisher is a file per layer), `--no-check-uniform` (no weight "
                      "copies); `--fisher-groups` does not change the disk")


def _factor_bytes(targets) -> int:
    """float32 bytes of the full SVD factors of ``targets`` (what a low-rank level's price caches)."""
    return sum(4 * (t.shape[0] + t.shape[1] + 1) * min(t.shape) for t in targets)


def guided_candidates_sequential(model: nn.Module, tokenizer, uniform: Budget, samples: Sequence[Sequence[int]], guide,
                                 log: Callable[[str], None] | None = None, packed: bool = False,
                                 texts: Mapping[str, Sequence[Sequence[int]]] | None = None) -> list[tuple[str, Allocation]]:
    """What :func:`~capsense.compress.select.guided_candidates` returns, priced one decoder layer at a time
    on ``samples`` (module doc): (name, :class:`~capsense.compress.guided.Allocation`), ``guided`` first.
    ``texts``: the run's Fisher texts (:func:`~capsense.compress.guided.fisher_texts`; None: tokenized here)."""
    log = log or (lambda _m: None)
    if not samples:
        raise CapsenseError("no calibration samples: give a task, a file or text with `calibration`")
    cache: dict = {}
    plans = [(name, plan_guided(model, tokenizer, uniform, g, log, cache, packed, texts))
             for name, g in _pricings(uniform, guide)]
    cache.clear()  # the plans hold what they price with (the Fishers on disk, summed when read)
    prices = price_layer_by_layer(model, uniform, samples, [p for _, p in plans], log)
    return [(name, allocation_from_prices(p, pr)) for (name, p), pr in zip(plans, prices)]


@torch.no_grad()
def price_layer_by_layer(model: nn.Module, uniform: Budget, samples: Sequence[Sequence[int]],
                         plans: Sequence[GuidedPlan], log: Callable[[str], None]) -> list[dict[str, list[Candidate]]]:
    """Each plan's prices of every matrix, from one decoder layer's statistics at a time on the original
    layers' outputs (the statistics :func:`~capsense.compress.engine.calibrate` gives ``uniform``'s
    calibrated targets in one pass); what the prices are computed from is shared by the plans, per layer."""
    planned = plan(model, uniform)
    _, gram = needs_calibration(planned)
    calibrated = [t for t, s in planned if s and s.calibrated]
    layers = decoder_layers(model)
    cached = capture_inputs(model, layers, samples)
    prices: list[dict[str, list[Candidate]]] = [{} for _ in plans]
    for i, layer in enumerate(layers):
        outputs: list[torch.Tensor] = []
        forwards = (lambda j=j: outputs.append(run_layer(layer, cached, i, j)) for j in range(len(samples)))
        mine = [t for t in calibrated if t.layer == i]
        stats = accumulate_stats(mine, forwards, gram, on_device=sums_fit_device(mine, gram))
        shared: dict = {}  # this layer's solved errors or factors, read by every plan
        for p, out in zip(plans, prices):
            out.update(price_matrices(p, [t for t in p.targets if t.layer == i], stats, shared))
        del stats, shared
        cached.hidden = outputs
        log(f"layer {i + 1}/{len(layers)} priced")
    return prices

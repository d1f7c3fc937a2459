"""Layer-by-layer calibration: calibrate and compress one decoder layer at a time.

A one-pass calibration (:func:`~capsense.compress.engine.calibrate`) holds the statistics of every
target matrix of the model at once; with a Gram matrix per distinct matrix input (GPTQ, SparseGPT,
SVD-LLM) that is 61 GiB of float64 for Llama-3.1-8B and ~610 GiB for Llama-3.1-70B. Here, as in the
original GPTQ's layer loop and llm-compressor's sequential pipeline, the inputs of the first decoder
layer are captured once for all calibration samples (:func:`capture_inputs`), and then for each layer:
its targets' input statistics are accumulated by running that layer alone on the cached inputs (the
same hooks as the one-pass path, :func:`~capsense.compress.calibration.accumulate_stats`), its targets
are compressed (:func:`~capsense.compress.engine.compress_targets`, the per-matrix path of
:func:`~capsense.compress.engine.compress_model`), its statistics are freed, and its outputs become
the next layer's inputs. So the statistics held at once are one layer's, plus the cached hidden
states (samples x tokens x hidden, twice: a layer's inputs and outputs).

``propagate`` says which outputs go on: ``"original"`` (the default) passes on the uncompressed
layer's outputs, which gives exactly the one-pass result (same statistics, same weights) with one
layer's memory, so choosing ``sequential`` changes the memory and nothing else; ``"compressed"`` runs
the layer again after compressing it, so each layer is calibrated on the inputs the compressed model
really gives it (GPTQ's error-propagating order). Measured on SmolLM2-135M (GPTQ g128, 64 texts, 32
held-out probes, round 14): the compressed order lowered math and code dL at 3 bits (+0.356 -> +0.281,
+1.473 -> +1.221) but raised qa's at 3 and 4 bits (+3.469 -> +3.789, +0.453 -> +0.694) and ran each
layer twice (+14% wall at 4 bits), so it is not the default.

A guided run (``keep``) is layer by layer too (:mod:`.guided_sequential`: a pass that keeps only each
layer's level prices, on the original outputs since they are computed before any allocation exists, then
a pass per candidate budget with ``propagate``'s outputs), with a Fisher sensitivity (``measured`` prices
each layer in the uniformly compressed model, which needs every layer's statistics first). Not for
global-scope pruning (one threshold over all matrices) or a budget whose methods need no calibration.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import capsense.compress.accounting as acc
from capsense.compress.budget import Budget
from capsense.compress.calibration import accumulate_stats, check_gram_memory
from capsense.compress.engine import (
    CompressionResult, check_plan, compress_targets, compression_result, is_global, needs_calibration, plan,
)
from capsense.core.arch import arch_spec, unwrap
from capsense.core.placement import available_device_memory, input_device
from capsense.errors import CapsenseError

PROPAGATE = ("compressed", "original")
DEFAULT_PROPAGATE = "original"  # the one-pass result: `sequential` changes the memory only (module doc)


def check_sequential(budget: Budget, guide=None, propagate: str = DEFAULT_PROPAGATE) -> None:
    """Refuse, before the model loads, what layer-by-layer calibration cannot do (see the module doc):
    with ``guide``, a measured sensitivity."""
    if propagate not in PROPAGATE:
        raise CapsenseError(f"unknown sequential propagation {propagate!r}: valid are {', '.join(PROPAGATE)}")
    if guide is not None and guide.sensitivity == "measured":
        raise CapsenseError("sensitivity measured prices each layer's levels in the uniformly compressed model, which "
                            "needs every layer's statistics at once: with `sequential` use sensitivity kept, generic or "
                            "flat, or leave `sequential` out")
    settings = budget.settings()
    if not any(s.calibrated for s in settings):
        methods = ", ".join(sorted({s.method for s in settings})) or "no compression"
        raise CapsenseError(f"`sequential` applies to the calibrated methods (gptq, sparsegpt, svd-llm, "
                            f"wanda, asvd); {methods} needs no calibration: leave it out")
    if any(is_global(s) for s in settings):
        raise CapsenseError("`sequential` cannot prune with scope global (one threshold over every "
                            "layer's matrices): use scope row or matrix, or leave `sequential` out")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers (:func:`~capsense.core.arch.arch_spec`), or a clear error."""
    spec = arch_spec(model)
    try:
        layers = unwrap(model).get_submodule(spec.layers)
    except AttributeError:
        layers = None
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise CapsenseError(f"no decoder layers at {spec.layers!r} in this {type(unwrap(model)).__name__}: "
                            "layer-by-layer calibration needs them; calibrate in one pass (leave `sequential` out)")
    return layers


class _Stop(Exception):
    """Raised by the last stand-in layer: the rest of the forward (norm, LM head) is not needed."""


@dataclass
class LayerInputs:
    """Per calibration sample, the current layer's hidden states; per layer and sample, the other
    arguments the model passes that layer (masks, position embeddings: shared objects, not copies)."""

    hidden: list[torch.Tensor]
    args: list[list[tuple[tuple, dict[str, Any]]]]  # [layer][sample] -> (positional args after the hidden states, kwargs)


class _StandIn(nn.Module):
    """Takes decoder layer ``index``'s place during :func:`capture_inputs`: records its arguments and
    passes the hidden states through unchanged (so capturing costs no layer's compute)."""

    def __init__(self, layer: nn.Module, index: int, record: Callable[[int, tuple, dict], None], last: bool) -> None:
        super().__init__()
        self.layer, self.index, self.record, self.last = layer, index, record, last

    def __getattr__(self, name: str):  # what the model reads off a layer (e.g. attention_type)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["layer"], name)

    def forward(self, *args, **kwargs):
        self.record(self.index, args, kwargs)
        if self.last:
            raise _Stop
        return args[0] if args else kwargs["hidden_states"]


@torch.no_grad()
def capture_inputs(model: nn.Module, layers: nn.ModuleList, samples: Sequence[Sequence[int]]) -> LayerInputs:
    """The first layer's hidden states and every layer's other arguments, for each sample: one
    forward per sample with every layer replaced by a :class:`_StandIn` (restored afterwards)."""
    n = len(layers)
    got = LayerInputs([], [[] for _ in range(n)])

    def record(i: int, args: tuple, kwargs: dict) -> None:
        if i == 0:
            got.hidden.append(args[0] if args else kwargs["hidden_states"])
        got.args[i].append((tuple(args[1:]), {k: v for k, v in kwargs.items() if k != "hidden_states"}))

    originals = list(layers)
    for i, layer in enumerate(originals):
        layers[i] = _StandIn(layer, i, record, last=i == n - 1)
    try:
        for ids in samples:
            try:
                model(input_ids=torch.tensor([list(ids)], device=input_device(model)), use_cache=False)
            except _Stop:
                pass
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer
    if len(got.hidden) != len(samples) or any(len(a) != len(samples) for a in got.args):
        raise CapsenseError("the model's forward did not call every decoder layer once per sample: "
                            "calibrate in one pass (leave `sequential` out)")
    return got


def cached_bytes(model: nn.Module, samples: Sequence[Sequence[int]]) -> int:
    """Bytes of the hidden states a sequential calibration caches: every sample's tokens x hidden size in
    the model's dtype, twice (a layer's inputs and its outputs are held together); on Llama-3.1-8B, 64
    samples of 512 tokens in bfloat16 take 0.5 GiB. The other cached arguments (rotary tables, masks) are
    smaller and not counted."""
    emb = model.get_input_embeddings()
    return 2 * sum(len(s) for s in samples) * emb.embedding_dim * emb.weight.element_size()


def run_layer(layer: nn.Module, cached: LayerInputs, i: int, j: int) -> torch.Tensor:
    """Layer ``i`` on sample ``j``'s cached inputs: its output hidden states."""
    args, kwargs = cached.args[i][j]
    out = layer(cached.hidden[j], *args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def compress_sequential(
    model: nn.Module,
    budget: Budget,
    samples: Sequence[Sequence[int]],
    propagate: str = DEFAULT_PROPAGATE,
    base_bits: int = acc.BASE_BITS,
    log: Callable[[str], None] | None = None,
) -> CompressionResult:
    """Calibrate on ``samples`` (token id lists) and compress ``model`` in place under ``budget``, one
    decoder layer at a time (module doc); the result accounts as :func:`~capsense.compress.engine.compress_model`."""
    t0 = time.time()
    check_sequential(budget, None, propagate)
    if not samples:
        raise CapsenseError("no calibration samples: give a task, a file or text with `calibration`")
    planned = plan(model, budget)
    protected = check_plan(model, budget, planned)
    _, gram = needs_calibration(planned)
    layers = decoder_layers(model)
    if gram:
        check_gram_memory(model, [t for t, s in planned if s and s.calibrated], samples[0], sequential=True,
                          held={"cached hidden states": cached_bytes(model, samples)})
    cached = capture_inputs(model, layers, samples)
    accounts: dict[str, acc.MatrixAccount] = {}
    scales: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        mine = [(t, s) for t, s in planned if t.layer == i]
        outputs = _compress_layer(layer, i, mine, cached, protected, gram, propagate, base_bits, accounts, scales)
        cached.hidden = outputs
        if log:
            log(f"layer {i + 1}/{len(layers)} calibrated and compressed ({time.time() - t0:.0f} s)")
    result = compression_result(model, budget, planned, accounts, scales, t0, base_bits)
    result.sequential = {"propagate": propagate, "layers": len(layers)}
    return result


def sums_fit_device(targets, gram: bool, available: Callable[[Any], int | None] | None = None) -> bool:
    """Whether one decoder layer's statistics can be summed on its device (:func:`accumulate_stats`'
    ``on_device``): every target off the CPU, and on each device their float64 sums (a Gram matrix counted per
    target, so q/k/v's shared one thrice: an overcount) within half of what it has free (``available(device)``,
    default :func:`~capsense.core.placement.available_device_memory`; the other half for the layer's forwards).
    Else they are summed on the CPU as in one pass: the same values, one transfer per calibration text."""
    available = available or available_device_memory
    need: dict[Any, int] = {}
    for t in targets:
        device = t.module.weight.device
        if device.type == "cpu":
            return False
        need[device] = need.get(device, 0) + 8 * t.shape[1] * ((t.shape[1] if gram else 0) + 2)
    return bool(need) and all((have := available(d)) is not None and n <= have / 2 for d, n in need.items())


def _compress_layer(layer, i: int, mine, cached: LayerInputs, protected, gram: bool, propagate: str, base_bits: int,
                    accounts: dict, scales: dict) -> list[torch.Tensor]:
    """Layer ``i``'s statistics, compression (into ``accounts``, ``scales``) and the outputs passed on:
    those of the statistics pass (the original layer's) unless the compressed layer's are asked for and
    it changed, then those of a second pass (only one set of outputs is kept: memory)."""
    n = len(cached.hidden)
    rerun = propagate == "compressed" and any(s is not None for _, s in mine)
    outputs: list[torch.Tensor] = []

    def forward(j: int) -> None:
        out = run_layer(layer, cached, i, j)
        if not rerun:
            outputs.append(out)

    targets = [t for t, s in mine if s is not None and s.calibrated]
    if targets:
        stats = accumulate_stats(targets, (lambda j=j: forward(j) for j in range(n)), gram,
                                 on_device=sums_fit_device(targets, gram))
    else:
        stats = None
        if not rerun:
            for j in range(n):
                forward(j)
    a, sc = compress_targets(mine, stats, protected, base_bits)
    accounts.update(a)
    scales.update(sc)
    del stats
    return [run_layer(layer, cached, i, j) for j in range(n)] if rerun else outputs

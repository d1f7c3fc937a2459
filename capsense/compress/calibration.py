"""Calibration: texts to run through the model, and per-matrix input statistics.

For every target matrix a forward pre-hook accumulates, over all calibration tokens,
``sum x_j^2`` (Wanda's feature norm), ``sum |x_j|`` (ASVD's scaling) and, when asked,
the Gram matrix ``X^T X`` (SVD-LLM's whitening). Samples run one at a time, so there is
no padding to mask out.

Calibration sources: capability names or lm-eval task names (their *last* documents, so
they stay disjoint from probe sets, which take the first ones:
:func:`~capsense.compress.capabilities.document_ids`), a text/JSONL file, or
literal text. Several sources are comma-separated and share the sample count; a source named
k times takes k shares (distinct documents, not repeats), which is how :func:`kept_calibration`
weights a kept capability.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from capsense.errors import CapsenseError
from capsense.compress.capabilities import (
    CAPABILITIES, check_calibration_source, document_ids, looks_like_task, task_of,
)
from capsense.compress.targets import Target
from capsense.core.memory import return_freed_memory
from capsense.core.placement import check_cpu_memory, input_device

DEFAULT_CALIBRATION = "prose,math,code,qa"


@dataclass
class InputStats:
    """Running statistics of one matrix's inputs, summed on ``device`` (the CPU by default; see
    :meth:`to_cpu`)."""

    n_in: int
    n_tokens: int = 0
    sq_sum: torch.Tensor = field(default=None)  # type: ignore[assignment]
    abs_sum: torch.Tensor = field(default=None)  # type: ignore[assignment]
    gram: torch.Tensor | None = None
    device: Any = "cpu"

    def __post_init__(self) -> None:
        if self.sq_sum is None:
            self.sq_sum = torch.zeros(self.n_in, dtype=torch.float64, device=self.device)
        if self.abs_sum is None:
            self.abs_sum = torch.zeros(self.n_in, dtype=torch.float64, device=self.device)

    def add(self, x: torch.Tensor, gram: bool) -> None:
        x = x.detach().reshape(-1, self.n_in).float()  # on the layer's device (any, under a device map)
        self.n_tokens += x.shape[0]
        self.sq_sum += x.pow(2).sum(0).double().to(self.device)
        self.abs_sum += x.abs().sum(0).double().to(self.device)
        if gram:
            # one sample's product in float32 (fast), the running sum in float64 (exact enough), in place
            g = (x.T @ x).double().to(self.device)
            self.gram = g if self.gram is None else self.gram.add_(g)

    def to_cpu(self) -> InputStats:
        """The sums moved to the CPU, where compression reads them: once per matrix when they were summed on the
        layer's device (:func:`accumulate_stats`' ``on_device``), the same values (float64 sums of the same
        products in the same order, wherever they are added)."""
        self.sq_sum, self.abs_sum = self.sq_sum.cpu(), self.abs_sum.cpu()
        self.gram = None if self.gram is None else self.gram.cpu()
        self.device = "cpu"
        return self

    @property
    def input_norm(self) -> torch.Tensor:
        """Per-feature L2 norm over the calibration tokens (Wanda)."""
        return self.sq_sum.sqrt()

    @property
    def abs_mean(self) -> torch.Tensor:
        """Per-feature mean |x| (ASVD)."""
        return self.abs_sum / max(self.n_tokens, 1)

    @classmethod
    def from_inputs(cls, x: torch.Tensor, gram: bool = True) -> InputStats:
        """Statistics of a known input matrix ``[tokens, in]`` (tests, hand checks)."""
        stats = cls(x.shape[-1])
        stats.add(x, gram)
        return stats


#: Bytes per entry of a Gram matrix: its running sum is float64 (:meth:`InputStats.add`).
GRAM_BYTES = 8


class _DistinctInputs:
    """Forward pre-hooks on ``targets`` that hand each distinct input tensor of a forward to
    ``on_input(name, x)`` once: q/k/v (and gate/up) read the same tensor, so only the first target
    reading it (its owner) gets it and the others are recorded in :attr:`alias` (name -> owner).
    Holding each input until the forward ends keeps its memory from being reused by a later tensor
    of the same shape, so equal keys really are the same tensor."""

    def __init__(self, targets: Sequence[Target], on_input: Callable[[str, torch.Tensor], None]) -> None:
        self.seen: dict[tuple, tuple[str, torch.Tensor]] = {}
        self.alias: dict[str, str] = {}
        self.on_input = on_input
        self.handles = [t.module.register_forward_pre_hook(self._hook(t)) for t in targets]

    def _hook(self, t: Target):
        def hook(_module, args):
            x = args[0]
            key = (t.layer, x.data_ptr(), tuple(x.shape), tuple(x.stride()))
            owner = self.seen.setdefault(key, (t.name, x))[0]
            if owner != t.name:
                self.alias[t.name] = owner
            else:
                self.on_input(t.name, x)

        return hook

    def run(self, model: nn.Module, ids: Sequence[int]) -> None:
        self.during(lambda: model(input_ids=torch.tensor([list(ids)], device=input_device(model)), use_cache=False))

    def during(self, forward: Callable[[], Any]) -> Any:
        """Run ``forward`` (one forward pass: a model's, or one decoder layer's) as one unit of sharing."""
        self.seen.clear()
        try:
            return forward()
        finally:
            self.seen.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def gram_memory(model: nn.Module, targets: Sequence[Target], ids: Sequence[int],
                per_layer: bool = False) -> dict[str, int]:
    """Bytes the calibration Gram matrices of ``targets`` take, per kind (attn, mlp): one float64
    ``in x in`` sum per distinct matrix input, the sharing found by one forward of ``ids``. With
    ``per_layer``, those of the decoder layer that needs the most (what a sequential calibration,
    :mod:`.sequential`, holds at once)."""
    kind = {t.name: (t.layer, t.kind) for t in targets}
    out: dict[tuple[int, str], int] = {}

    def on_input(name: str, x: torch.Tensor) -> None:
        out[kind[name]] = out.get(kind[name], 0) + GRAM_BYTES * x.shape[-1] ** 2

    inputs = _DistinctInputs(targets, on_input)
    try:
        inputs.run(model, ids)
    finally:
        inputs.remove()
    if per_layer and out:
        layers = {layer for layer, _ in out}
        top = max(layers, key=lambda i: sum(v for (layer, _), v in out.items() if layer == i))
        out = {k: v for k, v in out.items() if k[0] == top}
    need: dict[str, int] = {}
    for (_, k), v in out.items():
        need[k] = need.get(k, 0) + v
    return need


def check_gram_memory(model: nn.Module, targets: Sequence[Target], ids: Sequence[int],
                      available: int | None = None, sequential: bool = False,
                      held: dict[str, int] | None = None) -> int:
    """The Gram matrices' bytes (:func:`gram_memory`; ``sequential``: one decoder layer's, the most
    any layer needs) plus the bytes ``held`` beside them (by what they are: a sequential
    calibration's cached hidden states), refused before calibration starts when they exceed
    ``available`` (default: :func:`~capsense.core.placement.available_cpu_memory`): on
    Llama-3.1-70B one pass would hold ~655 GB, and running out of memory an hour into
    calibration loses the hour. The refusal (:func:`~capsense.core.placement.check_cpu_memory`) names the
    parts and what to do: calibrate one layer at a time, fewer matrices, or a method without Gram matrices."""
    need = gram_memory(model, targets, ids, per_layer=sequential) | dict(held or {})
    scope = "of one decoder layer at a time" if sequential else "for the whole model"
    fix = "" if sequential else "calibrate one decoder layer at a time (`sequential`), "
    return check_cpu_memory(
        need, f"calibrating {len(targets)} matrices for gptq, sparsegpt or svd-llm (one float64 Gram matrix per "
        f"distinct matrix input, {scope})", f"{fix}compress fewer matrices (`targets` attn or mlp) or use a method "
        "without Gram matrices (rtn, wanda, magnitude, svd, asvd)", available)


@torch.no_grad()
def collect_stats(
    model: nn.Module,
    targets: Sequence[Target],
    samples: Sequence[Sequence[int]],
    gram: bool = False,
    progress: Callable[[int], None] | None = None,
) -> dict[str, InputStats]:
    """Run ``samples`` (token id lists) through ``model``; statistics of each target's input. With
    ``gram`` the Gram matrices' memory is checked first (:func:`check_gram_memory`)."""
    if not samples:
        raise CapsenseError("no calibration samples: give a task, a file or text with `calibration`")
    if gram:
        check_gram_memory(model, targets, samples[0])
    forwards = (lambda ids=ids: model(input_ids=torch.tensor([list(ids)], device=input_device(model)), use_cache=False)
                for ids in samples)
    return accumulate_stats(targets, forwards, gram, progress)


def accumulate_stats(targets: Sequence[Target], forwards: Iterable[Callable[[], Any]], gram: bool,
                     progress: Callable[[int], None] | None = None, on_device: bool = False) -> dict[str, InputStats]:
    """Statistics of each target's input over ``forwards`` (each call one forward pass through the
    targets: the whole model's in :func:`collect_stats`, one decoder layer's in :mod:`.sequential`);
    targets reading one tensor share one :class:`InputStats` (:class:`_DistinctInputs`). ``on_device``: each
    target's sums stay on its weight's device until the last forward and then move to the CPU once, instead of
    once per forward: the same values, one transfer of each Gram matrix instead of one per calibration text (on a
    GPU, Llama-3.1-70B's down projection moves 6.6 GB per text otherwise). The caller checks they fit there
    (:func:`~capsense.compress.sequential.sums_fit_device`)."""
    stats = {t.name: InputStats(t.shape[1], device=t.module.weight.device if on_device else "cpu") for t in targets}
    inputs = _DistinctInputs(targets, lambda name, x: stats[name].add(x, gram))
    try:
        for forward in forwards:
            inputs.during(forward)
            return_freed_memory()  # the forward's activations: freed, handed back (capsense.core.memory)
            if progress:
                progress(1)
    finally:
        inputs.remove()
    if on_device:
        for s in stats.values():
            s.to_cpu()
    for name, owner in inputs.alias.items():
        stats[name] = stats[owner]
    return stats


def _doc_text(task_obj, doc: dict[str, Any]) -> str:
    """A document's whole text: a perplexity task's is its target (what lm-eval's rolling requests score);
    otherwise prompt, delimiter and reference answer (a multiple-choice task's gold choice)."""
    from capsense.scoring.requests import ROLLING

    if task_obj.OUTPUT_TYPE == ROLLING:
        return str(task_obj.doc_to_target(doc))
    if "context" in doc and "continuation" in doc:
        return doc["context"] + doc["continuation"]
    text = task_obj.doc_to_text(doc)
    target = task_obj.doc_to_target(doc)
    if isinstance(target, int) and task_obj.OUTPUT_TYPE == "multiple_choice":
        target = task_obj.doc_to_choice(doc)[target]
    target = target[0] if isinstance(target, list) else target  # (a generation task's first reference answer)
    return f"{text}{task_obj.config.target_delimiter}{target}"


def _source_texts(source: str, n: int, tokenizer, include_path: Sequence[str] = ()) -> tuple[list[str], dict[str, Any]]:
    """Up to ``n`` texts from one source, and a record of where they came from (``include_path``: folders of
    task YAMLs a task source may come from)."""
    path = Path(source)
    if path.is_file():
        texts = []
        for line in path.read_text().splitlines():
            line = line.strip()
            if not line:
                continue
            if line.startswith("{"):
                try:
                    rec = json.loads(line)
                    line = rec.get("text") or rec.get("context", "") + rec.get("continuation", "")
                except json.JSONDecodeError:
                    pass
            texts.append(line)
        return texts[:n], {"source": str(path), "kind": "file", "n": min(n, len(texts))}
    from capsense.scoring.requests import load_task

    if not looks_like_task(source):
        return [source], {"source": source[:80], "kind": "text"}
    check_calibration_source(source, include_path)
    task = CAPABILITIES.get(source, source)
    task_obj = load_task(task, include_path, tokenizer)
    docs = task_obj.eval_docs
    ids = document_ids(len(docs), n, "calibration")[::-1]  # the last first
    return [_doc_text(task_obj, docs[i]) for i in ids], {"source": task, "kind": "task", "doc_ids": ids}


def kept_calibration(keep: Sequence[str], spec: str = DEFAULT_CALIBRATION, include_path: Sequence[str] = ()) -> str:
    """The calibration of an error-compensating solver (GPTQ, SparseGPT) guided to ``keep``:
    ``spec`` plus each kept capability once more, so a kept capability takes two shares of the
    samples (its last documents; probes take the first, so they stay held out).

    Why: GPTQ and SparseGPT minimise the output error on the calibration inputs, so with the
    default mix the solver ignores which capability is kept; only the allocation knew. Measured on
    SmolLM2-135M, equal size on disk, kept capability's dL vs the uniform setting calibrated on the
    default mix (recipes/results/RESULTS-compress.md, "Kept-capability calibration"): GPTQ 4 bits
    keep math -25.6% (default calibration: -24.8%), keep code -27.0% (was -9.3%); GPTQ 3 bits keep
    math -41.7% (was -2.9%), keep code -13.4% (was +1.3%); SparseGPT 0.5 keep code -31.1% (was
    -20.8%). Most of it is the calibration itself (the uniform setting so calibrated: -9% to -37%).
    Not measured with RTN, Wanda or low-rank, which keep the default calibration.
    """
    from capsense.compress.capabilities import parse_capabilities

    return ",".join([spec, *parse_capabilities(list(keep), include_path)])


def source_shares(spec: str, n_samples: int) -> dict[str, int]:
    """How many of ``n_samples`` texts each source of ``spec`` gives (:func:`calibration_samples`' split): the
    comma-separated sources share them evenly, a source named k times takes k shares."""
    named = [s.strip() for s in spec.split(",") if s.strip()] if not Path(spec).is_file() else [spec]
    if not named:
        raise CapsenseError("empty `calibration`: give a task, a file or text")
    shares = [n_samples // len(named) + (i < n_samples % len(named)) for i in range(len(named))]
    per: dict[str, int] = {}
    for source, n in zip(named, shares):
        per[source] = per.get(source, 0) + n
    return per


def calibration_documents(capabilities: Sequence[str], spec: str, n_samples: int) -> dict[str, int]:
    """How many of each capability's last documents ``spec``'s ``n_samples`` texts read (0: none), for
    :func:`~capsense.compress.capabilities.check_held_out`."""
    shares = source_shares(spec, n_samples)
    return {cap: sum(n for s, n in shares.items() if task_of(s) == task_of(cap)) for cap in capabilities}


def calibration_samples(
    spec: str, tokenizer, n_samples: int = 64, max_tokens: int = 512, include_path: Sequence[str] = ()
) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Token id lists for ``spec`` (comma-separated sources share ``n_samples``; a source named k
    times takes k shares, its distinct documents) and their provenance; a task source may come from the
    ``include_path`` folders."""
    if n_samples < 1:
        raise CapsenseError(f"`calibration_samples` must be at least 1, got {n_samples}")
    per = source_shares(spec, n_samples)
    samples: list[list[int]] = []
    info = []
    for source, n in per.items():
        if n == 0:
            continue
        texts, rec = _source_texts(source, n, tokenizer, include_path)
        ids = [tokenizer.encode(t)[:max_tokens] for t in texts]
        ids = [i for i in ids if len(i) > 1]
        if not ids:
            raise CapsenseError(f"calibration source {source!r} gave no text")
        rec["n_tokens"] = sum(len(i) for i in ids)
        samples.extend(ids)
        info.append(rec)
    return samples, info

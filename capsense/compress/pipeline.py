"""The compression pipeline: load a model, calibrate, (guide,) compress and write a checkpoint.

:func:`compress_checkpoint` is what ``capsense compress`` runs: it loads ``model_name``,
calibrates if the method needs it, lets a :class:`~capsense.compress.guided.Guide` choose the
allocation when given, compresses with :func:`capsense.compress.engine.compress_model` and saves
the result atomically with ``capsense.json`` describing what was done (and ``budget.yaml`` for a
guided allocation) in a form stock transformers loads.

Formats (``fmt``): ``compressed-tensors`` packs quantized matrices as integer codes with their
16-bit group scales (:mod:`.packed`; the rest of the model at ``save_dtype``, bfloat16 unless
given), so the checkpoint has the size the accounting states; ``dense`` stores every weight as
a float (pruned weights as zeros, quantized ones dequantized, low-rank products multiplied out).
``auto`` (the default) is compressed-tensors for the quantizing methods (rtn, gptq) and dense
for pruning and low rank, which compressed-tensors cannot store (no sparse or factored format).
What the chosen format cannot store, and a calibrated method without calibration data, are
refused before the slow part and before anything is written.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from capsense.compress.budget import Budget, parse_setting, setting_label, write_budget_file
from capsense.compress.calibration import DEFAULT_CALIBRATION, calibration_samples
from capsense.compress.card import render_card
from capsense.compress.engine import CompressionResult, calibrate, check_plan, compress_model, needs_calibration, plan
from capsense.errors import CapsenseError
from capsense.compress.packed import FORMATS, PackedWeight, check_storable, size_on_disk, write_packed
from capsense.compress.select import compress_guided
from capsense.compress.sequential import DEFAULT_PROPAGATE, check_sequential, compress_sequential
from capsense.compress.targets import check_moe_config
from capsense.core.progress import without_library_bars


def resolve_format(fmt: str, budget: Budget) -> str:
    """``compressed-tensors`` or ``dense``: ``auto`` packs when the default method quantizes."""
    if fmt == "auto":
        s = parse_setting(budget.default)
        return "compressed-tensors" if s is not None and s.family == "quant" else "dense"
    if fmt not in FORMATS:
        raise CapsenseError(f"unknown `fmt` {fmt!r}: valid formats are auto, {', '.join(FORMATS)}")
    return fmt


def calibrated_methods(budget: Budget) -> list[str]:
    """The methods ``budget`` names that read calibration inputs (wanda, gptq, sparsegpt, asvd, svd-llm)."""
    return list(dict.fromkeys(s.method for s in budget.settings() if s.calibrated))


def check_calibration_given(budget: Budget, calibration: str, n_samples: int) -> None:
    """A calibrated method (wanda, gptq, sparsegpt, asvd, svd-llm) needs calibration data."""
    calibrated = calibrated_methods(budget)
    if calibrated and (not calibration.strip() or n_samples < 1):
        raise CapsenseError(f"{calibrated[0]} needs calibration data: give `calibration` (capabilities, tasks, a "
                               f"file or text) and `calibration_samples` >= 1 (got {calibration!r}, {n_samples})")


def _check_format(model, budget: Budget, planned, protected, fmt: str) -> None:
    if fmt == "compressed-tensors":
        check_storable((t.name, t.shape, s, protected.get(t.name) is not None and protected[t.name].n_protected(t.shape) > 0,
                        not t.transposed) for t, s in planned)


def compress_checkpoint(
    model_name: str,
    budget: Budget,
    out: str | Path,
    calibration: str = DEFAULT_CALIBRATION,
    calibration_samples_n: int = 64,
    dtype: str = "float32",
    save_dtype: str | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None, progress: bool = False,
    guide=None,
    device_map: str | dict[str, Any] | None = None, device: str = "cpu",
    fmt: str = "auto", probes: int = 32,
    sequential: bool = False, sequential_propagate: str = DEFAULT_PROPAGATE,
    include_path: Sequence[str] = (),
    revision: str | None = None,
) -> CompressionResult:
    """Load ``model_name`` (at ``revision``, of a Hub model), compress it under ``budget`` and write a checkpoint to
    ``out`` atomically.

    With ``guide`` (a :class:`capsense.compress.guided.Guide`), ``budget``'s default setting names the size and the
    method; the guided allocation replaces it and is also written as ``budget.yaml``, unless another candidate
    measured better on the kept capabilities' calibration documents (``guide.check_uniform``,
    :func:`capsense.compress.select.compress_guided`: the allocation priced by the method's proxy, and the uniform
    setting); ``capsense.json`` records every measurement (``allocation.selection``).
    ``device_map`` (:mod:`capsense.core.placement`) spreads the model over devices: calibration
    and gradients run where the layers live, each matrix is compressed on CPU and written back to its device, so
    the checkpoint equals the one compressed without a map (GPTQ and SparseGPT with ``solve_on: layer`` solve on
    the layer's device: faster on GPUs, not bit-equal); a map that offloads weights to CPU memory or disk is refused
    before anything is computed or written. Without a map the model loads on ``device`` (one accelerator: as a map
    that places every layer there).
    With ``guide`` and ``probes`` > 0, each kept capability is measured on its first ``probes``
    documents (never calibration or allocation documents) before and after compressing, in
    memory at ``dtype``; the dL goes into ``capsense.json`` (``measured``) and the card.
    ``sequential``: calibrate and compress one decoder layer at a time (:mod:`.sequential`), each layer on the
    outputs of the original layers (``sequential_propagate`` "original", the default: the one-pass result) or the
    compressed ones; guided (:mod:`.guided_sequential`), each candidate so, its levels priced on the original ones.
    ``include_path``: task YAML folders ``calibration`` may name tasks of (``guide`` carries its own, for ``keep``).
    ``progress``: bars over the one-pass calibration and compression (the sequential path logs each layer)."""
    from capsense.core.models import load_model
    from capsense.core.placement import check_weights_in_memory

    log = log or (lambda _m: None)
    fmt = _check_before_load(model_name, budget, out, overwrite, fmt, calibration, calibration_samples_n, guide, probes,
                             sequential_propagate if sequential else None, revision)
    model, tokenizer = load_model(model_name, dtype=dtype, device=device, device_map=device_map, revision=revision)
    check_weights_in_memory(model, "compression edits every weight in place and saves the whole model")
    planned = plan(model, budget)  # validates every setting before any work
    _check_format(model, budget, planned, check_plan(model, budget, planned), fmt)
    result, budget, allocation, measured = _compress_sequential(
        model, tokenizer, budget, calibration, calibration_samples_n, sequential_propagate, guide, probes, dtype, log, fmt,
        include_path) if sequential else _compress_one_pass(
        model, tokenizer, budget, planned, calibration, calibration_samples_n, guide, probes, dtype, log, fmt,
        include_path, progress)
    if fmt == "dense" and save_dtype and save_dtype != "auto":
        model = model.to(getattr(torch, save_dtype))
    store = torch.bfloat16 if not save_dtype or save_dtype == "auto" else getattr(torch, save_dtype)
    _write_checkpoint(model, tokenizer, model_name, budget, result, allocation, out, overwrite, fmt, store, measured,
                      revision)
    return result


def _check_before_load(model_name: str, budget: Budget, out, overwrite: bool, fmt: str, calibration: str, n_samples: int,
                       guide, probes: int, sequential_propagate: str | None, revision: str | None = None) -> str:
    """What :func:`compress_checkpoint` refuses before the model loads (``sequential_propagate`` None: one pass);
    the format ``fmt`` resolves to."""
    from capsense.core.files import check_output_dir

    check_output_dir(out, overwrite, (model_name, calibration))  # fail before the slow part
    fmt = resolve_format(fmt, budget)
    check_calibration_given(budget, calibration, n_samples)
    check_moe_config(model_name, budget.targets, revision)  # MLP targets on a mixture-of-experts model
    if sequential_propagate is not None:
        check_sequential(budget, guide, sequential_propagate)
    if guide is not None and probes > 0:
        _check_kept_held_out(guide, probes, calibration, n_samples)
    return fmt


def _check_kept_held_out(guide, probes: int, calibration: str, n_samples: int) -> None:
    """Each kept capability's probes (its first ``probes`` documents) apart from every last document the run reads
    of it: the Fisher's and measured sensitivity's ``guide.samples``, the uniform check's ``guide.check_docs``, its
    share of ``calibration`` (counted whether or not the run's options read them: a bound, not a count)."""
    from capsense.compress.calibration import calibration_documents
    from capsense.compress.capabilities import check_held_out

    calibrated = calibration_documents(guide.keep, calibration, n_samples)
    check_held_out({cap: (probes, max(guide.samples, guide.check_docs or 0, calibrated[cap])) for cap in guide.keep},
                   "lower `calibration_samples` (the kept capabilities' calibration texts) or `check_docs`", guide.include_path)


def _compress_one_pass(model, tokenizer, budget: Budget, planned, calibration: str, n_samples: int, guide, probes: int,
                       dtype: str, log: Callable[[str], None], fmt: str, include_path: Sequence[str] = (),
                       progress: bool = False):
    """Calibrate every target at once, (guide,) compress: (result, budget shipped, allocation, measured dL).
    ``planned``: ``budget``'s plan, made once by the caller; ``include_path``: task YAML folders ``calibration`` names;
    ``progress``: a bar over the calibration texts and one over the matrices of each compression, on stderr (a 70B
    model's pass took hours between two log lines)."""
    from tqdm.auto import tqdm

    needed, _ = needs_calibration(planned)
    # built once: the guided memory check counts the Gram matrices from them, then calibration runs on them
    samples = calibration_samples(calibration, tokenizer, n_samples, include_path=include_path) if needed else ([], [])
    texts = None
    if guide is not None:  # before the calibration and the Fisher passes: what the run holds, what it spills
        from capsense.compress.guided import fisher_texts
        from capsense.compress.guided_sequential import check_guided_disk, check_guided_memory

        texts = fisher_texts(tokenizer, guide, parse_setting(budget.default))  # once: counted here, read by the passes
        check_guided_memory(model, budget, samples[0], guide, fmt == "compressed-tensors", sequential=False, texts=texts)
        check_guided_disk(model, budget, guide)
    stats, calib_info = {}, []
    if needed:
        log(f"calibrating on {calibration} ({n_samples} samples)")
        with tqdm(total=len(samples[0]), desc="calibrate", unit="text", disable=not progress) as bar:
            stats, calib_info = calibrate(model, tokenizer, budget, samples=samples, progress=bar.update)
    allocations = _guided_allocations(model, tokenizer, budget, stats, guide, log, fmt, texts) if guide is not None else []
    kept = _KeptLoss(model, tokenizer, guide, probes, dtype, log) if guide is not None and probes > 0 else None
    log(f"compressing: {setting_label(budget.default)}")
    result, budget, allocation = compress_guided(model, tokenizer, budget, allocations, stats, guide, log,
                                                 compress=_compressing(model, stats, progress))
    result.calibration = calib_info
    return result, budget, allocation, kept.after(model) if kept is not None else None


def _compressing(model, stats, progress: bool) -> Callable[[Budget], CompressionResult]:
    """How the one-pass path compresses a budget (:func:`~capsense.compress.select.compress_guided`'s ``compress``):
    :func:`~capsense.compress.engine.compress_model`, with a bar over its matrices where ``progress``."""
    from tqdm.auto import tqdm

    def compress(b: Budget) -> CompressionResult:
        with tqdm(total=len(plan(model, b)), desc="compress", unit="matrix", disable=not progress) as bar:
            return compress_model(model, b, stats, progress=bar.update)
    return compress


def _compress_sequential(model, tokenizer, budget: Budget, calibration: str, n_samples: int, propagate: str, guide,
                         probes: int, dtype: str, log: Callable[[str], None], fmt: str, include_path: Sequence[str] = ()):
    """Calibrate and compress one decoder layer at a time (:mod:`.sequential`; guided:
    :mod:`.guided_sequential`): (result, budget shipped, allocation, measured dL), as :func:`_compress_one_pass`."""
    samples, calib_info = calibration_samples(calibration, tokenizer, n_samples, include_path=include_path)
    log(f"calibrating and compressing one layer at a time on {calibration} ({n_samples} samples): "
        f"{setting_label(budget.default)}")
    if guide is None:
        result = compress_sequential(model, budget, samples, propagate, log=log)
        result.calibration = calib_info
        return result, budget, None, None
    from capsense.compress.guided import fisher_texts
    from capsense.compress.guided_sequential import check_guided_disk, check_guided_memory, guided_candidates_sequential

    packed = fmt == "compressed-tensors"
    texts = fisher_texts(tokenizer, guide, parse_setting(budget.default))  # once: counted here, read by the passes
    check_guided_memory(model, budget, samples, guide, packed, texts=texts)  # before the Fisher and calibration
    check_guided_disk(model, budget, guide)
    allocations = guided_candidates_sequential(model, tokenizer, budget, samples, guide, log, packed, texts)
    _check_allocations(model, allocations, fmt)
    kept = _KeptLoss(model, tokenizer, guide, probes, dtype, log) if probes > 0 else None
    result, budget, allocation = compress_guided(model, tokenizer, budget, allocations, None, guide, log,
                                                 compress=lambda b: compress_sequential(model, b, samples, propagate, log=log))
    result.calibration = calib_info
    return result, budget, allocation, kept.after(model) if kept is not None else None


def _guided_allocations(model, tokenizer, budget: Budget, stats, guide, log: Callable[[str], None], fmt: str, texts):
    """The guided allocations that may replace ``budget`` (its setting names the size and the method;
    :func:`capsense.compress.select.guided_candidates`, on the run's Fisher ``texts``), each checked against the
    output format like the budget it replaces."""
    from capsense.compress.select import guided_candidates  # the Fisher and measured sensitivities: only when guided

    allocations = guided_candidates(model, tokenizer, budget, stats, guide, log, packed=fmt == "compressed-tensors",
                                    texts=texts)
    _check_allocations(model, allocations, fmt)
    return allocations


def _check_allocations(model, allocations, fmt: str) -> None:
    """Each allocation checked against the output format like the budget it replaces."""
    for _, allocation in allocations:
        planned = plan(model, allocation.budget)
        _check_format(model, allocation.budget, planned, check_plan(model, allocation.budget, planned), fmt)


class _KeptLoss:
    """The kept capabilities' loss on their probes, measured before compressing; :meth:`after` gives the dL."""

    def __init__(self, model, tokenizer, guide, probes: int, dtype: str, log) -> None:
        from capsense.compress.capability_loss import build_probes, measure
        from capsense.scoring.probe import model_max_length

        self.probes, self.dtype = probes, dtype
        self.sets = build_probes(tokenizer, guide.keep, probes, guide.include_path, model_max_length(model))
        log(f"measuring {', '.join(guide.keep)} on {probes} probe documents each, before and after compressing")
        self.before = measure(model, self.sets)

    def after(self, model) -> dict[str, Any]:
        from capsense.compress.capability_loss import loss_change, measure

        return {"probes": self.probes, "dtype": self.dtype, "documents": "first", "in_memory": True,
                "capabilities": loss_change(measure(model, self.sets), self.before)}


def public_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` with every file it names reduced to the file's name: what is shared carries no
    path of this machine (the budget file, a heads file it protects, a calibration file)."""
    from capsense.ship.metadata import public_path

    budget = meta.get("budget") or {}
    if budget.get("budget_file"):
        budget["budget_file"] = public_path(budget["budget_file"])
    heads = (budget.get("protect") or {}).get("heads")
    if isinstance(heads, str) and ("/" in heads or "\\" in heads or heads.endswith(".json")):
        budget["protect"]["heads"] = public_path(heads)
    for c in meta.get("calibration") or []:
        if c.get("kind") == "file":
            c["source"] = public_path(c["source"])
    return meta


def _packed(result: CompressionResult) -> dict[str, PackedWeight]:
    return {a.name: PackedWeight(a.setting["bits"], a.setting["group_size"], result.scales[a.name])
            for a in result.accounts if a.name in result.scales}


def _write_checkpoint(model, tokenizer, model_name: str, budget: Budget, result: CompressionResult, allocation,
                      out: str | Path, overwrite: bool, fmt: str = "dense", store: torch.dtype = torch.bfloat16,
                      measured: dict[str, Any] | None = None, revision: str | None = None) -> None:
    """The checkpoint, ``capsense.json`` and (guided) ``budget.yaml``, written atomically."""
    from capsense.core.files import atomic_output_dir
    from capsense.core.models import model_fingerprint
    from capsense.core.provenance import provenance
    from capsense.ship.metadata import public_name

    base = model_fingerprint(model_name, revision)
    base.pop("path", None)  # a path of this machine: what is shared carries none (as the exports)
    base["model"] = public_name(model_name)
    meta = {
        "capsense_compress": 1,
        "base_model": base,
        "method": budget.default.get("method"),
        "setting": budget.default,
        "label": result.summary["label"],
        **result.to_dict(per_matrix=True),
        **({"allocation": allocation.info} if allocation is not None else {}),
        **({"measured": measured} if measured is not None else {}),
        "format": {"format": "dense"},
        "made_with": provenance(next(model.parameters()).device),  # GPTQ's numbers move with the CPU (round 23)
        "note": "weights are stored dense: pruned weights are zeros, RTN weights are dequantized, low-rank "
        "matrices are the reconstructed products; accounting counts what a sparse/quantized/factored store needs",
    }
    public_meta(meta)
    if fmt == "compressed-tensors":
        meta["note"] = ("quantized matrices are stored packed (compressed-tensors pack-quantized: integer codes and "
                        "16-bit group scales), the rest at the checkpoint dtype; load with compressed-tensors installed")
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        if fmt == "compressed-tensors":
            meta["format"] = write_packed(model, _packed(result), tmp, dtype=store)
        else:
            with without_library_bars():
                model.save_pretrained(tmp, safe_serialization=True)
        s = result.summary
        meta["size"] = {"bytes_on_disk": size_on_disk(tmp),
                        "bytes_accounted": round(s["size_ratio"] * s["model_params"] * s["base_bits"] / 8)}
        tokenizer.save_pretrained(tmp)
        default = parse_setting(budget.default)
        (tmp / "README.md").write_text(render_card(meta, default.family if default is not None else ""))
        (tmp / "capsense.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
        if allocation is not None:
            write_budget_file(tmp / "budget.yaml", budget)  # what was shipped: the allocation, or uniform if it measured better

"""A compression request as a caller states it, turned into the pipeline's inputs.

A request is one setting (``method``, ``density``, ``bits``, ...) applied to every target
matrix, or a budget file whose default setting the given values override; optionally
capabilities to keep (a guided allocation, :class:`~capsense.compress.guided.Guide`).
:func:`check_request` refuses bad input before torch loads (this module imports nothing heavy
at its top); :func:`compress_request` builds the budget and guide and runs
:func:`capsense.compress.pipeline.compress_checkpoint`. ``capsense compress`` is these two calls.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from capsense.errors import CapsenseError

#: The setting keys of a request (a budget file's default setting takes the same keys).
SETTING_PARAMETERS = ("method", "density", "scope", "bits", "group_size", "damp", "act_order", "solve_on", "ratio", "alpha")


def check_request(model: str, out: str | Path, overwrite: bool, device_map: str | dict[str, Any] | None,
                  method: str | None, budget_file: str | Path | None, calibration: str | None, solve_on: str | None = None,
                  include_path: Sequence[str] = (), revision: str | None = None, device: str = "cpu"):
    """Refuse bad input before any heavy import; return the checked device map.

    ``out`` must be writable (or ``overwrite``), every device the map names (without a map: ``device``) must exist,
    ``model`` must name a model, ``method`` or ``budget_file`` must be given, a
    misspelt task in ``calibration`` (capsense's, or ``include_path``'s) is an error, not literal calibration text, and ``solve_on`` ``layer``
    with every layer on the CPU (no map, ``device`` cpu), where it would change nothing, is an error.
    """
    from capsense.compress.capabilities import check_calibration_spec
    from capsense.core.files import check_output_dir
    from capsense.core.models import check_model
    from capsense.core.placement import check_placement

    check_output_dir(out, overwrite, (model, budget_file, calibration, *include_path))
    placed = check_placement(device, device_map)
    check_model(model, revision)
    if not budget_file and method is None:
        raise CapsenseError("give `method` (magnitude, wanda, sparsegpt, rtn, gptq, svd, asvd, svd-llm) or `budget_file` FILE")
    if calibration:
        check_calibration_spec(calibration, include_path)
    if solve_on == "layer" and placed is None and str(device).startswith("cpu"):
        raise CapsenseError("`solve_on` layer solves GPTQ/SparseGPT on each layer's device; on `device` cpu without a "
                            "device map every layer is on the CPU, where it changes nothing: give an accelerator "
                            "(`device` cuda, or a device map) or leave it out")
    return placed


def _check_options(setting: Mapping[str, Any], sequential: bool, sequential_propagate: str | None, keep: str | None,
                   **guide_options: Any) -> None:
    """Options that do not apply, one error each: ``guide_options`` (they shape a guided allocation) without ``keep``,
    ``sequential_propagate`` without ``sequential``; and a ``setting`` key no method takes."""
    stray = [name for name, value in guide_options.items() if value is not None]
    if stray and not keep:
        raise CapsenseError(f"{', '.join(f'`{n}`' for n in stray)} shape(s) a guided allocation: give `keep` "
                            "(the capabilities to keep) or leave them out")
    if sequential_propagate is not None and not sequential:
        raise CapsenseError("`sequential_propagate` says how `sequential` calibrates: give both or leave it out")
    if unknown := set(setting) - set(SETTING_PARAMETERS):
        raise CapsenseError(f"unknown setting {', '.join(sorted(unknown))}: valid are {', '.join(SETTING_PARAMETERS)}")


def _budget(setting: Mapping[str, Any], budget_file, targets: str | None, calibration: str | None,
            samples: int | None = None):
    """The request's budget: ``budget_file`` with ``setting`` over its default, or ``setting`` on every ``targets``
    matrix. A ``calibration`` (or its ``samples``: the caller passes them where nothing else reads them, no ``keep``)
    given where no method reads it is an error (:func:`~capsense.compress.methods.check_calibration_read`): only a
    calibrated method reads it (``sequential`` too, which is refused without one); a kept capability's gradients and
    checks read that capability's own documents."""
    from capsense.compress.budget import load_budget, uniform_budget
    from capsense.compress.methods import check_calibration_read

    budget = load_budget(budget_file, setting, targets) if budget_file else uniform_budget(
        {k: v for k, v in setting.items() if v is not None}, targets)
    check_calibration_read([k for k, v in (("calibration", calibration), ("calibration_samples", samples))
                            if v is not None], budget.settings())
    return budget


def _guide(keep: str, sensitivity: str, protect_top_k, protect_heads, budget_size, samples: int, pricing, check_uniform,
           fisher_groups=None, check_docs=None, include_path: Sequence[str] = ()):
    """The :class:`~capsense.compress.guided.Guide` of a request that keeps ``keep``; ``check_uniform`` None is on
    at the uniform setting's size, and asked for with ``budget_size`` (another size) an error, as is ``check_docs``
    (the check's documents) where no check runs."""
    from capsense.compress.guided import Guide

    if check_uniform and budget_size is not None:
        raise CapsenseError("`check_uniform` compares the allocation with the uniform setting of the same size; with "
                            "`budget_size` the sizes differ: leave one out")
    if check_docs is not None and (check_uniform is False or budget_size is not None):
        raise CapsenseError(f"`check_docs` ({check_docs}) is how many calibration documents per kept capability the "
                            "check against the uniform setting measures; with "
                            f"{'`check_uniform` off' if check_uniform is False else '`budget_size`'} no check runs: "
                            "leave one out")
    return Guide(keep.split(","), sensitivity=sensitivity, protect_top_k=protect_top_k, heads=protect_heads,
                 size_ratio=budget_size, samples=samples, pricing=pricing, check_uniform=check_uniform is not False,
                 fisher_groups=fisher_groups or 1, check_docs=check_docs, include_path=tuple(include_path))


def default_calibration(budget, guide) -> str:
    """The calibration when the caller gives none: the default sources, plus the kept capabilities
    when ``guide`` keeps some and the budget's method compensates errors on calibration inputs."""
    from capsense.compress.calibration import DEFAULT_CALIBRATION, kept_calibration
    from capsense.compress.methods import parse_setting

    base = parse_setting(budget.default)
    if guide is not None and base is not None and base.compensating:
        return kept_calibration(guide.keep, include_path=guide.include_path)
    return DEFAULT_CALIBRATION


def compress_request(
    model: str,
    out: str | Path,
    setting: Mapping[str, Any],
    *,
    targets: str | None = None,
    budget_file: str | Path | None = None,
    keep: str | None = None,
    sensitivity: str = "kept",
    protect_top_k: int | None = None,
    protect_heads: str | None = None,
    budget_size: float | None = None,
    pricing: str | None = None, probes: int | None = None,
    check_uniform: bool | None = None, fisher_groups: int | None = None, check_docs: int | None = None,
    calibration: str | None = None, calibration_samples: int | None = None,
    dtype: str = "float32", save_dtype: str | None = None, overwrite: bool = False,
    device_map: str | dict[str, Any] | None = None, device: str = "cpu",
    fmt: str = "auto", sequential: bool = False, sequential_propagate: str | None = None,
    include_path: Sequence[str] = (),
    log: Callable[[str], None] | None = None, progress: bool = False,
    revision: str | None = None,
):
    """Compress ``model`` as asked and write the checkpoint to ``out``; the
    :class:`~capsense.compress.engine.CompressionResult` (its ``budget`` names the targets).

    ``setting``: values of :data:`SETTING_PARAMETERS` (None: unset). With ``budget_file`` they override its default
    setting (a different ``method`` starts from that method's defaults); without, they are the one setting of every
    ``targets`` matrix. ``keep`` (comma-separated capabilities) asks for a guided allocation at the uniform setting's
    size (or ``budget_size``), priced by ``sensitivity``, with ``protect_top_k`` heads per kept capability (or
    ``protect_heads``) kept whole; ``pricing`` says how a guided GPTQ or SparseGPT allocation prices its levels,
    ``check_uniform`` (None: on) whether the uniform setting is shipped when it measures better on calibration documents
    (``check_docs`` per kept capability; None: ``calibration_samples``), ``fisher_groups`` over how many runs of layers
    the Fisher is summed in turn (None: 1) (:class:`~capsense.compress.guided.Guide`), ``probes`` the kept capabilities'
    first documents measured before and after (None: 32, 0: none); given without ``keep`` they are an error, not
    ignored. ``calibration`` None is the default sources, and for an error-compensating method (GPTQ, SparseGPT) guided
    by ``keep``, those plus the kept capabilities' last documents (:func:`~capsense.compress.calibration.
    kept_calibration`). ``sequential``: one decoder layer at a time (:mod:`capsense.compress.sequential`,
    ``sequential_propagate``); ``calibration_samples`` None: 64; ``include_path``: task YAML folders whose tasks
    ``keep`` and ``calibration`` may name; ``revision``: of a Hub model (None: its default branch), recorded in
    ``capsense.json``'s ``base_model``; ``device``: where the model loads without ``device_map``; ``progress``: bars
    (:func:`~capsense.compress.pipeline.compress_checkpoint`)."""
    from capsense.compress.pipeline import compress_checkpoint
    from capsense.compress.sequential import DEFAULT_PROPAGATE

    _check_options(setting, sequential, sequential_propagate, keep, protect_heads=protect_heads,
                   protect_top_k=protect_top_k, budget_size=budget_size, pricing=pricing, check_uniform=check_uniform,
                   fisher_groups=fisher_groups, check_docs=check_docs, probes=probes,
                   sensitivity=None if sensitivity == "kept" else sensitivity)
    budget = _budget(setting, budget_file, targets, calibration, None if keep else calibration_samples)
    samples = 64 if calibration_samples is None else calibration_samples  # (with keep, also the Fisher's texts)
    guide = _guide(keep, sensitivity, protect_top_k, protect_heads, budget_size, samples, pricing,
                   check_uniform, fisher_groups, check_docs, include_path) if keep else None
    return compress_checkpoint(
        model, budget, out, calibration=default_calibration(budget, guide) if calibration is None else calibration,
        calibration_samples_n=samples, dtype=dtype, save_dtype=save_dtype, overwrite=overwrite, log=log,
        progress=progress, guide=guide, device_map=device_map, device=device, fmt=fmt, sequential=sequential,
        probes=32 if probes is None else probes, sequential_propagate=sequential_propagate or DEFAULT_PROPAGATE,
        include_path=include_path, revision=revision)

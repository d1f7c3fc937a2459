"""The ``checkpoint`` export: the model with heads ablated in its weights, saved with ``save_pretrained``.

Zero ablation zeroes the heads' input columns of the output projection
(:func:`~capsense.core.ablation.zero_heads_in_weights`); mean ablation first folds the heads'
mean contribution into the projection's bias. ``AutoModelForCausalLM.from_pretrained(out)``
reproduces the ablated logits.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

from capsense.core.ablation import reference_means, zero_heads_in_weights
from capsense.core.arch import arch_spec, base_layer, head_layout, out_projections, projection_weight
from capsense.core.files import atomic_output_dir
from capsense.core.heads import HeadSet, HeadsLike
from capsense.core.models import load_model
from capsense.ship.base import ExportResult, noop
from capsense.errors import CapsenseError
from capsense.ship.metadata import build_metadata, list_files, write_card_and_metadata
from capsense.ship.preflight import ExportInputs, check_mean_foldable, preflight
from capsense.core.progress import without_library_bars


def head_indices(heads: list[int], head_dim: int) -> torch.Tensor:
    """The input positions of ``heads`` in an output projection whose heads are ``head_dim`` wide."""
    return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in sorted(heads)])


@torch.no_grad()
def head_columns(projection: nn.Module, idx: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``W[:, S]`` of an output projection in float64, ``[out, |S|]``, on the weight's device (GPT-2's Conv1D
    stores the same numbers as rows)."""
    w = projection_weight(projection)
    cols = w.index_select(0 if transposed else 1, idx.to(w.device)).double()
    return cols.T if transposed else cols


@torch.no_grad()
def fold_means_into_bias(model: nn.Module, heads: HeadsLike, means: dict[int, torch.Tensor]) -> list[str]:
    """Mean ablation in weight space, in place: ``b += W[:, S] @ mean[S]``, then ``W[:, S] = 0``.

    ``S`` are the ablated heads' input slices (rows of GPT-2's transposed Conv1D weight). Where an edited
    projection has no bias, ``config.attention_bias`` is turned on first (:func:`switch_attention_bias`);
    returns the names of the zero biases that added (none where every edited projection had a bias).
    """
    hs = HeadSet.parse(heads).check_fits(head_layout(model))
    added = check_mean_foldable(model, hs)
    if added:
        switch_attention_bias(model, added)
    spec = arch_spec(model)
    layout = head_layout(model)
    projections = out_projections(model)
    for layer, head_ids in hs.by_layer().items():
        proj = base_layer(projections[layer])
        idx = head_indices(head_ids, layout.head_dim)
        cols = head_columns(proj, idx, spec.transposed)
        shift = cols @ means[layer].to(device=cols.device, dtype=torch.float64)[idx]
        proj.bias.copy_((proj.bias.double() + shift).to(proj.bias.dtype))
    zero_heads_in_weights(model, hs)
    return added


def switch_attention_bias(model: nn.Module, names: list[str]) -> None:
    """Turn ``config.attention_bias`` on in place, adding a zero bias for each parameter it adds (``names``, from
    :func:`~capsense.ship.preflight.bias_switch`), in its weight's dtype and device."""
    for name in names:
        module = model.get_submodule(name.rpartition(".")[0])
        w = module.weight
        module.bias = nn.Parameter(torch.zeros(w.shape[0], dtype=w.dtype, device=w.device), requires_grad=False)
    model.config.attention_bias = True


def check_editable(model, heads: HeadSet) -> None:
    """Refuse a placement that holds an edited layer's weights off-device (offloaded to CPU or
    disk by a device map): an in-place edit would not reach the saved checkpoint."""
    from capsense.core.arch import out_projections

    projections = out_projections(model)
    off = [layer for layer in heads.layers() if any(p.device.type == "meta" for p in projections[layer].parameters())]
    if off:
        raise CapsenseError(
            f"layers {off} were offloaded by the device map, so their weights cannot be edited in place; "
            "export with a device map that keeps them on GPUs, or without `device_map` on a machine with enough memory"
        )


def _ablate_in_weights(lm: nn.Module, tokenizer, hs: HeadSet, ablation: str, mean_reference,
                       log: Callable[[str], None]) -> list[str]:
    """Zero ``hs`` in ``lm``'s weights, or fold their means over ``mean_reference``'s texts (None: neutral prose)
    into the bias; returns the zero biases turned on to carry the means (:func:`fold_means_into_bias`)."""
    added: list[str] = []
    if ablation == "mean":
        log("Computing head means on the reference texts ...")
        added = fold_means_into_bias(lm, hs, reference_means(lm, tokenizer, "mean", mean_reference))
        if added:
            log(f"The base model's attention has no biases: config.attention_bias turned on, {len(added)} zero biases added")
    else:
        zero_heads_in_weights(lm, hs)
    log(f"Ablated {len(hs)} heads in {len(hs.layers())} layers ({ablation}): {hs}")
    return added


def export_checkpoint(
    model: str,
    heads: HeadsLike,
    out: str | os.PathLike,
    *,
    top_k: int | None = None,
    ablation: str = "zero",
    mean_reference: str | os.PathLike | None = None,
    dtype: str = "auto",
    revision: str | None = None,
    overwrite: bool = False,
    max_shard_size: str | int = "5GB",
    repo_id: str | None = None,
    log: Callable[[str], None] = noop,
    device_map: str | None = None, device: str = "cpu",
    checked: ExportInputs | None = None,
) -> ExportResult:
    """Save ``model`` with ``heads`` ablated in its weights, as a plain transformers folder.

    Mean ablation needs a projection bias (see :data:`capsense.ship.preflight.MEAN_FOLD_SUPPORT`).
    The model is loaded once (on ``device``) and edited in place; ``device_map`` spreads a model larger than
    CPU memory over GPUs (the edited layers must not be offloaded, see :func:`check_editable`).
    ``checked``: this request's :func:`~capsense.ship.preflight.check_export_inputs` (None: checked here).
    """
    out_path, hs, heads_file, source, meta = preflight(
        model, heads, out, revision, checked, format="checkpoint", top_k=top_k, ablation=ablation,
        mean_reference=mean_reference, dtype=dtype, overwrite=overwrite)
    if ablation == "mean":
        check_mean_foldable(meta, hs)
    model_type = meta.config.model_type
    del meta

    log(f"Loading {model} ...")
    lm, tokenizer = load_model(model, dtype=dtype, revision=revision, device=device, device_map=device_map)
    check_editable(lm, hs)
    added = _ablate_in_weights(lm, tokenizer, hs, ablation, mean_reference, log)

    metadata = build_metadata(
        fmt="checkpoint", model=model, revision=revision, heads=hs, heads_file=heads_file,
        heads_source=source, top_k=top_k, ablation=ablation, dtype=dtype,
        mean_reference=str(mean_reference) if mean_reference else None, out=out_path, model_type=model_type,
    )
    metadata["torch_dtype"] = str(next(lm.parameters()).dtype).removeprefix("torch.")
    if added:
        metadata["attention_biases_added"] = len(added)
    log(f"Saving checkpoint to {out_path} ...")
    with atomic_output_dir(out_path, overwrite) as tmp:
        with without_library_bars():
            lm.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(tmp)
        write_card_and_metadata(tmp, metadata, repo_id)
        files = list_files(tmp)
    return ExportResult(out_path, "checkpoint", hs, files, metadata)

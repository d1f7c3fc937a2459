"""The ``adapter`` export: a PEFT IA3 mask adapter that zero-ablates heads, built without loading weights.

The model is built on the ``meta`` device from its config; the output projections of the
edited layers are wrapped in IA3 layers with ``feedforward_modules`` = ``target_modules`` (so
IA3 scales the projection's *input*), each vector 0 on the ablated heads' slices and 1
elsewhere, and the adapter is saved with PEFT's own ``save_pretrained``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

from capsense.core.arch import arch_spec, head_layout, out_projections
from capsense.core.files import atomic_output_dir
from capsense.core.heads import HeadSet, HeadsLike
from capsense.ship.base import ExportResult, noop
from capsense.ship.checkpoint import head_indices
from capsense.ship.metadata import base_model_hub_id, build_metadata, list_files, public_name, write_card_and_metadata
from capsense.ship.preflight import ExportInputs, preflight


def ia3_vectors(model: nn.Module, heads: HeadsLike) -> dict[int, torch.Tensor]:
    """``{layer: vector}`` over the projection input: 0 on ablated heads' slices, 1 elsewhere."""
    layout = head_layout(model)
    hs = HeadSet.parse(heads).check_fits(layout)
    width = layout.n_heads * layout.head_dim
    out = {}
    for layer, head_ids in sorted(hs.by_layer().items()):
        v = torch.ones(width, dtype=torch.float32)
        v[head_indices(head_ids, layout.head_dim)] = 0
        out[layer] = v
    return out


def projection_names(model: nn.Module, layers: list[int]) -> list[str]:
    """Fully qualified module names of the output projections of ``layers``."""
    projections = out_projections(model)
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(projections[l])] for l in layers]


def export_adapter(
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
    max_shard_size: str | int | None = None,
    repo_id: str | None = None,
    log: Callable[[str], None] = noop,
    checked: ExportInputs | None = None,
) -> ExportResult:
    """Save a PEFT IA3 adapter that zero-ablates ``heads`` of ``model`` (no weights loaded).

    Its vectors are stored in ``dtype`` (float32 for ``auto``); 0 and 1 are exact in all.
    ``max_shard_size`` is accepted for a uniform format signature and unused (an adapter is small).
    ``checked``: this request's :func:`~capsense.ship.preflight.check_export_inputs` (None: checked here;
    mean ablation is refused there, :data:`~capsense.ship.preflight.MEAN_ADAPTER_MSG`).
    """
    out_path, hs, heads_file, source, meta = preflight(
        model, heads, out, revision, checked, format="adapter", top_k=top_k, ablation=ablation,
        mean_reference=mean_reference, dtype=dtype, overwrite=overwrite)
    from peft import IA3Config, get_peft_model

    spec = arch_spec(meta)
    layers = hs.layers()
    names = projection_names(meta, layers)
    vectors = ia3_vectors(meta, hs)
    vector_dtype = torch.float32 if dtype == "auto" else getattr(torch, dtype)
    config = IA3Config(
        task_type="CAUSAL_LM", target_modules=names, feedforward_modules=names,
        fan_in_fan_out=spec.transposed, init_ia3_weights=True, inference_mode=True,
    )
    peft_model = get_peft_model(meta, config, revision=revision)
    # adapter_config.json is published too: the base by Hub id, never by a path of this machine
    hub_id = base_model_hub_id(model)
    peft_model.peft_config["default"].base_model_name_or_path = hub_id or public_name(model)
    base = peft_model.get_base_model()
    for layer, name in zip(layers, names):
        ia3 = base.get_submodule(name)
        ia3.ia3_l["default"] = torch.nn.Parameter(vectors[layer].to(vector_dtype).unsqueeze(0), requires_grad=False)
    log(f"IA3 mask adapter on {len(names)} layers for {len(hs)} heads: {hs}")

    metadata = build_metadata(
        fmt="adapter", model=model, revision=revision, heads=hs, heads_file=heads_file,
        heads_source=source, top_k=top_k, ablation=ablation, dtype=dtype, mean_reference=None,
        out=out_path, model_type=meta.config.model_type,
    )
    metadata["adapter"] = {"peft_type": "IA3", "target_modules": names, "vector_dtype": str(vector_dtype).removeprefix("torch.")}
    log(f"Saving adapter to {out_path} ...")
    with atomic_output_dir(out_path, overwrite) as tmp:
        # save_embedding_layers=False: no look-up of the base model's config on the Hub
        peft_model.save_pretrained(tmp, safe_serialization=True, save_embedding_layers=False)
        write_card_and_metadata(tmp, metadata, repo_id)  # replaces PEFT's template card
        files = list_files(tmp)
    return ExportResult(out_path, "adapter", hs, files, metadata)

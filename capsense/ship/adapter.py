"""The ``adapter`` export: a PEFT adapter on the output projections of the edited layers.

Zero ablation is an IA3 mask adapter built without loading weights: the model is built on the ``meta``
device from its config, the output projections of the edited layers are wrapped in IA3 layers with
``feedforward_modules`` = ``target_modules`` (so IA3 scales the projection's *input*), each vector 0 on the
ablated heads' slices and 1 elsewhere.

Mean ablation needs an added constant, which IA3 cannot carry, so it is a LoRA adapter with PEFT's
``lora_bias``: on each edited projection ``A`` picks the ablated heads' input slices, ``B = -W[:, S]``
removes what they contribute and the bias ``W[:, S] @ mean[S]`` adds what their means contribute, so
``W x + B A x + b`` is the projection with those heads replaced by their means (the checkpoint export's
fold, :func:`~capsense.ship.checkpoint.fold_means_into_bias`, in adapter form). Its rank is the ablated
width of the layer (``k * head_dim``), with ``lora_alpha`` equal to it (scaling 1). It loads the weights
once, to read ``W[:, S]`` and to compute the means. PEFT cannot merge a LoRA bias into a projection that has
none (Llama's), so such an adapter is used unmerged; ``format`` checkpoint gives the merged model.
Either adapter is saved with PEFT's own ``save_pretrained``.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable

import torch
from torch import nn

from capsense.core.arch import arch_spec, base_layer, head_layout, out_projections
from capsense.core.files import atomic_output_dir
from capsense.core.heads import HeadSet, HeadsLike
from capsense.ship.base import ExportResult, noop
from capsense.ship.checkpoint import head_columns, head_indices
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


@torch.no_grad()
def mean_lora_weights(model: nn.Module, heads: HeadsLike,
                      means: dict[int, torch.Tensor]) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``{layer: (A, B, bias)}`` in float64 on the CPU: the LoRA on the layer's output projection that replaces
    the heads' input slices ``S`` by their ``means`` (:func:`~capsense.core.ablation.compute_head_means`).
    ``A`` [``|S|``, in] is 1 at each ablated position, ``B`` = ``-W[:, S]``, ``bias`` = ``W[:, S] @ mean[S]``."""
    layout = head_layout(model)
    hs = HeadSet.parse(heads).check_fits(layout)
    spec, projections = arch_spec(model), out_projections(model)
    out = {}
    for layer, head_ids in sorted(hs.by_layer().items()):
        idx = head_indices(head_ids, layout.head_dim)
        cols = head_columns(base_layer(projections[layer]), idx, spec.transposed).cpu()
        a = torch.zeros(len(idx), layout.n_heads * layout.head_dim, dtype=torch.float64)
        a[torch.arange(len(idx)), idx] = 1
        out[layer] = (a, -cols, cols @ means[layer].double().cpu()[idx])
    return out


def projection_names(model: nn.Module, layers: list[int]) -> list[str]:
    """Fully qualified module names of the output projections of ``layers``."""
    projections = out_projections(model)
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(projections[l])] for l in layers]


def _ia3_model(meta: nn.Module, hs: HeadSet, names: list[str], weight_dtype: torch.dtype, revision: str | None):
    """The IA3 mask adapter (zero ablation) on the ``meta`` model, and its record for ``capsense.json``."""
    from peft import IA3Config, get_peft_model

    config = IA3Config(task_type="CAUSAL_LM", target_modules=names, feedforward_modules=names,
                       fan_in_fan_out=arch_spec(meta).transposed, init_ia3_weights=True, inference_mode=True)
    peft_model = get_peft_model(meta, config, revision=revision)
    base = peft_model.get_base_model()
    vectors = ia3_vectors(meta, hs)
    for layer, name in zip(hs.layers(), names):
        base.get_submodule(name).ia3_l["default"] = nn.Parameter(vectors[layer].to(weight_dtype).unsqueeze(0),
                                                                 requires_grad=False)
    return peft_model, {"peft_type": "IA3", "target_modules": names,
                        "vector_dtype": str(weight_dtype).removeprefix("torch.")}


def _mean_lora_model(model: str, meta: nn.Module, hs: HeadSet, names: list[str], weight_dtype: torch.dtype,
                     revision: str | None, mean_reference, device_map: str | None, log: Callable[[str], None],
                     device: str = "cpu"):
    """The LoRA adapter of mean ablation on the ``meta`` model, its weights read from ``model`` loaded once (as
    stored), and its record for ``capsense.json``."""
    from peft import LoraConfig, get_peft_model

    from capsense.core.ablation import reference_means
    from capsense.core.models import load_model

    log(f"Loading {model} to read the heads' output columns and compute their means ...")
    lm, tokenizer = load_model(model, dtype="auto", revision=revision, device=device, device_map=device_map)
    weights = mean_lora_weights(lm, hs, reference_means(lm, tokenizer, "mean", mean_reference))
    del lm
    ranks = {name: int(weights[layer][0].shape[0]) for layer, name in zip(hs.layers(), names)}
    patterns = {re.escape(name): r for name, r in ranks.items()}  # PEFT matches these keys as regular expressions
    config = LoraConfig(task_type="CAUSAL_LM", target_modules=names, r=max(ranks.values()),
                        lora_alpha=max(ranks.values()), rank_pattern=patterns, alpha_pattern=patterns,
                        lora_dropout=0.0, lora_bias=True, init_lora_weights=False,
                        fan_in_fan_out=arch_spec(meta).transposed, inference_mode=True)
    with warnings.catch_warnings():  # "merging won't be possible" where the projection has no bias: the card says so
        warnings.filterwarnings("ignore", message="`lora_bias=True` was passed")
        peft_model = get_peft_model(meta, config, revision=revision)
    base = peft_model.get_base_model()
    for layer, name in zip(hs.layers(), names):
        a, b, bias = (nn.Parameter(t.to(weight_dtype), requires_grad=False) for t in weights[layer])
        lora = base.get_submodule(name)
        lora.lora_A["default"].weight, lora.lora_B["default"].weight, lora.lora_B["default"].bias = a, b, bias
    return peft_model, {"peft_type": "LORA", "target_modules": names, "lora_bias": True, "ranks": ranks,
                        "weight_dtype": str(weight_dtype).removeprefix("torch.")}


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
    device_map: str | None = None, device: str = "cpu",
    checked: ExportInputs | None = None,
) -> ExportResult:
    """Save a PEFT adapter that ablates ``heads`` of ``model``: IA3 for zero ablation (no weights loaded), LoRA
    with a bias for mean ablation (the model loaded once, on ``device`` or spread over GPUs by ``device_map``).

    Its weights are stored in ``dtype`` (float32 for ``auto``): IA3's 0 and 1 are exact in all; the LoRA's
    ``B = -W[:, S]`` is exact in float32 for a base stored in 16 bits or float32, and its bias is computed in
    float64 and rounded once.
    ``max_shard_size`` is accepted for a uniform format signature and unused (an adapter is small).
    ``checked``: this request's :func:`~capsense.ship.preflight.check_export_inputs` (None: checked here).
    """
    out_path, hs, heads_file, source, meta = preflight(
        model, heads, out, revision, checked, format="adapter", top_k=top_k, ablation=ablation,
        mean_reference=mean_reference, dtype=dtype, overwrite=overwrite, device_map=device_map)
    names = projection_names(meta, hs.layers())
    weight_dtype = torch.float32 if dtype == "auto" else getattr(torch, dtype)
    if ablation == "mean":
        peft_model, adapter = _mean_lora_model(model, meta, hs, names, weight_dtype, revision, mean_reference,
                                               device_map, log, device)
    else:
        peft_model, adapter = _ia3_model(meta, hs, names, weight_dtype, revision)
    # adapter_config.json is published too: the base by Hub id, never by a path of this machine
    hub_id = base_model_hub_id(model)
    peft_model.peft_config["default"].base_model_name_or_path = hub_id or public_name(model)
    log(f"{adapter['peft_type']} {ablation}-ablation adapter on {len(names)} layers for {len(hs)} heads: {hs}")

    metadata = build_metadata(
        fmt="adapter", model=model, revision=revision, heads=hs, heads_file=heads_file,
        heads_source=source, top_k=top_k, ablation=ablation, dtype=dtype,
        mean_reference=str(mean_reference) if mean_reference else None, out=out_path,
        model_type=meta.config.model_type,
    )
    metadata["adapter"] = adapter
    log(f"Saving adapter to {out_path} ...")
    with atomic_output_dir(out_path, overwrite) as tmp, warnings.catch_warnings():
        # PEFT 0.21 takes any 1-D lora_B tensor for an ungathered ZeRO-3 shard; lora_bias's bias is 1-D by nature
        warnings.filterwarnings("ignore", message=r".*LoRA tensor\(s\) have invalid shape")
        # save_embedding_layers=False: no look-up of the base model's config on the Hub
        peft_model.save_pretrained(tmp, safe_serialization=True, save_embedding_layers=False)
        write_card_and_metadata(tmp, metadata, repo_id)  # replaces PEFT's template card
        files = list_files(tmp)
    return ExportResult(out_path, "adapter", hs, files, metadata)

"""Everything an export checks before it loads weights: the heads, the output folder, the architecture.

The model is built on the ``meta`` device from its config (shapes and names, no weights),
so a bad head, an unsupported architecture or a mean ablation that cannot be folded fails
in seconds, before the slow load.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from capsense.core.ablation import resolve_ablation
from capsense.core.arch import arch_spec, base_layer, head_layout, out_projections
from capsense.core.files import check_output_dir
from capsense.core.heads import HeadSet, HeadsFile, HeadsLike, load_heads_file, looks_like_heads_file
from capsense.errors import CapsenseError, HeadSpecError
from capsense.core.model_config import config_head_layout, quantization_method
from capsense.core.models import check_model, model_load_errors, resolve_pretrained
from capsense.core.placement import check_placement
from capsense.ship.base import FORMATS, check_dtype

if TYPE_CHECKING:
    from torch import nn

# Where mean ablation can be folded into a bias that stock transformers loads (5.x
# modeling code): the output projection has a bias, or config.attention_bias gives it one (:func:`bias_switch`).
_SWITCHED = "always: config.attention_bias is turned on (zero q/k/v/o biases beside the folded means)"
MEAN_FOLD_SUPPORT: dict[str, str] = {
    "gpt2": "always (Conv1D c_proj has a bias)",
    "gpt_neox": "when config.attention_bias is true (the default)",
    "llama": _SWITCHED,
    "qwen3": _SWITCHED,
    "gemma": _SWITCHED,
    "gemma2": _SWITCHED,
    "gemma3_text": _SWITCHED,
    "gemma3": "only when text_config.attention_bias is true (the multimodal config's switch is not turned on)",
    "olmo2": _SWITCHED,
    "mistral": "never (o_proj is built with bias=False)",
    "qwen2": "never (o_proj is built with bias=False)",
    "phi3": "never (o_proj is built with bias=False)",
    "phi": "always (self_attn.dense has a bias)",
    "starcoder2": "when config.use_bias is true (the default)",
    **dict.fromkeys(
        ("mixtral", "qwen2_moe", "glm4_moe", "glm", "glm4", "ministral", "helium", "exaone4", "seed_oss", "stablelm"),
        "never (o_proj is built with bias=False)",
    ),
}
#: What a supported family not listed above allows (checked on tiny models: attention_bias builds the bias).
MEAN_FOLD_OTHERWISE = "when its config has attention_bias (turned on), or its output projection has a bias"


def resolve_heads(heads: HeadsLike, top_k: int | None = None) -> tuple[HeadSet, HeadsFile | None, Path | None]:
    """The head set to ablate, the heads file it came from (if any) and that file's path."""
    heads_file = source = None
    if isinstance(heads, (str, os.PathLike)) and looks_like_heads_file(heads):
        source = Path(heads)
        heads_file = load_heads_file(source)
        hs = heads_file.selected(top_k)
    else:
        hs = HeadSet.parse(heads, top_k=top_k)
    if not hs:
        raise HeadSpecError("no heads to ablate: give at least one head (e.g. L3H1) or a larger `top_k`")
    return hs, heads_file, source


def meta_model(model: str, revision: str | None = None) -> nn.Module:
    """The model built from its config on the ``meta`` device: shapes and names, no weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    check_model(model, revision)
    path = resolve_pretrained(model)
    kwargs = {"revision": revision} if revision else {}
    with model_load_errors(model):
        try:
            config = AutoConfig.from_pretrained(path, **kwargs)
        except ValueError as e:
            raise CapsenseError(f"cannot load the config of model {model!r}: {e}") from None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def bias_switch(model: nn.Module) -> list[str]:
    """The parameters that turning ``config.attention_bias`` on adds to ``model``, where all of them are biases and
    every attention output projection then has one (Llama, Qwen3, Gemma 1-3, OLMo 2 and most families laid out as
    Llama build q/k/v/o biases from it): a checkpoint can carry mean ablation with the switch on, every added bias
    zero but the folded means, which leaves every other output as it was (a zero bias adds nothing). [] where the
    config has no such switch, has it on already, or turning it on would add anything but biases."""
    import copy

    import torch

    config = getattr(model, "config", None)
    if getattr(config, "attention_bias", None) is not False:
        return []
    switched = copy.deepcopy(config)
    switched.attention_bias = True
    with torch.device("meta"):
        ref = type(model)(switched)
    added = sorted({n for n, _ in ref.named_parameters()} - {n for n, _ in model.named_parameters()})
    if not added or not all(n.endswith(".bias") for n in added):
        return []
    if any(getattr(base_layer(p), "bias", None) is None for p in out_projections(ref)):
        return []
    return added


def check_mean_foldable(model: nn.Module, heads: HeadSet) -> list[str]:
    """The biases to switch on (:func:`bias_switch`) so that every edited layer's output projection can carry
    its heads' means: [] where each has a bias already. Raise :class:`CapsenseError` where some has none and
    none can be switched on."""
    projections = out_projections(model)
    missing = [l for l in heads.layers() if getattr(base_layer(projections[l]), "bias", None) is None]
    switch = bias_switch(model) if missing else []
    if missing and not switch:
        model_type = model.config.model_type
        support = MEAN_FOLD_SUPPORT.get(model_type, MEAN_FOLD_OTHERWISE)
        raise CapsenseError(
            f"mean ablation cannot be folded into this {model_type} checkpoint: its attention output "
            f"projection has no bias to carry the head means (layers {missing}; {model_type}: {support}). "
            "A checkpoint can carry mean ablation for gpt2, gpt_neox and phi, and for llama, qwen3, gemma, "
            "gemma2, gemma3, olmo2 and most other families whose config has attention_bias (turned on). Use "
            "`format` adapter (a LoRA whose bias carries the means, for every family), `ablation` zero, or evaluate "
            "mean ablation without exporting: "
            "lm_eval --model capsense-masked --model_args ...,ablation=mean"
        )
    return switch


class ExportInputs(NamedTuple):
    """What :func:`check_export_inputs` returns: the output folder, the heads, their file and its path."""

    out: Path
    heads: HeadSet
    heads_file: HeadsFile | None
    source: Path | None


def check_export_inputs(
    model: str, heads: HeadsLike, out: str | os.PathLike, *, format: str, top_k: int | None = None,
    ablation: str = "zero", mean_reference: str | os.PathLike | None = None, dtype: str = "auto",
    overwrite: bool = False, device_map: str | None = None, revision: str | None = None, device: str = "cpu",
    **_settings: Any,
) -> ExportInputs:
    """Every check of an export request that needs neither torch nor the model's config, the same for every
    format (``format``'s own refusals included): run once per export, before any heavy import, by
    :func:`~capsense.ship.export.export_model` (the CLI: before its push check), which hands the result to the
    format (``checked``), or by a format called directly. A bad input raises one :class:`CapsenseError` naming
    it and what is valid; nothing is written. ``_settings``: the format's other settings, not checked here."""
    FORMATS.check(format)
    resolve_ablation({}, ablation, mean_reference)  # a known mode; a reference file only for mean, and there
    for name, given in (("device_map", bool(device_map)), ("device", device not in (None, "", "cpu"))):
        if given and format == "adapter" and ablation != "mean":
            raise CapsenseError(f"`{name}` applies to `format` checkpoint and to a mean-ablation adapter (a "
                                "zero-ablation adapter is built without loading weights)")
    check_placement(device, device_map)
    check_dtype(dtype)
    out_path = check_output_dir(out, overwrite, (model, heads, mean_reference))
    hs, heads_file, source = resolve_heads(heads, top_k)
    check_model(model, revision)
    if format == "adapter" and ablation == "mean" and quantization_method(model, revision) == "compressed-tensors":
        raise CapsenseError(
            "a mean-ablation adapter is a LoRA, and stock PEFT cannot put one on a packed compressed-tensors model "
            "(\"'Linear' object has no attribute 'weight'\" when it loads): export `format` checkpoint (a plain "
            "dense checkpoint with the means folded in) or a zero-ablation adapter (IA3, which loads on it)")
    layout = config_head_layout(model, revision)
    if layout is not None:
        hs.check_fits(layout)
    return ExportInputs(out_path, hs, heads_file, source)


def preflight(
    model: str, heads: HeadsLike, out: str | os.PathLike, revision: str | None, checked: ExportInputs | None,
    **settings: Any,
) -> tuple[Path, HeadSet, HeadsFile | None, Path | None, nn.Module]:
    """Every check that needs no weights, so a bad request fails before the slow load: :func:`check_export_inputs`
    of ``settings`` (skipped when the caller hands its result as ``checked``: :func:`~capsense.ship.export.export_model`),
    then the model built on the ``meta`` device (returned last), its architecture supported, the heads in it."""
    out_path, hs, heads_file, source = checked if checked is not None else check_export_inputs(model, heads, out, **settings)
    meta = meta_model(model, revision)
    arch_spec(meta)  # unsupported architecture: a clear error now
    hs.check_fits(head_layout(meta))
    return out_path, hs, heads_file, source, meta

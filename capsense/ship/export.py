"""Ship an ablated model: an edited safetensors checkpoint or a PEFT IA3 mask adapter.

* :func:`export_checkpoint` loads the model once, edits the output projections in place
  (:func:`~capsense.core.ablation.zero_heads_in_weights`; for mean ablation the head means are
  first folded into the projection's bias) and saves it with ``save_pretrained``.
  ``AutoModelForCausalLM.from_pretrained(out)`` reproduces the ablated logits.
* :func:`export_adapter` needs no weights at all: it builds the model on the ``meta``
  device from its config, wraps the output projections of the edited layers in IA3
  layers with ``feedforward_modules`` = ``target_modules`` (so IA3 scales the projection's
  *input*), sets each vector to 0 on the ablated heads' slices and 1 elsewhere, and saves
  the adapter with PEFT's own ``save_pretrained``.

Both write ``capsense.json`` (what was removed, from which base) and a ``README.md`` model
card (:func:`capsense.ship.hub.build_model_card`), atomically (:mod:`capsense.core.files`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from capsense.errors import CapsenseError
from capsense import __version__
from capsense.core.ablation import check_ablation_mode, compute_head_means, zero_heads_in_weights
from capsense.core.arch import arch_spec, base_layer, head_layout, out_projections, projection_weight
from capsense.core.files import atomic_output_dir, check_output_dir
from capsense.core.heads import HeadSet, HeadSpecError, HeadsFile, HeadsLike, looks_like_heads_file, load_heads_file
from capsense.core.models import DTYPES, is_embedded, load_model, model_fingerprint, resolve_pretrained

if TYPE_CHECKING:
    from torch import nn

FORMATS = ("checkpoint", "adapter")
METADATA_FILE = "capsense.json"

# Where mean ablation can be folded into a bias that stock transformers loads (5.x
# modeling code): the output projection must already have a bias.
MEAN_FOLD_SUPPORT: dict[str, str] = {
    "gpt2": "always (Conv1D c_proj has a bias)",
    "gpt_neox": "when config.attention_bias is true (the default)",
    "llama": "only when config.attention_bias is true",
    "qwen3": "only when config.attention_bias is true",
    "gemma2": "only when config.attention_bias is true",
    "gemma3_text": "only when config.attention_bias is true",
    "gemma3": "only when config.attention_bias is true",
    "olmo2": "only when config.attention_bias is true",
    "mistral": "never (o_proj is built with bias=False)",
    "qwen2": "never (o_proj is built with bias=False)",
    "phi3": "never (o_proj is built with bias=False)",
}

_MEAN_ADAPTER_MSG = (
    "mean ablation cannot be exported as an adapter: an IA3 adapter can only scale the "
    "projection's input (x * l), it cannot add the constant that replaces an ablated head's "
    "output under mean ablation. Use --format checkpoint (folds the means into the output "
    "projection's bias where the architecture has one), or --ablation zero, or evaluate mean "
    "ablation without exporting: lm_eval --model capsense-masked --model_args ...,ablation=mean"
)


class ExportError(CapsenseError):
    """An export that cannot be done as asked (the message says why and what to do instead)."""


@dataclass
class ExportResult:
    """What an export wrote: the folder, its files and the ``capsense.json`` metadata."""

    out: Path
    format: str
    heads: HeadSet
    files: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)


def _noop(msg: str) -> None:
    pass


# -- inputs ----------------------------------------------------------------------------


def resolve_heads(
    heads: HeadsLike, top_k: int | None = None
) -> tuple[HeadSet, HeadsFile | None, Path | None]:
    """The head set to ablate, the heads file it came from (if any) and that file's path."""
    heads_file = source = None
    if isinstance(heads, (str, os.PathLike)) and looks_like_heads_file(heads):
        source = Path(heads)
        heads_file = load_heads_file(source)
        hs = HeadSet.parse(heads_file.head_set, top_k=top_k)
    else:
        hs = HeadSet.parse(heads, top_k=top_k)
    if not hs:
        raise HeadSpecError("no heads to ablate: give at least one head (e.g. --heads L3H1) or a larger --top-k")
    return hs, heads_file, source


def base_model_hub_id(model: str) -> str | None:
    """The Hub id a model name stands for, or None for a local folder of unknown origin."""
    path = resolve_pretrained(model)
    if os.path.isdir(path):
        src = Path(path) / "capsense_source.json"
        if src.is_file():
            try:
                return json.loads(src.read_text()).get("source") or None
            except (OSError, json.JSONDecodeError):
                return None
        return None
    return model


def meta_model(model: str, revision: str | None = None) -> nn.Module:
    """The model built from its config on the ``meta`` device: shapes and names, no weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        path = resolve_pretrained(model)
    except OSError as e:  # the embedded model's package is missing
        raise ExportError(str(e)) from None
    if not os.path.isdir(path) and (model.startswith((".", "/", "~")) or model.count("/") > 1 or "\\" in model):
        raise ExportError(f"model folder {model!r} not found (give a local folder, a Hub id or smollm2-135m)")
    kwargs = {"revision": revision} if revision else {}
    try:
        config = AutoConfig.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:
        raise ExportError(f"cannot load the config of model {model!r}: {e}") from None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def check_mean_foldable(model: nn.Module, heads: HeadSet) -> None:
    """Raise :class:`ExportError` if some edited layer's output projection has no bias."""
    projections = out_projections(model)
    missing = [l for l in heads.layers() if getattr(base_layer(projections[l]), "bias", None) is None]
    if missing:
        model_type = model.config.model_type
        support = MEAN_FOLD_SUPPORT.get(model_type, "unknown")
        raise ExportError(
            f"mean ablation cannot be folded into this {model_type} checkpoint: its attention output "
            f"projection has no bias to carry the head means (layers {missing}; {model_type}: {support}). "
            "A checkpoint can carry mean ablation for gpt2 and gpt_neox, and for llama, qwen3, gemma2, "
            "gemma3 and olmo2 configs with attention_bias=true. Use "
            "--ablation zero, or evaluate mean ablation without exporting: "
            "lm_eval --model capsense-masked --model_args ...,ablation=mean"
        )


# -- weight edits ----------------------------------------------------------------------


def _head_indices(heads: list[int], head_dim: int) -> torch.Tensor:
    return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in sorted(heads)])


@torch.no_grad()
def fold_means_into_bias(model: nn.Module, heads: HeadsLike, means: dict[int, torch.Tensor]) -> None:
    """Mean ablation in weight space, in place: ``b += W[:, S] @ mean[S]``, then ``W[:, S] = 0``.

    ``S`` are the ablated heads' input slices (rows of GPT-2's transposed Conv1D weight).
    """
    hs = HeadSet.parse(heads).check_fits(head_layout(model))
    check_mean_foldable(model, hs)
    spec = arch_spec(model)
    layout = head_layout(model)
    projections = out_projections(model)
    for layer, head_ids in hs.by_layer().items():
        proj = base_layer(projections[layer])
        w = projection_weight(proj)
        idx = _head_indices(head_ids, layout.head_dim).to(w.device)
        mean = means[layer].to(device=w.device, dtype=torch.float64)[idx]
        cols = w.index_select(0 if spec.transposed else 1, idx).double()
        shift = mean @ cols if spec.transposed else cols @ mean
        proj.bias.copy_((proj.bias.double() + shift).to(proj.bias.dtype))
    zero_heads_in_weights(model, hs)


def ia3_vectors(model: nn.Module, heads: HeadsLike) -> dict[int, torch.Tensor]:
    """``{layer: vector}`` over the projection input: 0 on ablated heads' slices, 1 elsewhere."""
    layout = head_layout(model)
    hs = HeadSet.parse(heads).check_fits(layout)
    width = layout.n_heads * layout.head_dim
    out = {}
    for layer, head_ids in sorted(hs.by_layer().items()):
        v = torch.ones(width, dtype=torch.float32)
        v[_head_indices(head_ids, layout.head_dim)] = 0
        out[layer] = v
    return out


def projection_names(model: nn.Module, layers: list[int]) -> list[str]:
    """Fully qualified module names of the output projections of ``layers``."""
    projections = out_projections(model)
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(projections[l])] for l in layers]


# -- metadata --------------------------------------------------------------------------


def _capsense_name(model: str, hub_id: str | None) -> str:
    """How capsense commands in the card name the base: a local copy of a Hub model by its id."""
    return hub_id if os.path.isdir(model) and hub_id else model


def _reproduce_command(
    fmt: str, model: str, hub_id: str | None, hs: HeadSet, ablation: str, dtype: str,
    revision: str | None, mean_reference: str | None, out: Path,
) -> str:
    # The heads go in as a spec, not the file, so the command works without the run folder.
    args = ["capsense", "export", _capsense_name(model, hub_id), "--heads", str(hs), "--format", fmt, "--out", out.name]
    if ablation != "zero":
        args += ["--ablation", ablation]
    if mean_reference:
        args += ["--mean-reference", mean_reference]
    if dtype != "auto":
        args += ["--dtype", dtype]
    if revision:
        args += ["--revision", revision]
    return " ".join(shlex.quote(a) for a in args)


def build_metadata(
    *,
    fmt: str,
    model: str,
    revision: str | None,
    heads: HeadSet,
    heads_file: HeadsFile | None,
    heads_source: Path | None,
    top_k: int | None,
    ablation: str,
    dtype: str,
    mean_reference: str | None,
    out: Path,
    model_type: str,
) -> dict[str, Any]:
    """The contents of ``capsense.json``: heads, base model, ablation, how to reproduce."""
    from capsense.ship.hub import find_validation

    records = {}
    if heads_file is not None:
        for r in heads_file.heads:
            records.setdefault((int(r["layer"]), int(r["head"])), r)
    head_rows = []
    for h in heads:
        row: dict[str, Any] = {"layer": h.layer, "head": h.head}
        imp = records.get((h.layer, h.head), {}).get("importance")
        if isinstance(imp, (int, float)) and not isinstance(imp, bool):
            row["importance"] = imp
        head_rows.append(row)
    hub_id = base_model_hub_id(model)
    base = model_fingerprint(model, revision)
    base["hub_id"] = hub_id
    base["capsense_name"] = _capsense_name(model, hub_id)
    if is_embedded(model):
        base["note"] = (
            "capsense's embedded model: the GGUF (Q4_1) release of this model, dequantized to "
            "float32; its weights are close to, not identical with, the Hub checkpoint"
        )
    meta: dict[str, Any] = {
        "capsense_version": __version__,
        "format": fmt,
        "model_type": model_type,
        "ablation": ablation,
        "heads_spec": str(heads),
        "heads": head_rows,
        "heads_source": (
            {"file": str(heads_source), "top_k": top_k, "model": heads_file.model if heads_file else None}
            if heads_source is not None
            else None
        ),
        "base_model": base,
        "dtype": dtype,
        "folder": out.name,
        "command": _reproduce_command(fmt, model, hub_id, heads, ablation, dtype, revision, mean_reference, out),
    }
    if ablation == "mean":
        meta["mean_reference"] = mean_reference or "capsense.tasks.prose.PASSAGES"
    if heads_source is not None:
        validation = find_validation(heads_source.parent, heads_file.meta if heads_file else None)
        if validation:
            meta["validation_markdown"] = validation
    return meta


def _write_card_and_metadata(folder: Path, meta: dict[str, Any], repo_id: str | None) -> None:
    from capsense.ship.hub import build_model_card

    card = build_model_card(meta, repo_id=repo_id)
    text = str(card)
    (folder / "README.md").write_text(text, encoding="utf-8")
    meta["card_sha256"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    meta["card_repo_id"] = repo_id
    (folder / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def _list_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _preflight(
    model: str, heads: HeadsLike, out: str | os.PathLike, top_k: int | None, ablation: str,
    overwrite: bool, revision: str | None,
) -> tuple[Path, HeadSet, HeadsFile | None, Path | None, nn.Module]:
    """Every check that needs no weights, so a bad request fails before the slow load."""
    try:
        check_ablation_mode(ablation)
    except ValueError as e:
        raise ExportError(str(e)) from None
    out_path = check_output_dir(out, overwrite)
    hs, heads_file, source = resolve_heads(heads, top_k)
    meta = meta_model(model, revision)
    arch_spec(meta)  # unsupported architecture: a clear error now
    hs.check_fits(head_layout(meta))
    return out_path, hs, heads_file, source, meta


# -- the two exports -------------------------------------------------------------------


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
    log: Callable[[str], None] = _noop,
) -> ExportResult:
    """Save ``model`` with ``heads`` ablated in its weights, as a plain transformers folder.

    Zero ablation zeroes the heads' input columns of the output projection; mean ablation
    (where the projection has a bias, see :data:`MEAN_FOLD_SUPPORT`) first adds the heads'
    mean contribution to the bias. The model is loaded once and edited in place.
    """
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if mean_reference and ablation != "mean":
        raise ExportError("--mean-reference only applies to --ablation mean")
    out_path, hs, heads_file, source, meta = _preflight(model, heads, out, top_k, ablation, overwrite, revision)
    if ablation == "mean":
        check_mean_foldable(meta, hs)
    model_type = meta.config.model_type
    del meta
    texts = None
    if ablation == "mean" and mean_reference:
        from capsense.evaluation.lm_eval_model import read_reference_texts

        texts = read_reference_texts(mean_reference)

    log(f"Loading {model} ...")
    try:
        lm, tokenizer = load_model(model, dtype=dtype, revision=revision)
    except (OSError, ValueError) as e:
        raise ExportError(f"cannot load model {model!r}: {e}") from None
    if ablation == "mean":
        log("Computing head means on the reference texts ...")
        fold_means_into_bias(lm, hs, compute_head_means(lm, tokenizer, texts))
    else:
        zero_heads_in_weights(lm, hs)
    log(f"Ablated {len(hs)} heads in {len(hs.layers())} layers ({ablation}): {hs}")

    metadata = build_metadata(
        fmt="checkpoint", model=model, revision=revision, heads=hs, heads_file=heads_file,
        heads_source=source, top_k=top_k, ablation=ablation, dtype=dtype,
        mean_reference=str(mean_reference) if mean_reference else None, out=out_path,
        model_type=model_type,
    )
    metadata["torch_dtype"] = str(next(lm.parameters()).dtype).removeprefix("torch.")
    log(f"Saving checkpoint to {out_path} ...")
    with atomic_output_dir(out_path, overwrite) as tmp:
        lm.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(tmp)
        _write_card_and_metadata(tmp, metadata, repo_id)
        files = _list_files(tmp)
    return ExportResult(out_path, "checkpoint", hs, files, metadata)


def export_adapter(
    model: str,
    heads: HeadsLike,
    out: str | os.PathLike,
    *,
    top_k: int | None = None,
    ablation: str = "zero",
    dtype: str = "auto",
    revision: str | None = None,
    overwrite: bool = False,
    repo_id: str | None = None,
    log: Callable[[str], None] = _noop,
) -> ExportResult:
    """Save a PEFT IA3 adapter that zero-ablates ``heads`` of ``model`` (no weights loaded).

    Its vectors are stored in ``dtype`` (float32 for ``auto``); 0 and 1 are exact in all.
    """
    if ablation == "mean":
        raise ExportError(_MEAN_ADAPTER_MSG)
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    from peft import IA3Config, get_peft_model

    out_path, hs, heads_file, source, meta = _preflight(model, heads, out, top_k, ablation, overwrite, revision)
    spec = arch_spec(meta)
    layers = hs.layers()
    names = projection_names(meta, layers)
    vectors = ia3_vectors(meta, hs)
    vector_dtype = torch.float32 if dtype == "auto" else getattr(torch, dtype)
    hub_id = base_model_hub_id(model)
    config = IA3Config(
        task_type="CAUSAL_LM",
        target_modules=names,
        feedforward_modules=names,
        fan_in_fan_out=spec.transposed,
        init_ia3_weights=True,
        inference_mode=True,
    )
    peft_model = get_peft_model(meta, config, revision=revision)
    peft_model.peft_config["default"].base_model_name_or_path = hub_id or str(resolve_pretrained(model))
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
        _write_card_and_metadata(tmp, metadata, repo_id)  # replaces PEFT's template card
        files = _list_files(tmp)
    return ExportResult(out_path, "adapter", hs, files, metadata)


def export_model(model: str, heads: HeadsLike, out: str | os.PathLike, *, format: str, **kwargs: Any) -> ExportResult:
    """Dispatch to :func:`export_checkpoint` or :func:`export_adapter` by ``format``."""
    if format == "checkpoint":
        return export_checkpoint(model, heads, out, **kwargs)
    if format == "adapter":
        mean_reference = kwargs.pop("mean_reference", None)
        kwargs.pop("max_shard_size", None)
        if mean_reference and kwargs.get("ablation", "zero") != "mean":
            raise ExportError("--mean-reference only applies to --ablation mean")
        return export_adapter(model, heads, out, **kwargs)
    raise ExportError(f"unknown format {format!r}: choose checkpoint or adapter")

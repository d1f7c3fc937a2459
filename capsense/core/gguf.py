"""GGUF files (llama.cpp's format) as models: checked without torch, converted once to a cached folder.

transformers loads a GGUF file with ``gguf_file=`` (dequantized), but a model loaded that way
refuses ``save_pretrained`` and loads slowly; :func:`convert_gguf` rebuilds it from its config
without the quantization config and saves a plain safetensors folder, which every later load
uses. The embedded models (:mod:`capsense.core.models`) and any local ``*.gguf`` file go
through it.

A local file's folder is ``<cache>/models/gguf/<stem>-<key>``, the key a hash of the file's
resolved path, size and modification time, not of its content: hashing a multi-GB file would
cost seconds to minutes on every command that names it, while a changed file (new size or
mtime) still gets a fresh conversion; a copy of the same file elsewhere converts once more. The
converted folder's content hash is what a run's manifest records.

:func:`gguf_header` reads only the header's first key/value pairs itself: ``gguf.GGUFReader``
parses every field, measured at 12 s for Gemma 3's 262k-token vocabulary on this machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

from capsense.core.files import cache_dir
from capsense.errors import UnknownModelError

#: GGUF ``general.architecture`` -> the transformers ``model_type`` it converts to, for the
#: architectures both transformers' GGUF loader and capsense's table (:mod:`capsense.core.arch`) know.
GGUF_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "gpt2": "gpt2",
}


def is_gguf_path(name: Any) -> bool:
    return isinstance(name, str) and name.lower().endswith(".gguf")


# value type -> struct format of one scalar (GGUF spec: 8 is a string, 9 an array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize("<" + fmt)
    data = f.read(size)
    if len(data) != size:
        raise EOFError
    return struct.unpack("<" + fmt, data)[0]


def _string(f: BinaryIO) -> str:
    n = _read(f, "Q")
    data = f.read(n)
    if len(data) != n:
        raise EOFError
    return data.decode("utf-8", errors="replace")


def _value(f: BinaryIO, vtype: int) -> Any:
    if vtype == _STRING:
        return _string(f)
    if vtype == _ARRAY:
        item, n = _read(f, "I"), _read(f, "Q")
        if item in _SCALARS:  # skipped: no header key we need is an array
            f.seek(n * struct.calcsize("<" + _SCALARS[item]), os.SEEK_CUR)
        else:
            for _ in range(n):
                _value(f, item)
        return None
    if vtype not in _SCALARS:
        raise ValueError(f"unknown GGUF value type {vtype}")
    return _read(f, _SCALARS[vtype])


def gguf_header(path: str | os.PathLike) -> dict[str, Any]:
    """``general.architecture`` and the architecture's ``block_count`` and ``attention.head_count``.

    Reads key/value pairs until those are found (they come first in llama.cpp's files);
    refuses a file that is not GGUF version 2 or 3.
    """
    found: dict[str, Any] = {}
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise UnknownModelError(f"{str(path)!r} is not a GGUF file (no GGUF magic at its start)")
            version = _read(f, "I")
            if version not in (2, 3):
                raise UnknownModelError(f"{str(path)!r} is GGUF version {version}; versions 2 and 3 are supported")
            _read(f, "Q")  # tensor count
            for _ in range(_read(f, "Q")):
                key, vtype = _string(f), _read(f, "I")
                value = _value(f, vtype)
                arch = found.get("general.architecture")
                if key == "general.architecture" or (arch and key in (f"{arch}.block_count", f"{arch}.attention.head_count",
                                                                      f"{arch}.attention.head_count_kv")):
                    found[key] = value
                if len(found) == 4:
                    break
    except UnknownModelError:
        raise
    except (EOFError, ValueError, UnicodeDecodeError):
        raise UnknownModelError(f"{str(path)!r} is not a readable GGUF file (its header is truncated or corrupt)") from None
    except IsADirectoryError:
        raise UnknownModelError(f"{str(path)!r} is a folder, not a GGUF file") from None
    except OSError as e:
        raise UnknownModelError(f"cannot read GGUF file {str(path)!r}: {e.strerror or e}") from None
    arch = found.get("general.architecture")
    return {
        "architecture": arch,
        "n_layers": found.get(f"{arch}.block_count"),
        "n_heads": found.get(f"{arch}.attention.head_count"),
        "n_kv_heads": found.get(f"{arch}.attention.head_count_kv"),
    }


def check_gguf_file(path: str) -> dict[str, Any]:
    """Fail fast (no torch) unless ``path`` is a GGUF file of a supported architecture; its header."""
    if not os.path.exists(path):
        raise UnknownModelError(f"GGUF file {path!r} does not exist")
    header = gguf_header(path)
    arch = header["architecture"]
    if arch not in GGUF_MODEL_TYPES:
        raise UnknownModelError(
            f"GGUF file {path!r} holds architecture {arch!r}; capsense converts GGUF files of "
            f"{', '.join(GGUF_MODEL_TYPES)} (architectures transformers can load from GGUF and "
            "capsense can ablate heads of)"
        )
    return header


def gguf_folder(path: str) -> Path:
    """The cache folder of a local GGUF file (keyed by resolved path, size and mtime; see the module doc)."""
    real = os.path.realpath(path)
    st = os.stat(real)
    key = hashlib.sha256(f"{real}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / "gguf" / f"{Path(real).stem}-{key}"


def is_converted(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def ensure_gguf_folder(path: str) -> Path:
    """The converted folder of a local GGUF file, converting it on first use."""
    check_gguf_file(path)
    target = gguf_folder(path)
    if not is_converted(target):
        print(f"Converting {path} once (GGUF -> safetensors); cached in {target}", file=sys.stderr, flush=True)
        convert_gguf(Path(path), target, {"source": None, "gguf_file": Path(path).name})
    return target


def convert_gguf(gguf_path: Path, target: Path, source: dict[str, Any]) -> None:
    """Dequantize a GGUF checkpoint into a plain safetensors folder ``target`` (atomic).

    ``source`` goes to ``capsense_source.json`` (``source``: the Hub id of the original, or None).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from capsense.core.progress import without_library_bars

    try:
        with without_library_bars():  # one line above says what happens; no raw per-tensor bars
            loaded, info = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, output_loading_info=True)
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except (ValueError, KeyError, NotImplementedError) as e:  # e.g. a quantization type it cannot read
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UnknownModelError(f"transformers cannot load GGUF file {str(gguf_path)!r}: {first}") from None
    # transformers initializes weights the file lacks at random and only warns: refuse instead.
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise UnknownModelError(
            f"GGUF file {str(gguf_path)!r} lacks {len(missing)} weights its architecture "
            f"({loaded.config.model_type}) needs, e.g. {', '.join(missing[:3])}: it would load partly random"
        )
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
        with without_library_bars():
            model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "capsense_source.json").write_text(json.dumps(source, indent=2) + "\n")
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model.safetensors").is_file():  # lost a race only if it exists
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

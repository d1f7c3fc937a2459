"""Compressed checkpoints people can ship: quantized matrices packed as integers, in compressed-tensors format.

A quantized matrix in memory is ``code * scale`` with one bfloat16-exact scale per group
(:mod:`~capsense.compress.quantize`, :mod:`~capsense.compress.gptq`). :func:`write_packed` stores
it as the ``pack-quantized`` format of the ``compressed-tensors`` library (the format vLLM and
llm-compressor use): the codes packed densely into int32 words (``weight_packed``), the 16-bit
scales (``weight_scale``) and the shape, one config group per (bits, group size), so a guided
allocation with its own bits per matrix is one checkpoint. Stock
``AutoModelForCausalLM.from_pretrained(DIR)`` loads it when ``compressed-tensors`` is installed
and dequantizes to exactly the weights the model had in memory (cast to the checkpoint's dtype).

What the format cannot store is refused before anything is written (:func:`check_storable`):

* codes wider than 8 bits (the packer's limit);
* a group size that does not divide a matrix's input columns (the library dequantizes whole
  groups only; SmolLM2's 576-column matrices take 64 or 32, not 128); 0 (one scale per output
  row) always fits;
* protected heads inside a quantized matrix (rows/columns kept at 16 bits in a packed matrix);
* GPT-2's ``Conv1D`` matrices (the library packs ``nn.Linear`` only);
* pruned and low-rank matrices: compressed-tensors has had no sparse storage since 0.15 (its
  bitmask and 2:4 compressors were removed and transformers loads quantized checkpoints only),
  and no factored one. Those are written with ``fmt`` dense (zeros stored, products multiplied
  out), as before, and their sizes stay accounted (:mod:`~capsense.compress.accounting`): the
  kept weights, protected heads' rows and columns included (dense on top of the density; a 2:4
  matrix holding protected heads is 2:4 outside their columns only, so the accounted size is what a
  2:4 store of its free block plus the dense protected columns holds, not a 2:4 store of the whole).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from capsense.errors import CapsenseError
from capsense.compress.quantize import PACKED_MAX_BITS, group_width
from capsense.core.progress import without_library_bars

FORMATS = ("compressed-tensors", "dense")
PACK_FORMAT = "pack-quantized"


@dataclass(frozen=True)
class PackedWeight:
    """One quantized matrix: its bit width, group size (0 = per row) and ``[out, groups]`` scales."""

    bits: int
    group_size: int
    scales: torch.Tensor


def _fitting_groups(n_ins: Iterable[int]) -> str:
    fits = [g for g in (256, 128, 64, 32, 16) if all(n % g == 0 for n in n_ins)]
    return ", ".join(map(str, fits + [0]))


def unstorable(shape: tuple[int, int], setting, protected: bool, linear: bool = True) -> str | None:
    """Why a matrix of ``shape`` under ``setting`` (None = untouched) cannot be packed, or None."""
    if setting is None:
        return None
    if not linear:
        return "a Conv1D matrix (GPT-2): compressed-tensors packs nn.Linear weights only"
    family = getattr(setting, "family", "")
    if family == "prune":
        return "pruned weights: compressed-tensors has no sparse storage (removed in 0.15)"
    if family != "quant":
        return f"{family} matrices: compressed-tensors has no factored storage"
    if setting.bits > PACKED_MAX_BITS:
        return f"{setting.bits}-bit codes: packed codes are 1 to {PACKED_MAX_BITS} bits"
    if protected:
        return "protected heads: rows/columns kept at 16 bits inside a packed matrix"
    g = group_width(shape[1], setting.group_size)
    if shape[1] % g:
        return f"group size {setting.group_size} on {shape[1]} input columns: groups must divide the columns"
    return None


def check_storable(items: Iterable[tuple[str, tuple[int, int], Any, bool, bool]]) -> None:
    """CapsenseError naming what compressed-tensors cannot store among (name, shape, setting, protected, linear)."""
    problems: dict[str, list[tuple[str, int]]] = {}
    for name, shape, setting, protected, linear in items:
        why = unstorable(shape, setting, protected, linear)
        if why is not None:
            problems.setdefault(why, []).append((name, shape[1]))
    if not problems:
        return
    why, hits = next(iter(problems.items()))
    more = f" (and {len(hits) - 1} more)" if len(hits) > 1 else ""
    hint = "use `fmt` dense"
    if "group size" in why:
        hint = f"use a `group_size` dividing every matrix's columns ({_fitting_groups(n for _, n in hits)}) or {hint}"
    elif "protected" in why:
        hint = f"protect no heads (`protect_top_k` 0, no `protect_heads`) or {hint}"
    raise CapsenseError(f"`fmt` compressed-tensors cannot store {hits[0][0]}{more}: {why}; {hint}")


def _scheme(bits: int, group: int | None):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    strategy = {"strategy": "channel"} if group is None else {"strategy": "group", "group_size": group}
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, **strategy)
    return QuantizationScheme(targets=[], weights=args, format=PACK_FORMAT)


def _packed_state(model: nn.Module, packed: Mapping[str, PackedWeight], dtype: torch.dtype) -> tuple[dict, dict]:
    """The checkpoint's tensors and the config groups ``{(bits, group or None): [module names]}``."""
    from compressed_tensors.compressors import BaseCompressor

    compressor = BaseCompressor.get_value_from_registry(PACK_FORMAT)
    cast: dict[tuple, torch.Tensor] = {}  # tied parameters stay one tensor (saved once)
    state = {k: cast.setdefault((v.data_ptr(), v.shape), v.detach().to(dtype)) for k, v in model.state_dict().items()}
    modules = dict(model.named_modules())
    groups: dict[tuple[int, int | None], list[str]] = {}
    for name, p in packed.items():
        w = modules[name].weight.detach().float().cpu()
        g = group_width(w.shape[1], p.group_size)
        key = (p.bits, None if g == w.shape[1] else g)
        scales = p.scales.float().cpu()
        # the weight is code * scale exactly (float32), so the library's rounding recovers the codes
        out = compressor.compress({"weight": w, "weight_scale": scales}, _scheme(*key))
        out["weight_scale"] = scales.to(dtype)
        del state[f"{name}.weight"]
        state.update({f"{name}.{k}": v for k, v in out.items()})
        groups.setdefault(key, []).append(name)
    return state, groups


def _quantization_config(groups: Mapping[tuple[int, int | None], list[str]]):
    from compressed_tensors.quantization import QuantizationConfig

    config_groups = {}
    for i, ((bits, group), names) in enumerate(sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0))):
        scheme = _scheme(bits, group)
        scheme.targets = sorted(names)
        config_groups[f"group_{i}"] = scheme
    return QuantizationConfig(config_groups=config_groups, format=PACK_FORMAT, quantization_status="compressed")


def write_packed(model: nn.Module, packed: Mapping[str, PackedWeight], dst: str | Path,
                 dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Save ``model`` to the existing folder ``dst``: ``packed`` matrices as pack-quantized codes, the
    rest at ``dtype``; returns what was written (format, dtype, config groups). Check first with
    :func:`check_storable`; the caller makes the folder atomic."""
    from compressed_tensors.compressors import ModelCompressor

    dst = Path(dst)
    state, groups = _packed_state(model, packed, dtype)
    with without_library_bars():
        model.save_pretrained(dst, state_dict=state, safe_serialization=True)
    qconfig = _quantization_config(groups)
    ModelCompressor(quantization_config=qconfig).update_config(str(dst))
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = str(dtype).removeprefix("torch.")  # what the unpacked tensors are stored in
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return {
        "format": "compressed-tensors",
        "compressed_tensors_format": PACK_FORMAT,
        "dtype": cfg["dtype"],
        "groups": [{"bits": b, "group_size": g or 0, "matrices": len(n)} for (b, g), n in sorted(groups.items(), key=str)],
    }


def size_on_disk(folder: str | Path) -> int:
    """Bytes of the weight files (``*.safetensors``) in ``folder``."""
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))

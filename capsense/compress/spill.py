"""Tensors of the model's size kept on disk, not in memory: what a guided run holds beside the model.

A guided run (:mod:`.guided`, :mod:`.select`) needs tensors as large as its target weights beside the
model: the Fisher diagonal (4 bytes per target weight, priced one matrix at a time), the original
target weights (put back before each candidate budget is compressed) and the chosen candidate's (put back
at the end). Held in memory, on Llama-3.1-8B in float32 that is 26 GiB for the Fisher and 52 GiB for the
two copies of the weights. A :class:`Spill` writes them once to a temporary folder (:mod:`tempfile`,
so ``$TMPDIR``: point it at a disk with room, not at a RAM disk), one safetensors file per group (a
decoder layer's matrices), and reads one tensor back at a time; the bytes read are the bytes written,
so every result is the in-memory one bit for bit. A tensor read back is a view of a private memory map
of its file: its pages count in the process's memory only while the tensor lives (measured: a 256 MiB
tensor read back costs nothing until touched and 256 MiB while it is used; freed with it).

Other ways, not taken: recompressing the chosen candidate at the end instead of keeping its weights
(exact too: same samples, same code path) costs a whole compression pass more whenever the chosen one is
not the last compressed (SmolLM2-135M sequential GPTQ: 50-60 s; an 8B model on CPU: hours) where writing
the target weights and reading them back costs a disk write and read of their size (SmolLM2's 405 MiB:
0.7-3.0 s to write, 0.06-2.0 s to read back into the weights); reading the original weights from the
checkpoint files the model was loaded from would save one write of their size, but needs every
architecture's key and dtype mapping checked bit for bit against the loaded weights first. The Fisher's
sums themselves stay in memory while its backward passes run (each pass adds to every target's sum;
adding on disk would write the model's size per text): the one tensor of the model's size a guided run
still holds. Summing it over one group of decoder layers per pass over the texts would divide that by
the number of groups at as many times the backward passes, exactly (measured: each layer's sums from
its own passes are ``torch.equal`` to the all-layer sums on tiny Llama, Gemma 3 and GPT-2): ``Guide.fisher_groups``
(``--fisher-groups``), 1 by default.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import groupby
from pathlib import Path

import torch


def check_disk(need: int, what: str, folder: str | None = None, instead: str = "") -> int:
    """Refuse, before any pass, a spill of ``need`` bytes that the temporary folder's disk cannot hold (a
    full disk would otherwise fail the run hours in, at its first write); ``need`` returned. ``instead``: what
    else would make it fit, appended to the message."""
    import shutil

    from capsense.errors import CapsenseError

    folder = folder or tempfile.gettempdir()
    free = shutil.disk_usage(folder).free
    if need > free:
        raise CapsenseError(f"{what} writes up to {need / 2**30:.2f} GiB ({need:,} bytes) to the temporary folder "
                            f"{folder!r}, whose disk has {free / 2**30:.2f} GiB ({free:,} bytes) free: point TMPDIR at "
                            f"a disk with room (not a RAM disk){instead}")
    return need


class Spill(Mapping[str, torch.Tensor]):
    """Named tensors in a temporary folder, removed by :meth:`close` or when the spill is garbage-collected
    (or the interpreter exits); read back by name (``spill[name]``), one tensor at a time."""

    def __init__(self, what: str = "tensors") -> None:
        self._dir = tempfile.TemporaryDirectory(prefix=f"capsense-{what}-")
        self._file: dict[str, Path] = {}

    def write(self, group: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write ``tensors`` as one file (replacing the ``group`` written before, if any)."""
        from safetensors.torch import save_file

        path = Path(self._dir.name) / f"{group}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, path)  # a new file: a tensor still mapped from the one it replaces stays valid
        self._file.update(dict.fromkeys(tensors, path))

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self._file[name]), framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file)

    def __len__(self) -> int:
        return len(self._file)

    @property
    def nbytes(self) -> int:
        """Bytes on disk."""
        return sum(p.stat().st_size for p in set(self._file.values()))

    def close(self) -> None:
        self._dir.cleanup()
        self._file.clear()

    def __enter__(self) -> Spill:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def by_layer(targets) -> Iterator[tuple[int, list]]:
    """``targets`` grouped by decoder layer (they come in layer order: :func:`~capsense.compress.targets.find_targets`)."""
    for layer, group in groupby(targets, key=lambda t: t.layer):
        yield layer, list(group)


def spill_weights(targets, spill: Spill) -> Spill:
    """Write every target's current weight (``[out, in]``, the model's dtype) into ``spill``, one file per
    layer (replacing those written before): what :func:`~capsense.compress.targets.restore` puts back."""
    for layer, group in by_layer(targets):
        spill.write(f"layer{layer}", {t.name: t.get() for t in group})
    return spill


def layer_groups(targets, groups: int) -> list[list]:
    """``targets`` in ``groups`` runs of whole consecutive decoder layers, as even in layer count as they go
    (fewer when there are fewer layers)."""
    layers = [group for _, group in by_layer(targets)]
    n = min(max(groups, 1), len(layers))
    bounds = [round(i * len(layers) / n) for i in range(n + 1)]
    return [[t for group in layers[a:b] for t in group] for a, b in zip(bounds, bounds[1:])]


def file_bytes(tensors: Iterable[tuple[str, Sequence[int], torch.dtype]], block: int = 1) -> int:
    """Bytes of the file :meth:`Spill.write` makes of ``tensors`` (name, shape, dtype; one dtype per file, as
    :func:`spill_weights` and :func:`spill_fisher` write them), rounded up to a multiple of ``block`` (the disk's
    block: what the file takes of its free space). safetensors' layout: an 8-byte length, the JSON header
    (compact, the tensors in name order with their byte offsets) padded with spaces to a multiple of 8, the data."""
    import json

    from safetensors.torch import _TYPES

    names = {v: k for k, v in _TYPES.items()}
    header, offset = {}, 0
    for name, shape, dtype in sorted(tensors, key=lambda x: x[0]):
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    n = len(json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode())
    return -(-(8 + -(-n // 8) * 8 + offset) // block) * block


def layer_files(targets, dtype: torch.dtype | None = None, block: int = 1) -> list[int]:
    """Bytes of each layer's file (:func:`file_bytes`) that :func:`spill_weights` (``dtype`` None: the weights'
    own) or :func:`spill_fisher` (float32) writes of ``targets``."""
    return [file_bytes([(t.name, t.shape, dtype or t.module.weight.dtype) for t in group], block)
            for _, group in by_layer(targets)]


def spill_fisher(targets, fisher: dict[str, torch.Tensor], spill: Spill) -> Spill:
    """``fisher`` (one tensor per target, emptied as it is written) moved into ``spill``, a file per layer."""
    for layer, group in by_layer(targets):
        spill.write(f"layer{layer}", {t.name: fisher.pop(t.name) for t in group})
    return spill


class Lazy(Mapping[str, torch.Tensor]):
    """A tensor per name made when read (``make(name)``), not held: a sum of spilled Fishers, a Fisher of ones."""

    def __init__(self, names: Iterable[str], make: Callable[[str], torch.Tensor]) -> None:
        self._names, self._make = dict.fromkeys(names), make

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._make(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

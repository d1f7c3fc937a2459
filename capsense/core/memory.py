"""CPU memory a run holds: what its tensors take at most, and giving freed heap pages back to the system.

Two things the guided run's memory check (:mod:`capsense.compress.guided_sequential`) rests on, measured in round 20
(recipes/results/RESULTS-compress.md):

* **Freed is not returned.** glibc's allocator serves blocks below its mmap threshold from the heap, and that
  threshold rises to 32 MiB as soon as a larger block is freed; a freed heap block is kept for reuse, and a
  heap fragmented by small long-lived blocks (a cached price, a Python object) between freed large ones cannot
  shrink. On a guided SmolLM2-width run the resident memory grew by 45-70 MiB per decoder layer priced while the
  live tensors stayed flat, and fell back only when something happened to free the heap's top.
  :func:`return_freed_memory` (``malloc_trim``) hands those pages back; the loops whose steps free large
  temporaries (each Fisher text, each matrix priced or compressed) call it once per step. A fixed mmap
  threshold (``mallopt``) does the same without the calls but took 25-50% more CPU in GPTQ's column loop (a page
  fault per page of every per-column temporary), so it is not used.
* **What the tensors take at most.** :class:`TensorPeak` follows every tensor storage allocated inside a block
  (through torch's dispatcher: every aten operator's outputs) until it is freed: the most bytes live at once,
  allocator slack excluded. It measures what the check counts, without the noise of resident memory.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@functools.cache
def _malloc_trim() -> Any:
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to call
        return None


def return_freed_memory() -> bool:
    """Give the heap pages that freed blocks left back to the system (glibc's ``malloc_trim(0)``; a few ms):
    without it a process's resident memory keeps what its freed tensors took (module docstring). Whether the C
    library has the call (False: a no-op)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class TensorPeak(TorchDispatchMode):
    """``with TensorPeak() as p: ...``: ``p.peak``, the most bytes of tensor storage allocated inside the block
    live at once (storages that existed before it are not counted; a view counts its storage once); ``p.live``,
    those still live. CPU tensors made by aten operators (factories, results, copies), which is every tensor of
    the compression code; not memory a library allocates outside torch."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._seen and storage.nbytes():
                    if not _made_here(args, kwargs, storage):
                        continue
                    self._seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out


def _made_here(args, kwargs, storage) -> bool:
    """Whether ``storage`` is new, not an input's (an in-place or view operator returns its input's storage)."""
    ptr = storage.data_ptr()
    return not any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == ptr
                   for a in tree_leaves((args, kwargs or {})))

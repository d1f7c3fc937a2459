"""capsense.core.memory: the tensor-bytes peak of a block, and handing freed heap pages back."""

from __future__ import annotations

import torch

from capsense.core.memory import TensorPeak, return_freed_memory


def test_the_peak_counts_each_new_storage_once_until_it_is_freed():
    before = torch.ones(1000)  # existed before the block: not counted, nor what in-place ops and views return
    with TensorPeak() as p:
        a = torch.zeros(1000, 250)  # 1,000,000 bytes
        b = a * 2  # 2,000,000 at once
        del a
        c = b + 1  # 2,000,000 again
        c.add_(1)
        view = c[10:]
        before.mul_(2)
        _ = before[3:]
    assert p.peak == 2_000_000 and p.live == 2_000_000
    del b, c, view
    assert p.live == 0


def test_freed_memory_is_handed_back_on_this_c_library():
    """glibc (Linux CI): ``malloc_trim`` is there and called; elsewhere a no-op that says so."""
    import platform

    assert return_freed_memory() is (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")

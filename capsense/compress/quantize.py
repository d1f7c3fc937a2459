"""Symmetric round-to-nearest (RTN) weight quantization, per output channel or per group.

Each group (``group_size`` consecutive input columns of one output row, or the whole row
when ``group_size`` is 0) gets one scale ``s = max|w| / q_max`` with ``q_max = 2^(B-1) - 1``;
weights become ``s * clamp(round(w / s), -q_max, q_max)``. That uses ``2^B - 1 <= 2^B``
levels, never clips (``max|w|`` maps to ``q_max`` exactly) and so errs by at most ``s / 2``.
The result is fake-quantized: dequantized values stored in the model's dtype.
"""

from __future__ import annotations

import torch

from capsense.errors import CapsenseError

SCALE_BITS = 16  # one fp16 scale per group


def check_bits(bits: int) -> int:
    b = int(bits)
    if b != bits or b < 2 or b > 16:
        raise CapsenseError(f"bits {bits} is not supported: RTN needs an integer bit width from 2 to 16")
    return b


def check_group_size(group_size: int) -> int:
    g = int(group_size)
    if g != group_size or g < 0:
        raise CapsenseError(f"group size {group_size} must be a non-negative integer (0 = one group per output row)")
    return g


def rtn_quantize(weight: torch.Tensor, bits: int, group_size: int = 128) -> torch.Tensor:
    """Fake-quantize an ``[out, in]`` weight; a trailing partial group gets its own scale."""
    bits, group_size = check_bits(bits), check_group_size(group_size)
    w = weight.detach().float()
    n_out, n_in = w.shape
    g = n_in if group_size == 0 else min(group_size, n_in)
    pad = (-n_in) % g
    wp = torch.nn.functional.pad(w, (0, pad)).view(n_out, -1, g)
    q_max = 2 ** (bits - 1) - 1
    scale = wp.abs().amax(dim=2, keepdim=True) / q_max
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(wp / scale), -q_max, q_max)
    return (q * scale).view(n_out, -1)[:, :n_in].to(weight.dtype)


def n_groups(shape: tuple[int, int], group_size: int) -> int:
    """Number of scales RTN stores for a matrix of ``shape`` = ``(out, in)``."""
    n_out, n_in = shape
    if n_in == 0:
        return 0
    g = n_in if group_size == 0 else min(group_size, n_in)
    return n_out * -(-n_in // g)


def rtn_bits(shape: tuple[int, int], bits: int, group_size: int) -> int:
    """Exact storage of one RTN matrix in bits: codes plus one fp16 scale per group."""
    return shape[0] * shape[1] * bits + n_groups(shape, group_size) * SCALE_BITS

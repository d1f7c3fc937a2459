"""Symmetric round-to-nearest (RTN) weight quantization, per output channel or per group.

Each group (``group_size`` consecutive input columns of one output row, or the whole row
when ``group_size`` is 0) gets one scale ``s = max|w| / q_max`` with ``q_max = 2^(B-1) - 1``;
weights become ``s * clamp(round(w / s), -q_max, q_max)``. That uses ``2^B - 1 <= 2^B``
levels, never clips (``max|w|`` maps to ``q_max`` exactly) and so errs by at most ``s / 2``.
The result is fake-quantized: dequantized values stored in the model's dtype.

For bit widths up to 8 (the ones a packed checkpoint stores) each scale is rounded to a value
bfloat16 holds exactly (8 significant bits, rounding the scale by at most 2^-9 of itself), so
``code * scale`` is also what a compressed-tensors checkpoint with 16-bit scales dequantizes to,
in bfloat16 or float32 alike: the model in memory and the one reloaded from disk agree exactly.
Wider codes keep float32 scales (an 8-bit scale would move ``max|w|`` off its code).
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


PACKED_MAX_BITS = 8  # the widest code a packed (compressed-tensors) checkpoint stores


def group_width(n_in: int, group_size: int) -> int:
    """Columns per scale: ``group_size`` (capped at ``n_in``), or the whole row for 0."""
    return n_in if group_size == 0 else min(group_size, n_in)


def storable_scale(scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Positive scales (zeros become 1), bfloat16-exact for ``bits <= 8``; float32."""
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).float()
    return scale.to(torch.bfloat16).float() if bits <= PACKED_MAX_BITS else scale


def group_scales(weight: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """RTN's scales of an ``[out, in]`` weight, ``[out, groups]``: ``max|w| / q_max`` per group."""
    w = weight.detach().float()
    n_out, n_in = w.shape
    g = group_width(n_in, group_size)
    wp = torch.nn.functional.pad(w.abs(), (0, (-n_in) % g)).view(n_out, -1, g)
    return storable_scale(wp.amax(dim=2) / (2 ** (bits - 1) - 1), bits)


def quantize_with_scales(weight: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """``scale * clamp(round(w / scale), -q_max, q_max)`` with one scale per group (float32)."""
    w = weight.detach().float()
    g = group_width(w.shape[1], group_size)
    s = scales.float().repeat_interleave(g, dim=1)[:, : w.shape[1]]
    q_max = 2 ** (bits - 1) - 1
    return torch.clamp(torch.round(w / s), -q_max, q_max) * s


def rtn_quantize(weight: torch.Tensor, bits: int, group_size: int = 128) -> torch.Tensor:
    """Fake-quantize an ``[out, in]`` weight; a trailing partial group gets its own scale."""
    return rtn_quantize_scaled(weight, bits, group_size)[0]


def rtn_quantize_scaled(weight: torch.Tensor, bits: int, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The fake-quantized weight (in ``weight``'s dtype) and its ``[out, groups]`` scales."""
    bits, group_size = check_bits(bits), check_group_size(group_size)
    scales = group_scales(weight, bits, group_size)
    return quantize_with_scales(weight, scales, bits, group_size).to(weight.dtype), scales


def n_groups(shape: tuple[int, int], group_size: int) -> int:
    """Number of scales RTN stores for a matrix of ``shape`` = ``(out, in)``."""
    n_out, n_in = shape
    if n_in == 0:
        return 0
    return n_out * -(-n_in // group_width(n_in, group_size))


def rtn_bits(shape: tuple[int, int], bits: int, group_size: int) -> int:
    """Exact storage of one RTN matrix in bits: codes plus one fp16 scale per group."""
    return shape[0] * shape[1] * bits + n_groups(shape, group_size) * SCALE_BITS

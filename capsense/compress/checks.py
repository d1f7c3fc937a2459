"""Argument checks shared by the compression methods."""

from __future__ import annotations

from capsense.errors import CapsenseError


def unit_fraction(value: float, name: str, meaning: str) -> float:
    """``value`` as a float in (0, 1], else a :class:`CapsenseError` naming ``name`` and what it means."""
    v = float(value)
    if not 0.0 < v <= 1.0:
        raise CapsenseError(f"{name} {value} is outside (0, 1]: {meaning}")
    return v

"""Argument checks shared by the compression methods."""

from __future__ import annotations


def unit_fraction(value: float, name: str, meaning: str) -> float:
    """``value`` as a float in (0, 1], else a ValueError naming ``name`` and what it means."""
    v = float(value)
    if not 0.0 < v <= 1.0:
        raise ValueError(f"{name} {value} is outside (0, 1]: {meaning}")
    return v

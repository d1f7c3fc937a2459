"""Argument checks shared by the compression methods."""

from __future__ import annotations

from capsense.errors import CapsenseError


class BudgetError(CapsenseError):
    """A compression request that cannot be used as given: a setting, a budget file, target kinds
    or heads to protect. One class (the names ``TargetError`` and ``ProtectionError`` are kept as
    aliases): no caller ever told them apart, they only converted one into another."""


def unit_fraction(value: float, name: str, meaning: str) -> float:
    """``value`` as a float in (0, 1], else a :class:`CapsenseError` naming ``name`` and what it means."""
    v = float(value)
    if not 0.0 < v <= 1.0:
        raise CapsenseError(f"{name} {value} is outside (0, 1]: {meaning}")
    return v

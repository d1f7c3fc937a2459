"""Numbers for people: relative changes and markdown tables, one implementation of each."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any


def relative_change(base: float | None, value: float | None) -> float | None:
    """``(value - base) / |base|``; None when it is undefined (a missing value, a zero or NaN base)."""
    if base is None or value is None or not base or math.isnan(base) or math.isnan(value):
        return None
    return (value - base) / abs(base)


def format_percent(x: float | None, digits: int = 1) -> str:
    """``+12.3%`` for 0.123; ``-`` for None."""
    return "-" if x is None else f"{100 * x:+.{digits}f}%"


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A GitHub-flavoured markdown table of ``rows`` (numeric columns right-aligned, floats to 4 significant digits).

    ``columns`` defaults to every key in order of first appearance; a missing or None cell shows ``—``.
    """
    if not rows:
        return ""
    if columns is None:
        columns = []
        for r in rows:
            columns += [k for k in r if k not in columns]

    def cell(v: Any) -> str:
        if v is None:
            return "—"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v).replace("|", "\\|").replace("\n", " ")

    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in rows) for c in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)

"""The validation chart: per task, the relative change under the top-K heads' ablation
beside random K-head ablations (``validation.png``, written by :mod:`capsense.evaluation.validate`).

Plots use matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def validation_chart(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    """Bars per task: relative change of top-K ablation and of random-K ablations (mean +- sd)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['task']}\n{r['metric']}" for r in rows]
    x = np.arange(len(rows))
    top = [100 * (r["change_rel"] or 0) for r in rows]
    rnd = [100 * (r.get("random_change_rel_mean") or 0) for r in rows]
    err = [100 * (r.get("random_change_rel_sd") or 0) for r in rows]
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(rows) + 2), 4))
    ax.bar(x - 0.2, top, 0.4, label="top-K heads ablated")
    if any(r.get("random_change_rel_mean") is not None for r in rows):
        ax.bar(x + 0.2, rnd, 0.4, yerr=err, capsize=3, label="random K heads (mean, sd)")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("change vs base (%)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

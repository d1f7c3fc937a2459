"""How closely each loss follows a multiple-choice target's accuracy over a locate run's evaluations.

    python recipes/bench/loss_vs_accuracy.py RUN [RUN ...] [--out recipes/results/loss_vs_accuracy.md]

For each run folder (``manifest.json`` and ``evaluations.jsonl``), over every evaluation the run made (the clean
model, single heads, groups, the sets measure-and-choose measured) the Spearman correlation between the target's
accuracy fall (clean accuracy minus accuracy) and each loss its probe recorded: ``nll`` (the gold choice's
nats/token) and, for a multiple-choice target, ``choice_nll`` (the gold choice's nats under the softmax over its
document's choices). Round 28 (RESULTS-locate.md) quotes it for three SmolLM2 runs: a loss that ranks knockouts as
their accuracy falls is one a search can follow.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from capsense.localize.store import read_evaluations

LOSSES = ("nll", "choice_nll")


def agreement(run: Path) -> dict:
    """One run's row: its target, its search's metric, the evaluations read, and per loss the Spearman
    correlation with the accuracy fall (None where the probe has no such loss or nothing varies)."""
    from scipy.stats import spearmanr

    manifest = json.loads((run / "manifest.json").read_text())
    task = manifest["task"]
    scores = [e.scores[task] for e in read_evaluations(run) if task in e.scores]
    fall = np.array([scores[0]["acc"] - s["acc"] for s in scores])
    row = {"run": str(run), "task": task, "metric": manifest["metric"], "evaluations": len(scores)}
    for loss in LOSSES:
        values = np.array([s.get(loss, np.nan) for s in scores])
        varies = np.isfinite(values).all() and np.ptp(values) > 0 and np.ptp(fall) > 0
        row[loss] = round(float(spearmanr(fall, values).statistic), 3) if varies else None
    return row


def table(rows: list[dict]) -> str:
    """The markdown table of :func:`agreement` rows."""
    lines = ["| run | target | searched by | evaluations | Spearman(accuracy fall, nll) | Spearman(accuracy fall, choice_nll) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        cells = ["n/a" if r[loss] is None else f"{r[loss]:.2f}" for loss in LOSSES]
        lines.append(f"| {r['run']} | {r['task']} | {r['metric']} | {r['evaluations']} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="locate run folders")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here (atomically)")
    args = ap.parse_args(argv)
    rows = [agreement(r) for r in args.runs]
    text = table(rows)
    print(text, end="")
    if args.out is not None:
        from capsense.core.files import atomic_write_text

        atomic_write_text(args.out, text)
    return rows


if __name__ == "__main__":
    main()

"""Record exhaustive single-head sweeps (run folders) as a committed reference for tests and benchmarks.

    python recipes/bench/record_sweeps.py /work/runs/sweep-capsense_induction [...] \\
        --out recipes/results/locate_smollm2_sweeps.json

Each sweep: ``capsense locate smollm2-135m --task T --method exhaustive --limit 24 --dtype float32``.
Per task: the clean nll, every head's measured effect (relative nll worsening when knocked out
alone), the top 5 and the hit threshold (within 5% of the fifth-largest effect).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from capsense.core.heads import Head
from capsense.localize.store import read_evaluations

HIT_MARGIN = 0.05


def record(folder: Path) -> tuple[str, dict]:
    manifest = json.loads((folder / "manifest.json").read_text())
    task, n_heads = manifest["task"], manifest["layout"]["n_heads"]
    evals = read_evaluations(folder)
    v = np.array([e.scores[task]["nll"] for e in evals])
    eff = {e.heads[0]: float((x - v[0]) / v[0]) for e, x in zip(evals[1:], v[1:]) if len(e.heads) == 1}
    n = manifest["layout"]["n_layers"] * n_heads
    if len(eff) != n:
        raise SystemExit(f"{folder}: {len(eff)} of {n} heads measured; the sweep is not finished")
    order = sorted(eff, key=lambda h: -eff[h])
    fifth = eff[order[4]]
    return task, {
        "model": "smollm2-135m", "limit": manifest["args"]["limit"], "seed": manifest["args"]["seed"],
        "dtype": manifest["args"].get("dtype_resolved"), "clean_nll": round(float(v[0]), 6),
        "clean_acc": evals[0].scores[task]["acc"],
        "top5": [str(Head.from_index(h, n_heads)) for h in order[:5]],
        "hit_threshold": round(fifth - HIT_MARGIN * abs(fifth), 6),
        "effects": {str(Head.from_index(h, n_heads)): round(eff[h], 6) for h in range(n)},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path("recipes/results/locate_smollm2_sweeps.json"))
    args = ap.parse_args()
    data = json.loads(args.out.read_text()) if args.out.is_file() else {}
    for f in args.folders:
        task, rec = record(f)
        data[task] = rec
        print(task, rec["top5"], rec["hit_threshold"])
    args.out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()

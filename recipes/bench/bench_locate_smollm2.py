"""SmolLM2-135M, induction: masks needed by compressed sensing to recover the exhaustive top 5.

    HF_HUB_OFFLINE=1 python recipes/bench_locate_smollm2.py --root runs/bench-smollm2 [--limit 24] [--masks 150]

Runs (or resumes) two locate runs with the library:

* ``<root>/exhaustive``: every one of the 270 heads knocked out alone (prefix reuse);
* ``<root>/cs``: 150 balanced masks at sparsity 0.02 scored on capsense_induction plus the
  controls capsense_prose and capsense_arithmetic;

then refits every solver on the first M masks (M = 30 ... 150; the design is
prefix-stable, so these are exactly the runs with M masks) on the raw target score and on
the selective (residualized) score, and reports the overlap of each top 5 with the
exhaustive top 5 (raw). Writes ``<root>/recovery.json`` and prints markdown.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from capsense.localize.config import LocateConfig
from capsense.localize.fit import design_matrix, fit_target, single_head_scores
from capsense.localize.run import locate
from capsense.localize.solvers import SOLVERS, make_solver
from capsense.localize.store import read_evaluations

TASK = "capsense_induction"
CONTROLS = ["capsense_prose", "capsense_arithmetic"]
PREFIXES = (30, 50, 75, 100, 125, 150)



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="runs/bench-smollm2")
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--masks", type=int, default=150)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--skip-run", action="store_true", help="Only analyse what the run folders hold.")
    args = ap.parse_args()
    root = Path(args.root)
    ex_cfg = LocateConfig(model="smollm2-135m", task=TASK, out=str(root / "exhaustive"), method="exhaustive",
                          limit=args.limit, dtype=args.dtype, progress=True)
    cs_cfg = LocateConfig(model="smollm2-135m", task=TASK, out=str(root / "cs"), method="cs", controls=CONTROLS, masks=args.masks,
                          limit=args.limit, dtype=args.dtype, progress=True)
    if not args.skip_run:
        locate(ex_cfg)
        locate(cs_cfg)
    n_heads, n = 9, 270
    ex = read_evaluations(root / "exhaustive")
    imp, _ = single_head_scores(ex, fit_target(ex, ex_cfg, n), n)
    ex_top = [int(i) for i in np.argsort(-imp, kind="stable")[:5]]
    cs = read_evaluations(root / "cs", design_only=True)
    name = lambda i: f"L{i // n_heads}H{i % n_heads}"  # noqa: E731
    rows = []
    for m in PREFIXES:
        if len(cs) < m + 1:
            break
        ev = cs[: m + 1]
        X = design_matrix(ev, n)
        for solver in SOLVERS:
            for selective in (False, True):
                y = fit_target(ev, cs_cfg, n, selective=selective)
                top = make_solver(solver, seed=0, confidence=False).fit(X, y).scores_.top(5)
                rows.append({"masks": m, "solver": solver, "selective": selective, "top5": [name(i) for i in top],
                             "overlap_with_exhaustive": len(set(top) & set(ex_top))})
                print(rows[-1], flush=True)
    out = {"exhaustive_top5": [name(i) for i in ex_top], "limit": args.limit, "rows": rows,
           "seconds_per_mask": {"exhaustive": float(np.mean([e.seconds for e in ex[1:]])),
                                "cs_3_tasks": float(np.mean([e.seconds for e in cs[1:]]))}}
    (root / "recovery.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nexhaustive top 5 (raw induction nll): {', '.join(out['exhaustive_top5'])}")
    ms = sorted({r["masks"] for r in rows})
    print("| solver | score | " + " | ".join(f"{m} masks" for m in ms) + " |")
    print("|---|---|" + "---|" * len(ms))
    for solver in SOLVERS:
        for sel in (False, True):
            cells = [r for r in rows if r["solver"] == solver and r["selective"] == sel]
            print(f"| {solver} | {'selective' if sel else 'raw'} | " + " | ".join(f"{r['overlap_with_exhaustive']}/5" for r in cells) + " |")


if __name__ == "__main__":
    main()

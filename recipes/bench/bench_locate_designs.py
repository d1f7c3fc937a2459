"""SmolLM2-135M, induction: masks each design, density and solver needs to recover the exhaustive top 5.

    HF_HUB_OFFLINE=1 python recipes/bench/bench_locate_designs.py --root runs/bench-smollm2 [--masks 75]

Needs ``<root>/exhaustive`` (the 270-head sweep of ``bench_locate_smollm2.py``; the balanced
5-head design is that script's cs run). Runs (or resumes) raw-score locate runs on
capsense_induction alone (no controls, 24 documents): Bernoulli and adaptive designs at 5
heads per mask (the paper's 2%) and balanced at 13 (5%) and 27 (10%) heads per mask. Every
design is prefix-stable, so the first M masks of a run are the M-mask run: each solver is
refitted on M = 25, 50, 75 (up to --masks) masks and its top 5 compared with the sweep's.
Writes ``<root>/designs.json`` and prints markdown.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from capsense.localize.config import LocateConfig
from capsense.localize.fit import design_matrix, fit_target, single_head_scores
from capsense.localize.run import locate
from capsense.localize.solvers import SOLVERS, make_solver
from capsense.localize.store import read_evaluations

TASK = "capsense_induction"
CONFIGS = [("bernoulli", 5), ("adaptive", 5), ("balanced", 13), ("balanced", 27)]
PREFIXES = (25, 50, 75, 100, 150)



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="runs/bench-smollm2")
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--masks", type=int, default=75)
    ap.add_argument("--skip-run", action="store_true", help="Only analyse what the run folders hold.")
    args = ap.parse_args()
    root = Path(args.root)
    n = 270
    ex_cfg = LocateConfig(model="smollm2-135m", task=TASK, out=str(root / "exhaustive"), method="exhaustive",
                          limit=args.limit, dtype="float32")
    ex = read_evaluations(root / "exhaustive")
    imp, _ = single_head_scores(ex, fit_target(ex, ex_cfg, n), n)
    ex_top = set(int(i) for i in np.argsort(-imp, kind="stable")[:5])
    rows, timing = [], {}
    for design, k in CONFIGS:
        cfg = LocateConfig(model="smollm2-135m", task=TASK, out=str(root / f"raw-{design}-k{k}"), method="cs", masks=args.masks,
                           heads_per_mask=k, sparsity=None, design=design, limit=args.limit, dtype="float32",
                           refine=0, progress=True)
        if not args.skip_run:
            t0 = time.perf_counter()
            locate(cfg, log=lambda m: None)
            timing[f"{design}-k{k}"] = time.perf_counter() - t0
        evals = read_evaluations(cfg.out)
        for m in PREFIXES:
            if len(evals) < m + 1:
                break
            ev = evals[: m + 1]
            X, y = design_matrix(ev, n), fit_target(ev, cfg, n)
            for solver in SOLVERS:
                top = make_solver(solver, seed=0, confidence=False).fit(X, y).scores_.top(5)
                rows.append({"design": design, "k": k, "masks": m, "solver": solver,
                             "overlap": len(set(top) & ex_top)})
        print(design, k, [(r["masks"], r["solver"], r["overlap"]) for r in rows if r["design"] == design and r["k"] == k],
              flush=True)
    (root / "designs.json").write_text(json.dumps({"rows": rows, "wall_s": timing, "limit": args.limit}, indent=1) + "\n")
    ms = sorted({r["masks"] for r in rows})
    print("| design | heads per mask | solver | " + " | ".join(f"{m} masks" for m in ms) + " |")
    print("|---|---|---|" + "---|" * len(ms))
    for design, k in CONFIGS:
        for solver in SOLVERS:
            cells = {r["masks"]: r["overlap"] for r in rows if (r["design"], r["k"], r["solver"]) == (design, k, solver)}
            print(f"| {design} | {k} | {solver} | " + " | ".join(f"{cells[m]}/5" if m in cells else "" for m in ms) + " |")


if __name__ == "__main__":
    main()

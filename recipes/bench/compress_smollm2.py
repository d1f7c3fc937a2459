"""The compression study on SmolLM2-135M-Instruct: grid, fits, selection, report.

    HF_HUB_OFFLINE=1 python recipes/bench/compress_smollm2.py [--probes 64] [--out recipes/results/compress]

Runs (or resumes) the grid of recipes/compress_smollm2_grid.yaml, fits the compact pruning
relation against the per-density regression, the stable-rank predictor and the bits
predictor, selects a setting under several size budgets, and writes report.md, fits.json
and the plots next to the grid file. Equivalent CLI:

    capsense grid --spec recipes/compress_smollm2_grid.yaml --probes N --out OUT/smollm2_grid_pN.jsonl
    capsense fit OUT/smollm2_grid_pN.jsonl --report OUT/report_pN
    capsense select OUT/smollm2_grid_pN.jsonl --max-size 0.6
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from capsense.compress.study.fits import fit_grid
from capsense.compress.study.grid import read_records, run_grid
from capsense.compress.study.grid_spec import load_spec
from capsense.compress.study.report import write_report
from capsense.compress.study.select import regret_curve, regret_summary

HERE = Path(__file__).resolve().parents[1]  # recipes/
BUDGETS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.35)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probes", type=int, default=64)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "compress")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-run", action="store_true", help="Only fit and report an existing grid file.")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    grid_file = args.out / f"smollm2_grid_p{args.probes}.jsonl"
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.no_run:
        run_grid(load_spec(HERE / "compress_smollm2_grid.yaml", {"probes": args.probes}), grid_file, log=print)
    records = read_records(grid_file)
    fits = fit_grid(records)
    curve = regret_curve(records, fits, BUDGETS)
    report = write_report(records, fits, args.out / f"report_p{args.probes}", selections=curve,
                          title=f"SmolLM2-135M-Instruct compression study ({args.probes} probes per capability)")
    summary = {
        "pruning": {m: {k: v for k, v in e.items() if k != "capabilities"} for m, e in fits["pruning"].items()},
        "lowrank_loo_pearson": {k: g.get("loo_pearson") for k, g in fits["lowrank"]["groups"].items()},
        "lowrank_acc_loo_pearson": {k: g.get("loo_pearson") for k, g in fits["lowrank_acc"]["groups"].items()},
        "selection": curve, **regret_summary(curve),
    }
    (args.out / f"summary_p{args.probes}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"report: {report}")


if __name__ == "__main__":
    main()

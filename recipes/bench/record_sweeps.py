"""Record exhaustive single-head sweeps (run folders) as a committed reference for tests and benchmarks.

    python recipes/bench/record_sweeps.py runs/bench-recovery-gemma3/sweep-capsense_induction [...] \\
        [--out recipes/results/locate_gemma3_sweeps.json]

Each sweep: ``--method exhaustive --limit 24 --dtype float32``, no controls (the sweep stage of
``bench_locate_recovery.py --model <model>`` runs it and calls this). Per task: the model, its
layout, the clean nll, every head's measured effect (relative nll worsening when knocked out
alone), the top 5, the hit threshold (within 5% of the fifth-largest effect), the scorer's
prefix-reuse share and the sweep's forward-equivalents. ``--out`` defaults to
``recipes/results/locate_<tag>_sweeps.json`` for the model of the first folder.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from capsense.core.files import atomic_write_text
from capsense.core.heads import Head
from capsense.localize.store import read_evaluations
from capsense.scoring.cost import mask_cost

HIT_MARGIN = 0.05


def record(folder: Path) -> tuple[str, dict]:
    manifest = json.loads((folder / "manifest.json").read_text())
    task, n_heads, n_layers = manifest["task"], manifest["layout"]["n_heads"], manifest["layout"]["n_layers"]
    evals = read_evaluations(folder)
    v = np.array([e.scores[task]["nll"] for e in evals])
    eff = {e.heads[0]: float((x - v[0]) / v[0]) for e, x in zip(evals[1:], v[1:]) if len(e.heads) == 1}
    if len(eff) != n_layers * n_heads:
        raise SystemExit(f"{folder}: {len(eff)} of {n_layers * n_heads} heads measured; the sweep is not finished")
    return task, sweep_record(
        model=manifest["model"]["model"], n_layers=n_layers, n_heads=n_heads,
        share=float(manifest.get("cost_model", {}).get("reuse_share", 1.0)), limit=manifest["args"]["limit"],
        seed=manifest["args"]["seed"], dtype=manifest["args"].get("dtype_resolved"), clean_nll=float(v[0]),
        clean_acc=evals[0].scores[task]["acc"], eff=eff, ablation=manifest["args"].get("ablation") or "zero")


def sweep_record(*, model: str, n_layers: int, n_heads: int, share: float, limit, seed, dtype, clean_nll: float,
                 clean_acc: float, eff: dict[int, float], ablation: str = "zero") -> dict:
    """One task's entry of a sweeps json from every head's relative nll worsening ``eff`` (flat index ->
    effect); also used by ``record_perdoc_sweep.py``. ``ablation`` is written where it is not zero (the
    entries recorded before round 34 are zero ablation's)."""
    n = n_layers * n_heads
    order = sorted(eff, key=lambda h: -eff[h])
    fifth = eff[order[4]]
    return {
        "model": model, "n_layers": n_layers, "n_heads": n_heads, "reuse_share": share,
        "forward_equivalents": round(1 + sum(mask_cost([h], n_layers, n_heads, share) for h in range(n)), 2),
        "limit": limit, "seed": seed, "dtype": dtype, "clean_nll": round(clean_nll, 6), "clean_acc": clean_acc,
        "top5": [str(Head.from_index(h, n_heads)) for h in order[:5]],
        "hit_threshold": round(fifth - HIT_MARGIN * abs(fifth), 6),
        "effects": {str(Head.from_index(h, n_heads)): round(float(eff[h]), 6) for h in range(n)},
        **({} if ablation == "zero" else {"ablation": ablation}),
    }


def fold(out: Path, records: dict[str, dict]) -> None:
    """Write ``records`` (task -> entry) into the sweeps json ``out``, refusing another model's file."""
    data = json.loads(out.read_text()) if out.is_file() else {}
    for task, rec in records.items():
        if data and any(r.get("model", rec["model"]) != rec["model"] for r in data.values()):
            raise SystemExit(f"{out} holds sweeps of another model than {rec['model']}; give --out")
        data[task] = rec
        print(task, rec["top5"], rec["hit_threshold"])
    atomic_write_text(out, json.dumps(data, indent=1, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    records = [record(f) for f in args.folders]
    models = {rec["model"] for _, rec in records}
    if len(models) > 1:
        raise SystemExit(f"the folders are sweeps of different models ({', '.join(sorted(models))}); record each model apart")
    out = args.out or Path("recipes/results") / f"locate_{Path(models.pop()).name.split('-')[0].lower()}_sweeps.json"
    fold(out, dict(records))


if __name__ == "__main__":
    main()

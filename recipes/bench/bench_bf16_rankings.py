"""Does bfloat16 change which heads a sweep ranks on top? Exhaustive sweeps in bf16 against the
recorded float32 sweep of the same task and documents.

    # the sweeps (one per setting; the same task, --limit and seed as the float32 reference)
    capsense locate smollm2-135m --task capsense_induction --method exhaustive --limit 24 \\
        --dtype bfloat16 --controls none --out runs/bf16/<label>
    python recipes/bench/bench_bf16_rankings.py runs/bf16/<label> [...] \\
        [--reference recipes/results/locate_smollm2_sweeps.json] [--out recipes/results/locate_bf16_rankings]

Per sweep: the clean nll's difference from float32, the per-head effect differences (median and
largest |delta| in percentage points of relative nll worsening), Spearman over every head, and
the overlap of its top 5 with float32's (a head within 5% of float32's fifth-largest effect is a
hit, as in the recovery table). Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from capsense.core.heads import Head
from capsense.core.tables import markdown_table
from capsense.localize.store import read_evaluations


def sweep_effects(folder: Path) -> tuple[str, float, dict[str, float]]:
    """(task, clean nll, head name -> relative nll worsening) of an exhaustive run folder."""
    manifest = json.loads((folder / "manifest.json").read_text())
    task, n_heads = manifest["task"], manifest["layout"]["n_heads"]
    evals = read_evaluations(folder)
    v = np.array([e.scores[task]["nll"] for e in evals])
    eff = {str(Head.from_index(e.heads[0], n_heads)): float((x - v[0]) / v[0])
           for e, x in zip(evals[1:], v[1:]) if len(e.heads) == 1}
    return task, float(v[0]), eff


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def compare(folder: Path, reference: dict) -> dict:
    task, nll, eff = sweep_effects(folder)
    ref = reference[task]
    names = sorted(ref["effects"])
    r = np.array([ref["effects"][h] for h in names])
    x = np.array([eff[h] for h in names])
    top = [names[i] for i in np.argsort(-x)[:5]]
    hits = [h for h in top if ref["effects"][h] >= ref["hit_threshold"] * (1 - 1e-9)]
    d = np.abs(x - r)
    return {
        "run": str(folder), "task": task, "dtype": json.loads((folder / "manifest.json").read_text())["args"]["dtype_resolved"],
        "clean_nll": round(nll, 5), "clean_nll_float32": ref["clean_nll"],
        "median_abs_delta_pp": round(100 * float(np.median(d)), 3), "max_abs_delta_pp": round(100 * float(d.max()), 2),
        "worst_head": names[int(np.argmax(d))], "spearman": round(spearman(x, r), 4),
        "top5": top, "top5_float32": ref["top5"], "overlap": len(hits),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--reference", type=Path, default=Path("recipes/results/locate_smollm2_sweeps.json"))
    ap.add_argument("--out", type=Path, default=Path("recipes/results/locate_bf16_rankings"))
    a = ap.parse_args()
    reference = json.loads(a.reference.read_text())
    rows = [compare(f, reference) for f in a.runs]
    a.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    table = markdown_table([
        {"run": Path(r["run"]).name, "task": r["task"], "clean nll (fp32)": f"{r['clean_nll']} ({r['clean_nll_float32']})",
         "median / max abs delta effect (pp)": f"{r['median_abs_delta_pp']} / {r['max_abs_delta_pp']} ({r['worst_head']})",
         "Spearman vs fp32": r["spearman"], "top 5": ", ".join(r["top5"]), "overlap with fp32 top 5": f"{r['overlap']}/5"}
        for r in rows])
    a.out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()

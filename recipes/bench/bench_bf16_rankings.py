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

``--against FOLDER`` compares run folders of any method with one of another precision instead (say a recipe's run
with ``--dtype bfloat16``, or ``--dtype float32 --autocast bfloat16``, against the same run with ``--dtype float32``): per task scored, target and controls,
the single-head knockouts both runs made in their own precision (measure-and-choose's extra singles, made in its
float32, are left out) and how far their relative nll worsenings differ, beside each run's forward-equivalents,
start set, sets measured and chosen set::

    python recipes/bench/bench_bf16_rankings.py runs/bf16 --against runs/fp32 --out recipes/results/<name>
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from capsense.core.heads import Head
from capsense.core.precision import precision_name
from capsense.core.tables import markdown_table
from capsense.localize.store import read_evaluations


def singles_effects(folder: Path) -> tuple[dict[str, dict], dict[str, dict[str, float]]]:
    """(the clean scores per task, task -> head name -> relative nll worsening) of the single-head knockouts a run
    folder's method made in the run's precision (the first clean evaluation is the reference)."""
    n_heads = json.loads((folder / "manifest.json").read_text())["layout"]["n_heads"]
    evals = read_evaluations(folder, design_only=True)
    base = next(e for e in evals if not e.heads).scores
    out: dict[str, dict[str, float]] = {}
    for e in evals:
        if len(e.heads) == 1:
            for task, s in e.scores.items():
                if task in base and "nll" in s:
                    out.setdefault(task, {}).setdefault(str(Head.from_index(e.heads[0], n_heads)),
                                                        (s["nll"] - base[task]["nll"]) / base[task]["nll"])
    return base, out


def sweep_effects(folder: Path) -> tuple[str, float, dict[str, float]]:
    """(task, clean nll, head name -> relative nll worsening) of an exhaustive run folder."""
    task = json.loads((folder / "manifest.json").read_text())["task"]
    clean, effects = singles_effects(folder)
    return task, float(clean[task]["nll"]), effects[task]


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


def run_summary(folder: Path) -> dict:
    """A run folder's precision (with autocast where it ran), forward-equivalents and measure-and-choose's start, sets measured and choice."""
    manifest, heads = (json.loads((folder / f).read_text()) for f in ("manifest.json", "heads.json"))
    refine = heads.get("refine") or {}
    dtype = precision_name(manifest["args"]["dtype_resolved"], manifest["args"].get("autocast"),
                           manifest["args"].get("autocast_attention_resolved"))
    return {"run": str(folder), "dtype": dtype, "fe": heads["forward_equivalents"],
            "start": (refine.get("start") or {}).get("heads"), "sets_measured": refine.get("n_evaluations"),
            "chosen": refine.get("heads") or [f"L{h['layer']}H{h['head']}" for h in heads["heads"][:5]]}


def compare_singles(folder: Path, against: Path) -> dict:
    """Per task both runs scored: the single-head knockouts both made and how far their effects differ."""
    a, b = singles_effects(folder)[1], singles_effects(against)[1]
    rows = []
    for task in [t for t in a if t in b]:
        names = sorted(set(a[task]) & set(b[task]))
        if not names:
            continue
        d = np.array([abs(a[task][h] - b[task][h]) for h in names])
        rows.append({"task": task, "heads": len(names), "mean_abs_delta_pp": round(100 * float(d.mean()), 2),
                     "max_abs_delta_pp": round(100 * float(d.max()), 2), "worst_head": names[int(np.argmax(d))]})
    return {"runs": [run_summary(folder), run_summary(against)], "tasks": rows}


def _write_singles(result: dict, out: Path) -> str:
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    runs = markdown_table([{"run": Path(r["run"]).name, "dtype": r["dtype"], "FE": r["fe"],
                            "start": ", ".join(r["start"] or []), "sets measured": r["sets_measured"],
                            "chosen": ", ".join(r["chosen"])} for r in result["runs"]])
    tasks = markdown_table([{"task": r["task"], "singles in both": r["heads"],
                             "mean / max abs delta (pp)": f"{r['mean_abs_delta_pp']} / {r['max_abs_delta_pp']} ({r['worst_head']})"}
                            for r in result["tasks"]])
    text = runs + "\n\n" + tasks + "\n"
    out.with_suffix(".md").write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--reference", type=Path, default=Path("recipes/results/locate_smollm2_sweeps.json"))
    ap.add_argument("--out", type=Path, default=Path("recipes/results/locate_bf16_rankings"))
    ap.add_argument("--against", type=Path, help="a run folder of another precision: compare singles with it instead")
    a = ap.parse_args()
    if a.against is not None:
        if len(a.runs) != 1:
            ap.error("--against compares one run folder with another: give one run")
        print(_write_singles(compare_singles(a.runs[0], a.against), a.out), end="")
        return
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

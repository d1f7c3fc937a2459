"""Recovery curves on SmolLM2-135M: overlap with the exhaustive top 5 vs forward-equivalents.

    HF_HUB_OFFLINE=1 python recipes/bench/bench_locate_recovery.py --root runs/bench-recovery \\
        --sweeps /work/runs [--tasks capsense_induction,...] [--budget 50] [--cs-masks 60]

Inputs: per task an exhaustive single-head sweep (``<sweeps>/sweep-<task>``: ``capsense locate
smollm2-135m --task <task> --method exhaustive --limit 24 --dtype float32``), the reference.
Per task it runs (or resumes), on the same 24 documents, raw nll score, float32:

* ``<root>/<task>/prior``: ``--method prior-guided --budget <budget>``; its ``attribution.json``
  is also the ``attribution``-alone result (3 forward-equivalents + the clean forward);
* ``<root>/<task>/cs``: ``--method cs --masks <cs-masks>`` (balanced, 5 heads per mask, lasso).

Overlap: heads of a method's top 5 whose exhaustive effect is within 5% of the fifth-largest
exhaustive effect (so a near-tie with the fifth head counts as a hit), at most 5.
Curves: prior-guided's top 5 of the heads measured alone after each evaluation; cs refit on
its first m masks. Forward-equivalents (:mod:`capsense.scoring.cost`): a forward over the
run's documents = 1, a backward = 2, a prefix-reused forward = its fraction of layers.
Writes ``recipes/results/locate_recovery.json`` and ``.md`` (or ``--results``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from capsense.core.tables import markdown_table
from capsense.localize.config import LocateConfig
from capsense.localize.run import locate
from capsense.localize.store import read_evaluations
from capsense.scoring.cost import ATTRIBUTION, mask_cost

TASKS = ("capsense_induction", "capsense_arithmetic", "capsense_antonyms", "capsense_sequence")
N_LAYERS, N_HEADS = 30, 9
N = N_LAYERS * N_HEADS
HIT_MARGIN = 0.05
CS_CHECKPOINTS = (10, 20, 30, 40, 50, 60, 80, 100, 150)


def name(i: int) -> str:
    return f"L{i // N_HEADS}H{i % N_HEADS}"


def nll_damage(evals, task: str) -> np.ndarray:
    """Relative nll worsening of every evaluation vs the first (the clean model)."""
    v = np.array([e.scores[task]["nll"] for e in evals])
    return (v - v[0]) / v[0]


def sweep_effects(folder: Path, task: str) -> np.ndarray:
    evals = read_evaluations(folder)
    d = nll_damage(evals, task)
    eff = np.full(N, np.nan)
    for e, x in zip(evals[1:], d[1:]):
        if len(e.heads) == 1:
            eff[e.heads[0]] = x
    assert not np.isnan(eff).any(), f"{folder}: the sweep is incomplete"
    return eff


def overlap(top: list[int], eff: np.ndarray) -> int:
    fifth = np.sort(eff)[::-1][4]
    return int(min(5, sum(bool(eff[h] >= fifth - HIT_MARGIN * abs(fifth)) for h in top[:5])))


def reuse_share(run: Path) -> float:
    return float(json.loads((run / "manifest.json").read_text()).get("cost_model", {}).get("reuse_share", 1.0))


def prior_curve(run: Path, task: str, eff: np.ndarray) -> list[dict]:
    evals = read_evaluations(run, design_only=True)
    share = reuse_share(run)
    d = nll_damage(evals, task)
    fe, singles, out = ATTRIBUTION, {}, []
    for e, x in zip(evals, d):
        fe += mask_cost(e.heads, N_LAYERS, N_HEADS, share)
        if len(e.heads) == 1:
            singles[e.heads[0]] = x
        top = sorted(singles, key=lambda h: -singles[h])[:5]
        out.append({"fe": round(fe, 2), "evaluations": len(out) + 1, "overlap": overlap(top, eff) if len(top) == 5 else 0,
                    "top5": [name(h) for h in top]})
    return out


def cs_curve(run: Path, task: str, eff: np.ndarray, solver: str = "lasso") -> list[dict]:
    from capsense.localize.fit import design_matrix
    from capsense.localize.solvers import make_solver

    evals = read_evaluations(run, design_only=True)
    share = reuse_share(run)
    costs = np.cumsum([mask_cost(e.heads, N_LAYERS, N_HEADS, share) for e in evals])
    y = -np.array([e.scores[task]["nll"] for e in evals])
    out = []
    for m in CS_CHECKPOINTS:
        if len(evals) < m + 1:
            break
        scores = make_solver(solver, None, 0, confidence=False).fit(design_matrix(evals[: m + 1], N), y[: m + 1]).scores_
        top = [int(h) for h in scores.top(5)]
        out.append({"fe": round(float(costs[m]), 2), "masks": m, "overlap": overlap(top, eff), "top5": [name(h) for h in top]})
    return out


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def analyse(task: str, root: Path, sweep: Path) -> dict:
    eff = sweep_effects(sweep, task)
    est = np.asarray(json.loads((root / "prior" / "attribution.json").read_text())["estimate"][task])
    ex_top = [int(h) for h in np.argsort(-eff, kind="stable")[:5]]
    est_rank = {int(h): r + 1 for r, h in enumerate(np.argsort(-est, kind="stable"))}
    abs_rank = {int(h): r + 1 for r, h in enumerate(np.argsort(-np.abs(est), kind="stable"))}
    att_top = [int(h) for h in np.argsort(-est, kind="stable")[:5]]
    prior = prior_curve(root / "prior", task, eff)
    cs = cs_curve(root / "cs", task, eff) if (root / "cs").is_dir() else []
    sweep_fe = 1 + sum(mask_cost([h], N_LAYERS, N_HEADS, reuse_share(sweep)) for h in range(N))
    return {
        "task": task,
        "exhaustive_top5": [{"head": name(h), "effect": round(float(eff[h]), 4)} for h in ex_top],
        "hit_threshold": round(float(np.sort(eff)[::-1][4] * (1 - HIT_MARGIN)), 4),
        "exhaustive_fe": round(sweep_fe, 1),
        "attribution": {
            "fe": ATTRIBUTION + 1,
            "overlap": overlap(att_top, eff),
            "top5": [name(h) for h in att_top],
            "spearman": round(spearman(est, eff), 3),
            "false_negatives": [
                {"head": name(h), "effect": round(float(eff[h]), 4), "estimate": round(float(est[h]), 4),
                 "estimate_rank": est_rank[h], "abs_estimate_rank": abs_rank[h]}
                for h in ex_top if h not in att_top
            ],
        },
        "prior_guided": {"final": prior[-1], "first_4of5_fe": next((p["fe"] for p in prior if p["overlap"] >= 4), None),
                         "curve": prior},
        "cs": {"curve": cs, "first_4of5_fe": next((p["fe"] for p in cs if p["overlap"] >= 4), None)},
    }


def markdown(results: list[dict]) -> str:
    rows = []
    for r in results:
        a, p = r["attribution"], r["prior_guided"]
        cs50 = max((c["overlap"] for c in r["cs"]["curve"] if c["fe"] <= 50), default=None)
        rows.append([r["task"], f"{a['overlap']}/5 @ {a['fe']:.0f}", f"{a['spearman']:.2f}",
                     ", ".join(f"{f['head']} (#{f['estimate_rank']}, est {f['estimate']:+.3f})" for f in a["false_negatives"]) or "none",
                     f"{p['final']['overlap']}/5 @ {p['final']['fe']:.1f}", str(p["first_4of5_fe"]),
                     "-" if cs50 is None else f"{cs50}/5", str(r["cs"]["first_4of5_fe"]), f"{r['exhaustive_fe']:.0f}"])
    head = ["task", "attribution alone", "Spearman", "attribution's misses (rank, estimate)", "prior-guided",
            "FE to 4/5 (prior)", "cs best <= 50 FE", "FE to 4/5 (cs)", "exhaustive FE"]
    curves = []
    for r in results:
        pts = [f"{p['fe']:.0f}:{p['overlap']}" for p in r["prior_guided"]["curve"][:: max(1, len(r['prior_guided']['curve']) // 12)]]
        cs = [f"{c['fe']:.0f}:{c['overlap']}" for c in r["cs"]["curve"]]
        curves.append(f"- {r['task']}: prior-guided FE:overlap {' '.join(pts)}; cs {' '.join(cs) or '-'}")
    return markdown_table([dict(zip(head, r)) for r in rows], head) + "\n\nRecovery curves (forward-equivalents : overlap/5)\n\n" + "\n".join(curves) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="runs/bench-recovery")
    ap.add_argument("--sweeps", default="/work/runs", help="Folder holding sweep-<task> exhaustive runs.")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--budget", type=float, default=50.0)
    ap.add_argument("--top-m", type=int, default=24)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--cs-masks", type=int, default=60)
    ap.add_argument("--results", default="recipes/results/locate_recovery")
    ap.add_argument("--skip-run", action="store_true")
    args = ap.parse_args()
    results = []
    for task in args.tasks.split(","):
        root = Path(args.root) / task
        common = dict(model="smollm2-135m", task=task, limit=24, seed=0, dtype="float32", progress=True)
        if not args.skip_run:
            locate(LocateConfig(out=str(root / "prior"), method="prior-guided", budget=args.budget, top_m=args.top_m,
                                group_size=args.group_size, **common))
            if args.cs_masks:
                locate(LocateConfig(out=str(root / "cs"), method="cs", masks=args.cs_masks, **common))
        sweep = Path(args.sweeps) / f"sweep-{task}"
        if not (sweep / "heads.json").is_file():
            print(f"{task}: no finished sweep in {sweep}; rerun with --skip-run when it is there", flush=True)
            continue
        results.append(analyse(task, root, sweep))
        print(json.dumps({k: v for k, v in results[-1].items() if k not in ("prior_guided", "cs")}, indent=1), flush=True)
    out = Path(args.results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()

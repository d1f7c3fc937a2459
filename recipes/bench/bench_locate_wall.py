"""Wall time and forward-equivalents to 4/5 recovery: prior-guided vs cs vs exhaustive, one run.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 python recipes/bench/bench_locate_wall.py \\
        [--model smollm2-135m] [--task capsense_induction] [--cs-masks 150] [--root /tmp/capsense-wall]

One process, one model load, the same 24 documents (raw nll, float32), three fresh runs of
``capsense locate`` in turn, each timed from the call to its return:

1. ``--method exhaustive`` (every head alone, prefix reuse): its effects are the reference
   top 5, so it is 5/5 only when it ends;
2. ``--method prior-guided --budget 50`` (the default);
3. ``--method cs --masks <cs-masks>`` (balanced 5-head masks, lasso).

Time to 4/5 = the run's wall time minus the seconds of the evaluations after the one that
first reached 4/5 (per-evaluation seconds come from evaluations.jsonl), so start-up,
attribution and the final fit and report all count. cs is refitted at the recovery
benchmark's checkpoints (10, 20, ..., 150 masks), with Lasso and with lasso-cv (the earlier cs
result: 4/5 at 150 masks with lasso-cv, 3/5 with Lasso); the first to 4/5 counts. Overlap and forward-equivalents as in
``bench_locate_recovery.py`` (same functions; the model's layout from the run manifest). Writes
``recipes/results/locate_wall_<task>.json`` for SmolLM2, ``locate_wall_<tag>_<task>.json`` for another model.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import time
from pathlib import Path


from capsense.localize.config import LocateConfig
from capsense.localize.run import locate
from capsense.localize.store import read_evaluations

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("bench_locate_recovery", HERE / "bench_locate_recovery.py")
rec = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rec)


def timed(cfg: LocateConfig) -> float:
    t0 = time.perf_counter()
    locate(cfg)
    return time.perf_counter() - t0


def time_to(run: Path, wall: float, n_evals: int) -> float:
    """Seconds until the run's first ``n_evals`` evaluations were done (wall minus the rest)."""
    secs = [e.seconds or 0.0 for e in read_evaluations(run)]
    return wall - float(sum(secs[n_evals:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="capsense_induction")
    ap.add_argument("--cs-masks", type=int, default=150)
    ap.add_argument("--budget", type=float, default=50.0)
    ap.add_argument("--root", type=Path, default=Path("/tmp/capsense-wall"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    t = rec.tag(args.model)
    out = args.out or HERE.parent / "results" / (f"locate_wall_{args.task}.json" if t == "smollm2" else f"locate_wall_{t}_{args.task}.json")
    root = args.root / t / args.task
    shutil.rmtree(root, ignore_errors=True)  # a timing run starts fresh
    common = dict(model=args.model, task=args.task, limit=24, seed=0, dtype="float32", progress=True)
    walls = {
        "exhaustive": timed(LocateConfig(out=str(root / "exhaustive"), method="exhaustive", **common)),
        "prior": timed(LocateConfig(out=str(root / "prior"), method="prior-guided", budget=args.budget, top_m=24,
                                    group_size=8, **common)),
        "cs": timed(LocateConfig(out=str(root / "cs"), method="cs", masks=args.cs_masks, **common)),
    }
    eff = rec.sweep_effects(root / "exhaustive", args.task)
    rec.CS_CHECKPOINTS = tuple(m for m in (10, 20, 30, 40, 50, 60, 80, 100, 120, 150) if m <= args.cs_masks)
    prior = rec.prior_curve(root / "prior", args.task, eff)
    curves = {solver: rec.cs_curve(root / "cs", args.task, eff, solver) for solver in ("lasso", "lasso-cv")}
    firsts = {s: next((c for c in cv if c["overlap"] >= 4), None) for s, cv in curves.items()}
    best = min(curves, key=lambda s: firsts[s]["fe"] if firsts[s] else float("inf"))  # the solver that got there first
    cs, c4 = curves[best], firsts[best]
    p4 = next((p for p in prior if p["overlap"] >= 4), None)
    sweep_fe = rec.sweep_cost(rec.Layout.of(root / "exhaustive"), rec.reuse_share(root / "exhaustive"))
    n_prior_design = len(read_evaluations(root / "prior", design_only=True))
    result = {
        "model": args.model, "task": args.task, "documents": 24, "cs_masks": args.cs_masks,
        "exhaustive": {"fe": round(sweep_fe, 1), "wall_s": round(walls["exhaustive"], 1),
                       "evaluations": len(read_evaluations(root / "exhaustive"))},
        "prior_guided": {
            "fe_to_4of5": p4 and p4["fe"], "wall_s_to_4of5": p4 and round(time_to(root / "prior", walls["prior"], p4["evaluations"]), 1),
            "final_overlap": prior[-1]["overlap"], "fe_total": prior[-1]["fe"], "wall_s_total": round(walls["prior"], 1),
            "design_evaluations": n_prior_design,
        },
        "cs": {
            "fe_to_4of5": c4 and c4["fe"], "wall_s_to_4of5": c4 and round(time_to(root / "cs", walls["cs"], c4["masks"] + 1), 1),
            "solver": best, "wall_s_total": round(walls["cs"], 1),
            "curves": {s: [(c["masks"], c["fe"], c["overlap"]) for c in cv] for s, cv in curves.items()},
        },
    }
    p = result["prior_guided"]
    for name, other in (("exhaustive", result["exhaustive"]), ("cs", result["cs"])):
        fe = other.get("fe_to_4of5", other.get("fe"))
        wall = other.get("wall_s_to_4of5", other.get("wall_s"))
        if p["fe_to_4of5"] and fe:
            result[f"prior_vs_{name}"] = {"fe_ratio": round(fe / p["fe_to_4of5"], 2), "wall_ratio": round(wall / p["wall_s_to_4of5"], 2)}
        elif p["fe_to_4of5"] and name == "cs":  # cs never reached 4/5: a lower bound from everything it spent
            last = cs[-1] if cs else None
            result["prior_vs_cs"] = {"fe_ratio_at_least": last and round(last["fe"] / p["fe_to_4of5"], 2),
                                     "wall_ratio_at_least": round(walls["cs"] / p["wall_s_to_4of5"], 2)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

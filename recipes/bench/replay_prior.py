"""Replay prior-guided localization on recorded sweeps: how a setting would have done, for free.

    python recipes/bench/replay_prior.py \\
        --case smollm2-135m:runs/bench-recovery-smollm2 --case gemma3-270m:runs/bench-recovery-gemma3 \\
        --top-m 16,24,32,48 --group-size 8,16,24 --flag 0.25,0.5 --out recipes/results/locate_replay_r8.md

Per model (``--case model:root``) and task with a recorded sweep (``locate_<tag>_sweeps.json``) and
a prior-guided run's ``<root>/<task>/prior/attribution.json`` (the estimate the search starts
from), :func:`capsense.localize.prior.prior_guided` runs again with the run's own cost model and
budget cap (the sweep's cost), but every knockout is answered from the sweep: a single head by its
measured effect (exact), a group by the sum of its heads' effects (an assumption: interactions are
not in the sweep). Reported per setting: forward-equivalents to 4/5 and 5/5 of the exhaustive top
5 (the overlap rule of ``bench_locate_recovery.py``, the same curve bookkeeping) on every
(model, task), and the worst and mean over them, so a default is chosen for all tasks of both
models at once, not tuned to one. The real runs check the replay (RESULTS-locate.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
from pathlib import Path

import numpy as np

from capsense.core.files import atomic_write_json, atomic_write_text
from capsense.core.tables import markdown_table
from capsense.localize.guided import sweep_cost
from capsense.localize.prior import PRIOR_SCORES, PriorSettings, prior_guided
from capsense.scoring.cost import ATTRIBUTION, mask_cost

HERE = Path(__file__).resolve().parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_locate_recovery", HERE / "bench_locate_recovery.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def replay(est: np.ndarray, eff: np.ndarray, layout, share: float, settings: PriorSettings, overlap,
           folded: float = 1.0) -> dict:
    """One replayed search: FE (attribution and clean forward included) to 4/5 and 5/5, the final overlap.
    ``folded``: the share of the clean forward the attribution's forward stands in for (1 since round 10
    for log-likelihood probes, as the recovery tasks are; 0 replays the earlier accounting)."""

    def cost(heads) -> float:
        return mask_cost(list(heads), layout.n_layers, layout.n_heads, share, folded)

    trail: list[tuple[float, int]] = []  # (FE after each knockout, overlap of the singles' top 5)
    singles: dict[int, float] = {}
    spent = [ATTRIBUTION + cost(())]
    marks = {"last_change": None, "singles_end": None}  # FE of the top 5's last change; FE before the first group
    top_before: set[int] = set()

    def measure(sets):
        out = []
        for s in sets:
            d = float(eff[list(s)].sum())
            if len(s) > 1 and marks["singles_end"] is None:
                marks["singles_end"] = round(spent[0], 2)
            spent[0] += cost(s)
            if len(s) == 1:
                singles[s[0]] = d
            top = sorted(singles, key=lambda h: -singles[h])[:5]
            if len(top) == 5 and set(top) != top_before:
                top_before.clear(), top_before.update(top)
                marks["last_change"] = round(spent[0], 2)
            trail.append((spent[0], overlap(top, eff) if len(top) == 5 else 0))
            out.append(d)
        return out

    budget = min(settings.budget, sweep_cost(cost, layout.n))
    prior_guided(est, measure, cost, PriorSettings(top_k=5, top_m=settings.top_m, group_size=settings.group_size,
                                                   flag=settings.flag, budget=budget,
                                                   already_spent=ATTRIBUTION + cost(())))
    first = {k: next((round(fe, 2) for fe, o in trail if o >= k), None) for k in (4, 5)}
    return {"fe_4of5": first[4], "fe_5of5": first[5], "final": trail[-1][1] if trail else 0,
            "spent": round(trail[-1][0], 2) if trail else None, "budget": round(budget, 1), **marks}


def load_cases(cases: list[str], bench, prior_score: str = "documents") -> list[dict]:
    """Every (model, task) with both a recorded sweep and a prior run's attribution; the singles'
    order from its ``prior_score`` (``documents``: the per-document magnitude, as the library's default)."""
    out = []
    for case in cases:
        model, _, root = case.partition(":")
        if not root:
            raise SystemExit(f"--case {case!r}: expected model:root, e.g. gemma3-270m:runs/bench-recovery-gemma3")
        sweeps = json.loads((HERE.parent / "results" / f"locate_{bench.tag(model)}_sweeps.json").read_text())
        for task, rec in sorted(sweeps.items()):
            prior = Path(root) / task / "prior"
            if not (prior / "attribution.json").is_file():
                print(f"{model} {task}: no {prior}/attribution.json; skipped", flush=True)
                continue
            lay = bench.Layout.of(prior)
            att = json.loads((prior / "attribution.json").read_text())
            key = "magnitude" if prior_score == "documents" else "estimate"
            if key not in att:
                raise SystemExit(f"{prior}/attribution.json has no {key!r} (prior_score {prior_score}): "
                                 f"a run from before round 9, or use --prior-score estimate")
            est = np.asarray(att[key][task], dtype=float)
            out.append({"model": model, "task": task, "layout": lay, "share": bench.reuse_share(prior),
                        "est": est, "eff": bench.recorded_effects(rec, lay)})
    return out


def single_costs(layout) -> np.ndarray:
    """Each head's single-knockout cost with full prefix reuse: the share of layers from its own on."""
    layer = np.arange(layout.n) // layout.n_heads
    return (layout.n_layers - layer) / layout.n_layers


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", required=True, help="model:root of its recovery runs (repeatable)")
    ap.add_argument("--top-m", type=ints, default=[32])
    ap.add_argument("--group-size", type=ints, default=[16])
    ap.add_argument("--flag", type=lambda s: [float(x) for x in s.split(",")], default=[0.5])
    ap.add_argument("--budget", type=float, default=50.0)
    ap.add_argument("--prior-score", choices=PRIOR_SCORES, default="documents", help="what orders the singles")
    ap.add_argument("--folded", type=float, default=1.0,
                    help="share of the clean forward the attribution's forward stands in for (0: before round 10)")
    ap.add_argument("--cost-power", type=lambda s: [float(x) for x in s.split(",")], default=[0.0],
                    help="order the singles by score / (a single's cost in FE) ** P (0: the library's order; round 12: "
                         "1 and 0.5 measured worse on all eight pairs)")
    ap.add_argument("--out", type=Path, default=None, help="write <out>.md and <out>.json")
    args = ap.parse_args(argv)
    bench = _bench()
    cases = load_cases(args.case, bench, args.prior_score)
    if not cases:
        raise SystemExit("no (model, task) with a recorded sweep and a prior run's attribution.json")
    names = [f"{bench.tag(c['model'])} {c['task'].removeprefix('capsense_')}" for c in cases]
    rows, records = [], []
    for m, g, f, p in itertools.product(args.top_m, args.group_size, args.flag, args.cost_power):
        st = PriorSettings(top_m=m, group_size=g, flag=f, budget=args.budget)
        res = [replay(c["est"] / single_costs(c["layout"]) ** p, c["eff"], c["layout"], c["share"], st, bench.overlap,
                      args.folded) for c in cases]
        # a search that never reaches k/5 counts as its whole budget (the sweep would have been cheaper)
        r4 = [r["fe_4of5"] if r["fe_4of5"] is not None else r["budget"] for r in res]
        r5 = [r["fe_5of5"] if r["fe_5of5"] is not None else r["budget"] for r in res]
        records.append({"top_m": m, "group_size": g, "flag": f, "cost_power": p, "cases": dict(zip(names, res))})
        rows.append({"top_m": m, "group": g, "flag": f, "cost power": p,
                     **{n: f"{r['fe_4of5']} / {r['fe_5of5']}" for n, r in zip(names, res)},
                     "worst 4/5": f"{max(r4):.1f}", "mean 4/5": f"{np.mean(r4):.1f}",
                     "worst 5/5": f"{max(r5):.1f}", "mean 5/5": f"{np.mean(r5):.1f}",
                     "mean spent": f"{np.mean([r['spent'] or 0 for r in res]):.1f}",
                     "top 5 last changed / singles ended": ", ".join(f"{r['last_change']}/{r['singles_end']}" for r in res)})
    head = ["top_m", "group", "flag", "cost power", *names, "worst 4/5", "mean 4/5", "worst 5/5", "mean 5/5", "mean spent",
            "top 5 last changed / singles ended"]
    table = ("FE to 4/5 / FE to 5/5 of the exhaustive top 5 (None: never within the budget, counted as the "
             "budget in worst/mean), replayed on the recorded sweeps; mean spent: where the searches stopped; "
             "last column, per case: the FE at which the measured top 5 last changed and at which the singles "
             "ended (a change after the singles is a head only the group knockouts found)\n\n" + markdown_table(rows, head) + "\n")
    emit(table, records, args.out)


def emit(table: str, records, out: Path | None) -> None:
    """Print ``table``; with ``out``, write it to ``<out>.md`` and ``records`` to ``<out>.json``."""
    print(table)
    if out:
        atomic_write_text(out.with_suffix(".md"), table)
        atomic_write_json(out.with_suffix(".json"), records)


if __name__ == "__main__":
    main()

"""Recovery curves: overlap with the exhaustive top 5 vs forward-equivalents, for any model.

One command per model (each stage resumes; run folders under ``--root``):

    HF_HUB_OFFLINE=1 python recipes/bench/bench_locate_recovery.py --model smollm2-135m
    HF_HUB_OFFLINE=1 python recipes/bench/bench_locate_recovery.py --model gemma3-270m

Per task (``--tasks``, default the four below), on the same 24 documents, raw nll score, float32,
no controls, the model's own layout (read from the run's manifest; no per-model settings):

* ``<root>/sweep-<task>`` (stage ``sweep``): ``--method exhaustive``, every head knocked out
  alone (the reference); once finished it is recorded with ``record_sweeps.py`` into
  ``recipes/results/locate_<tag>_sweeps.json`` (``<tag>``: the model name before its first ``-``);
* ``<root>/<task>/prior`` (stage ``prior``): ``--method prior-guided --budget <budget>``; its
  ``attribution.json`` is also the ``attribution``-alone result (3 forward-equivalents; until round 10 + the
  clean forward, which the attribution's forward now stands in for);
* ``<root>/<task>/cs`` (stage ``cs``): ``--method cs --masks <cs-masks>`` (balanced, default
  sparsity 2% of the heads per mask: 5 on SmolLM2's 270, 1 on Gemma 3's 72; lasso).

The reference effects come from the sweep folder, or, when it is gone, from the recorded sweeps
file (``--sweeps-json``), so the prior-guided and cs stages can be rerun after an algorithm change
without the sweep (``--stages prior,cs``).
Overlap: heads of a method's top 5 whose exhaustive effect is within 5% of the fifth-largest
exhaustive effect (so a near-tie with the fifth head counts as a hit), at most 5.
Curves: prior-guided's top 5 of the heads measured alone after each evaluation; cs refit on
its first m masks. Forward-equivalents (:mod:`capsense.scoring.cost`): a forward over the
run's documents = 1, a backward = 2, a prefix-reused forward = its fraction of layers.
Writes ``--results`` + ``.json`` / ``.md`` (default ``recipes/results/locate_recovery`` for
SmolLM2, whose table predates the model parameter, ``locate_recovery_<tag>`` for any other model);
``--table-only`` rewrites the ``.md`` from the ``.json``. ``--ablation mean`` runs every stage under mean
ablation (capsense's neutral prose as the reference), against a mean-ablated sweep: the default folders and
files then end in ``-mean`` / ``_mean`` (round 34: is the one-pass attribution closer to mean ablation's effects,
a smaller step from the clean activations than zeroing, than to zero ablation's?).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

from capsense.core.ablation import ABLATION_MODES
from capsense.core.tables import markdown_table
from capsense.localize.config import LocateConfig
from capsense.localize.prior import DEFAULT_BUDGET, DEFAULT_GROUP_SIZE, DEFAULT_TOP_M
from capsense.localize.run import locate
from capsense.localize.store import read_evaluations
from capsense.scoring.cost import ATTRIBUTION, mask_cost

HERE = Path(__file__).resolve().parent
TASKS = ("capsense_induction", "capsense_arithmetic", "capsense_antonyms", "capsense_sequence")
STAGES = ("sweep", "prior", "cs")
HIT_MARGIN = 0.05
CS_CHECKPOINTS = (10, 20, 30, 40, 50, 60, 80, 100, 150)
PRIOR_AT = (10, 20, 30, 50)  # the table's prior-guided columns: overlap within this many FE


class Layout(NamedTuple):
    """A model's heads as the run manifest records them (flat index = layer * n_heads + head).
    (A NamedTuple, not a dataclass: the other bench scripts load this file by path.)"""

    n_layers: int
    n_heads: int

    @property
    def n(self) -> int:
        return self.n_layers * self.n_heads

    def name(self, i: int) -> str:
        return f"L{i // self.n_heads}H{i % self.n_heads}"

    @classmethod
    def of(cls, run: Path) -> Layout:
        lay = json.loads((run / "manifest.json").read_text())["layout"]
        return cls(int(lay["n_layers"]), int(lay["n_heads"]))


def tag(model: str) -> str:
    """Short model name for result files: ``smollm2-135m`` -> ``smollm2``, ``gemma3-270m`` -> ``gemma3``."""
    return Path(model).name.split("-")[0].lower()


def nll_damage(evals, task: str) -> np.ndarray:
    """Relative nll worsening of every evaluation vs the first (the clean model)."""
    v = np.array([e.scores[task]["nll"] for e in evals])
    return (v - v[0]) / v[0]


def sweep_finished(folder: Path) -> bool:
    return (folder / "heads.json").is_file()


def sweep_effects(folder: Path, task: str) -> np.ndarray:
    lay = Layout.of(folder)
    evals = read_evaluations(folder)
    d = nll_damage(evals, task)
    eff = np.full(lay.n, np.nan)
    for e, x in zip(evals[1:], d[1:]):
        if len(e.heads) == 1:
            eff[e.heads[0]] = x
    assert not np.isnan(eff).any(), f"{folder}: the sweep is incomplete"
    return eff


def recorded_effects(record: dict, lay: Layout) -> np.ndarray:
    """Effects from a ``record_sweeps.py`` entry, in flat head order of ``lay``."""
    eff = np.array([record["effects"].get(lay.name(i), np.nan) for i in range(lay.n)], dtype=float)
    assert not np.isnan(eff).any(), "the recorded sweep does not cover every head of this layout"
    return eff


def overlap(top: list[int], eff: np.ndarray) -> int:
    fifth = np.sort(eff)[::-1][4]
    return int(min(5, sum(bool(eff[h] >= fifth - HIT_MARGIN * abs(fifth)) for h in top[:5])))


def reuse_share(run: Path) -> float:
    return float(json.loads((run / "manifest.json").read_text()).get("cost_model", {}).get("reuse_share", 1.0))


def folded_share(run: Path) -> float:
    """The share of the clean forward the run's attribution ran (0 before round 10)."""
    return float(json.loads((run / "manifest.json").read_text()).get("cost_model", {}).get("clean_forward_folded", 0.0))


def sweep_cost(lay: Layout, share: float) -> float:
    """Forward-equivalents of an exhaustive single-head sweep (clean forward + every head alone)."""
    return 1 + sum(mask_cost([h], lay.n_layers, lay.n_heads, share) for h in range(lay.n))


def prior_curve(run: Path, task: str, eff: np.ndarray) -> list[dict]:
    lay = Layout.of(run)
    evals = read_evaluations(run, design_only=True)
    share, folded = reuse_share(run), folded_share(run)
    d = nll_damage(evals, task)
    fe, singles, out = ATTRIBUTION, {}, []
    for e, x in zip(evals, d):
        fe += mask_cost(e.heads, lay.n_layers, lay.n_heads, share, folded)
        if len(e.heads) == 1:
            singles[e.heads[0]] = x
        top = sorted(singles, key=lambda h: -singles[h])[:5]
        out.append({"fe": round(fe, 2), "evaluations": len(out) + 1, "overlap": overlap(top, eff) if len(top) == 5 else 0,
                    "top5": [lay.name(h) for h in top]})
    return out


def cs_curve(run: Path, task: str, eff: np.ndarray, solver: str = "lasso") -> list[dict]:
    from capsense.localize.fit import design_matrix
    from capsense.localize.solvers import make_solver

    lay = Layout.of(run)
    evals = read_evaluations(run, design_only=True)
    share = reuse_share(run)
    costs = np.cumsum([mask_cost(e.heads, lay.n_layers, lay.n_heads, share) for e in evals])
    y = -np.array([e.scores[task]["nll"] for e in evals])
    out = []
    for m in CS_CHECKPOINTS:
        if len(evals) < m + 1:
            break
        scores = make_solver(solver, None, 0, confidence=False).fit(design_matrix(evals[: m + 1], lay.n), y[: m + 1]).scores_
        top = [int(h) for h in scores.top(5)]
        out.append({"fe": round(float(costs[m]), 2), "masks": m, "overlap": overlap(top, eff), "top5": [lay.name(h) for h in top]})
    return out


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def first_fe(curve: list[dict], k: int) -> float | None:
    """Forward-equivalents at which a curve first reaches ``k``/5 (None: never)."""
    return next((p["fe"] for p in curve if p["overlap"] >= k), None)


def analyse(task: str, root: Path, eff: np.ndarray, sweep_share: float | None = None) -> dict:
    """Every method's result on ``task`` against the sweep's effects ``eff``; ``sweep_share``: the
    sweep's prefix-reuse share (None: the prior run's, the same documents and scorer)."""
    lay = Layout.of(root / "prior")
    est = np.asarray(json.loads((root / "prior" / "attribution.json").read_text())["estimate"][task])
    ex_top = [int(h) for h in np.argsort(-eff, kind="stable")[:5]]
    est_rank = {int(h): r + 1 for r, h in enumerate(np.argsort(-est, kind="stable"))}
    abs_rank = {int(h): r + 1 for r, h in enumerate(np.argsort(-np.abs(est), kind="stable"))}
    att_top = [int(h) for h in np.argsort(-est, kind="stable")[:5]]
    prior = prior_curve(root / "prior", task, eff)
    cs = cs_curve(root / "cs", task, eff) if (root / "cs").is_dir() else []
    share = reuse_share(root / "prior") if sweep_share is None else sweep_share
    return {
        "task": task,
        "n_heads": lay.n,
        "exhaustive_top5": [{"head": lay.name(h), "effect": round(float(eff[h]), 4)} for h in ex_top],
        "hit_threshold": round(float(np.sort(eff)[::-1][4] * (1 - HIT_MARGIN)), 4),
        "exhaustive_fe": round(sweep_cost(lay, share), 1),
        "attribution": {
            "fe": ATTRIBUTION + 1 - folded_share(root / "prior"),  # + the clean forward it did not stand in for
            "overlap": overlap(att_top, eff),
            "top5": [lay.name(h) for h in att_top],
            "spearman": round(spearman(est, eff), 3),
            "false_negatives": [
                {"head": lay.name(h), "effect": round(float(eff[h]), 4), "estimate": round(float(est[h]), 4),
                 "estimate_rank": est_rank[h], "abs_estimate_rank": abs_rank[h]}
                for h in ex_top if h not in att_top
            ],
        },
        "prior_guided": {"final": prior[-1], "first_4of5_fe": first_fe(prior, 4), "first_5of5_fe": first_fe(prior, 5),
                         "curve": prior},
        "cs": {"curve": cs, "first_4of5_fe": first_fe(cs, 4), "first_5of5_fe": first_fe(cs, 5)},
    }


def at_most(curve: list[dict], fe: float) -> str:
    """Best overlap a curve reached within ``fe`` forward-equivalents ("-": no point that cheap)."""
    best = max((c["overlap"] for c in curve if c["fe"] <= fe), default=None)
    return "-" if best is None else f"{best}/5"


def markdown(results: list[dict]) -> str:
    rows = []
    for r in results:
        a, p, cs = r["attribution"], r["prior_guided"], r["cs"]["curve"]
        rows.append([r["task"], f"{a['overlap']}/5 @ {a['fe']:.0f}", f"{a['spearman']:.2f}",
                     ", ".join(f"{f['head']} (#{f['estimate_rank']}, est {f['estimate']:+.3f})" for f in a["false_negatives"]) or "none",
                     *(at_most(p["curve"], fe) for fe in PRIOR_AT), f"{p['final']['overlap']}/5 @ {p['final']['fe']:.1f}",
                     str(first_fe(p["curve"], 4)), str(first_fe(p["curve"], 5)),
                     at_most(cs, 50), str(first_fe(cs, 4)), f"{r['exhaustive_fe']:.0f}"])
    head = ["task", "attribution alone", "Spearman", "attribution's misses (rank, estimate)",
            *(f"prior <= {fe} FE" for fe in PRIOR_AT), "prior-guided final", "FE to 4/5 (prior)", "FE to 5/5 (prior)",
            "cs best <= 50 FE", "FE to 4/5 (cs)", "exhaustive FE"]
    curves = []
    for r in results:
        pts = [f"{p['fe']:.0f}:{p['overlap']}" for p in r["prior_guided"]["curve"][:: max(1, len(r['prior_guided']['curve']) // 12)]]
        cs = [f"{c['fe']:.0f}:{c['overlap']}" for c in r["cs"]["curve"]]
        curves.append(f"- {r['task']}: prior-guided FE:overlap {' '.join(pts)}; cs {' '.join(cs) or '-'}")
    return markdown_table([dict(zip(head, r)) for r in rows], head) + "\n\nRecovery curves (forward-equivalents : overlap/5)\n\n" + "\n".join(curves) + "\n"


def run_stages(args, task: str, stages: set[str], sweep: Path) -> None:
    """Run (or resume) the requested stages of ``task``; a finished sweep is recorded."""
    root = Path(args.root) / task
    common = dict(model=args.model, task=task, limit=24, seed=0, dtype="float32", progress=True, ablation=args.ablation)
    if "sweep" in stages:
        locate(LocateConfig(out=str(sweep), method="exhaustive", **common))
        spec = importlib.util.spec_from_file_location("record_sweeps", HERE / "record_sweeps.py")
        record_sweeps = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(record_sweeps)
        record_sweeps.main([str(sweep), "--out", str(args.sweeps_json)])
    if "prior" in stages:
        locate(LocateConfig(out=str(root / "prior"), method="prior-guided", budget=args.budget, top_m=args.top_m,
                            group_size=args.group_size, **common))
    if "cs" in stages and args.cs_masks:
        locate(LocateConfig(out=str(root / "cs"), method="cs", masks=args.cs_masks, **common))


def reference(args, task: str, sweep: Path) -> tuple[np.ndarray, float | None] | None:
    """The sweep's effects and its reuse share: from the folder, else from the recorded file."""
    if sweep_finished(sweep):
        return sweep_effects(sweep, task), reuse_share(sweep)
    recorded = json.loads(args.sweeps_json.read_text()) if args.sweeps_json.is_file() else {}
    if task in recorded and (Path(args.root) / task / "prior" / "manifest.json").is_file():
        return recorded_effects(recorded[task], Layout.of(Path(args.root) / task / "prior")), recorded[task].get("reuse_share")
    print(f"{task}: no finished sweep in {sweep} nor in {args.sweeps_json}; run the sweep stage", flush=True)
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--root", default=None, help="Run folders (default runs/bench-recovery-<tag>).")
    ap.add_argument("--sweeps", default=None, help="Folder holding sweep-<task> exhaustive runs (default: --root).")
    ap.add_argument("--sweeps-json", type=Path, default=None,
                    help="Recorded sweeps (default recipes/results/locate_<tag>_sweeps.json).")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--stages", default=",".join(STAGES), help=f"Comma-separated subset of {', '.join(STAGES)}, or none.")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help="prior-guided's (default: the library's)")
    ap.add_argument("--top-m", type=int, default=DEFAULT_TOP_M, help="prior-guided's (default: the library's)")
    ap.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE, help="prior-guided's (default: the library's)")
    ap.add_argument("--cs-masks", type=int, default=60)
    ap.add_argument("--results", default=None)
    ap.add_argument("--ablation", choices=ABLATION_MODES, default="zero",
                    help="Every stage's ablation (mean: folders and result files get a -mean / _mean suffix).")
    ap.add_argument("--skip-run", action="store_true", help="Same as --stages none: analyse what is there.")
    ap.add_argument("--table-only", action="store_true", help="Rewrite the .md from the results .json; run nothing.")
    args = ap.parse_args(argv)
    t = tag(args.model)
    sfx = "" if args.ablation == "zero" else f"_{args.ablation}"
    args.root = args.root or f"runs/bench-recovery-{t}" + sfx.replace("_", "-")
    args.sweeps = args.sweeps or args.root
    args.sweeps_json = args.sweeps_json or HERE.parent / "results" / f"locate_{t}_sweeps{sfx}.json"
    args.results = args.results or str(HERE.parent / "results" / (("locate_recovery" if t == "smollm2" else f"locate_recovery_{t}") + sfx))
    stages = set() if args.skip_run or args.stages == "none" else set(filter(None, args.stages.split(",")))
    if stages - set(STAGES):
        ap.error(f"unknown stage(s) {', '.join(sorted(stages - set(STAGES)))}: valid are {', '.join(STAGES)} or none")
    unknown = set(args.tasks.split(",")) - set(TASKS)
    if unknown:
        ap.error(f"unknown task(s) {', '.join(sorted(unknown))}: the recovery tasks are {', '.join(TASKS)}")
    args.stage_set = stages
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = Path(args.results)
    stored = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").is_file() else []
    by_task = {r["task"]: r for r in stored}
    if not args.table_only:
        for task in args.tasks.split(","):
            sweep = Path(args.sweeps) / f"sweep-{task}"
            run_stages(args, task, args.stage_set, sweep)
            ref = reference(args, task, sweep)
            if ref is None or not (Path(args.root) / task / "prior" / "attribution.json").is_file():
                continue
            by_task[task] = analyse(task, Path(args.root) / task, *ref)
            print(json.dumps({k: v for k, v in by_task[task].items() if k not in ("prior_guided", "cs")}, indent=1), flush=True)
    results = [by_task[t] for t in TASKS if t in by_task]  # every task recorded so far, in the table's order
    out.parent.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()

"""What stopping a knockout's controls early changes: pairs of run folders, one made with a single's controls
scored until the screen excludes it (``--single-controls until-excluded``, rounds 42-44; ``cheapest-first``, the
default since round 45, also puts the target in its place among them) or a measure-and-choose set's until the first
beyond tolerance (``--set-controls until-beyond``, round 43), and one made the earlier way (every control, or round
45's pairs: ``until-excluded``), the same command otherwise.

    capsense locate smollm2-135m --task capsense_arithmetic --controls default ... --set-controls until-beyond --out runs/new
    capsense locate smollm2-135m --task capsense_arithmetic --controls default ... --out runs/all
    python recipes/bench/compare_control_stops.py runs/new runs/all [NEW ALL ...] --out recipes/results/<name>

Per pair: forward-equivalents, wall time per phase (``manifest.json`` ``timing``), the heads the screen set aside,
the chosen set (as a set: the ranking's order may differ, since the selective ranking takes attribution's estimate
where a set-aside single was not scored) and its measured damage, the sets measured and how many stopped early,
the set since which the choice stood, the extra singles; and over every knockout both runs made (singles and sets
alike), how many probe scores are equal, differ, or were not scored in the first run (each probe's scorer runs on
its own, so a score measured both ways should be bit-identical). Round 42's pairs were compared by this script
under its earlier name, ``compare_single_controls.py``. Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from capsense.core.tables import markdown_table
from capsense.localize.store import read_evaluations


def precision(args: dict) -> str:
    """The run's weights dtype, and autocast's where it ran."""
    dtype = args.get("dtype_resolved") or args.get("dtype") or "?"
    return f"{dtype}, autocast {args['autocast']}" if args.get("autocast") else dtype


def run_summary(folder: Path) -> dict:
    """A run folder's cost, time, screen and choice."""
    heads = json.loads((folder / "heads.json").read_text())
    manifest = json.loads((folder / "manifest.json").read_text())
    refine = heads.get("refine") or {}
    chosen = refine.get("chosen") or {}
    timing = manifest.get("timing", {})
    args = manifest.get("args", {})
    return {
        "run": str(folder),
        "model": heads.get("model"),
        "precision": precision(manifest.get("args", {})),
        "task": heads["task"],
        "controls_until": controls_until(args),
        "forward_equivalents": manifest["forward_equivalents"],
        "wall_s": round(sum(timing.get(k, 0.0) for k in ("load_s", "evaluate_s_this_attempt")), 2),
        "timing": {k: timing.get(k) for k in ("attribution_s", "search_s", "refine_s", "checks_s")},
        "excluded": sorted(e["head"] for e in (heads.get("screen") or {}).get("excluded", [])),
        "chosen": refine.get("heads"),
        "chosen_target": chosen.get("target_damage"),
        "chosen_worst_control": max((chosen.get("control_damage") or {}).values(), default=None),
        "sets_measured": refine.get("n_evaluations"),
        "sets_stopped": sum(q.get("all_controls") is False for q in refine.get("measured", [])),
        "settled_at": refine.get("choice_settled_at"),
        "extra_singles": (refine.get("extra_singles") or {}).get("n_measured", 0),
    }


def controls_until(args: dict) -> str:
    """How the run scored a knockout's controls: where a single's and a set's stopped early (else "all")."""
    early = [f"single {args['single_controls']}" if args.get("single_controls", "all") != "all" else "",
             f"set {args['set_controls']}" if args.get("set_controls", "all") != "all" else ""]
    return "; ".join(e for e in early if e) or "all"


def probe_agreement(new: Path, old: Path) -> dict:
    """Over the knockouts (singles and sets, any round) both folders made: probe scores equal, differing, not
    scored in ``new``."""
    ours = {(e.round, frozenset(e.heads)): e for e in read_evaluations(new) if e.heads}
    equal = differ = missing = 0
    for e in read_evaluations(old):
        mine = ours.get((e.round, frozenset(e.heads)))
        if mine is None:
            continue
        for task, score in e.scores.items():
            if task not in mine.scores:
                missing += 1
            elif mine.scores[task] == score:
                equal += 1
            else:
                differ += 1
    return {"equal": equal, "differ": differ, "not_scored": missing}


def compare(new: Path, old: Path) -> dict:
    a, b = run_summary(new), run_summary(old)
    if a["task"] != b["task"]:
        raise SystemExit(f"{new} and {old} located different tasks ({a['task']}, {b['task']}): pass pairs of the same run")
    return {"model": a["model"], "precision": a["precision"], "task": a["task"], "early": a, "all": b, "same_excluded": a["excluded"] == b["excluded"],
            "same_chosen_set": sorted(a["chosen"] or []) == sorted(b["chosen"] or []), "probes": probe_agreement(new, old)}


def table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        for mode in ("all", "early"):
            s = r[mode]
            out.append({"model": r["model"], "precision": r["precision"], "task": r["task"], "controls until": s["controls_until"], "FE": s["forward_equivalents"],
                        "load + evaluate s": s["wall_s"], "search s": s["timing"]["search_s"], "refine s": s["timing"]["refine_s"],
                        "set aside": len(s["excluded"]), "extra singles": s["extra_singles"], "sets": s["sets_measured"],
                        "sets stopped": s["sets_stopped"], "settled at": s["settled_at"],
                        "chosen": ", ".join(s["chosen"] or []), "target": s["chosen_target"],
                        "worst control": s["chosen_worst_control"]})
        p = r["probes"]
        out.append({"model": r["model"], "precision": r["precision"], "task": r["task"], "controls until": "both",
                    "chosen": f"same set: {'yes' if r['same_chosen_set'] else 'NO'}; same set aside: "
                              f"{'yes' if r['same_excluded'] else 'NO'}; probe scores equal {p['equal']}, "
                              f"differ {p['differ']}, not scored {p['not_scored']}"})
    return markdown_table(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="pairs: a run that stopped controls early, then the same run with all")
    ap.add_argument("--out", type=Path, help="write <out>.json and <out>.md")
    args = ap.parse_args()
    if len(args.folders) % 2:
        ap.error(f"give run folders in pairs (early, all); got {len(args.folders)}")
    rows = [compare(args.folders[i], args.folders[i + 1]) for i in range(0, len(args.folders), 2)]
    md = table(rows)
    print(md)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(md + "\n")


if __name__ == "__main__":
    main()

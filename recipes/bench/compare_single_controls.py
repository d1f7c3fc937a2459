"""What scoring a single's controls until the screen excludes it changes: pairs of run folders, one made with
``--single-controls until-excluded`` (the default since round 42) and one with ``--single-controls all``, the
same command otherwise.

    capsense locate smollm2-135m --task capsense_induction --controls default,capsense_arithmetic ... --out runs/new
    capsense locate smollm2-135m --task capsense_induction --controls default,capsense_arithmetic ... \\
        --single-controls all --out runs/all
    python recipes/bench/compare_single_controls.py runs/new runs/all [NEW ALL ...] --out recipes/results/<name>

Per pair: forward-equivalents, wall time per phase (``manifest.json`` ``timing``), the heads the screen set aside,
the chosen set (as a set: the ranking's order may differ, since the selective ranking takes attribution's estimate
where a set-aside single was not scored) and its measured damage, the sets measured, the extra singles; and over
every single both runs knocked out, how many probe scores are equal, differ, or were not scored (each probe's
scorer runs on its own, so a score measured both ways should be bit-identical). Writes ``<out>.json`` and
``<out>.md``.
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
    return {
        "run": str(folder),
        "model": heads.get("model"),
        "precision": precision(manifest.get("args", {})),
        "task": heads["task"],
        "forward_equivalents": manifest["forward_equivalents"],
        "wall_s": round(sum(timing.get(k, 0.0) for k in ("load_s", "evaluate_s_this_attempt")), 2),
        "timing": {k: timing.get(k) for k in ("attribution_s", "search_s", "refine_s", "checks_s")},
        "excluded": sorted(e["head"] for e in (heads.get("screen") or {}).get("excluded", [])),
        "chosen": refine.get("heads"),
        "chosen_target": chosen.get("target_damage"),
        "chosen_worst_control": max((chosen.get("control_damage") or {}).values(), default=None),
        "sets_measured": refine.get("n_evaluations"),
        "extra_singles": (refine.get("extra_singles") or {}).get("n_measured", 0),
    }


def probe_agreement(new: Path, old: Path) -> dict:
    """Over the single-head knockouts (any round) both folders made: probe scores equal, differing, not scored in ``new``."""
    ours = {(e.round, tuple(e.heads)): e for e in read_evaluations(new) if len(e.heads) == 1}
    equal = differ = missing = 0
    for e in read_evaluations(old):
        mine = ours.get((e.round, tuple(e.heads)))
        if len(e.heads) != 1 or mine is None:
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
    return {"model": a["model"], "precision": a["precision"], "task": a["task"], "until_excluded": a, "all": b, "same_excluded": a["excluded"] == b["excluded"],
            "same_chosen_set": sorted(a["chosen"] or []) == sorted(b["chosen"] or []), "probes": probe_agreement(new, old)}


def table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        for mode in ("all", "until_excluded"):
            s = r[mode]
            out.append({"model": r["model"], "precision": r["precision"], "task": r["task"], "single controls": mode.replace("_", "-"), "FE": s["forward_equivalents"],
                        "load + evaluate s": s["wall_s"], "search s": s["timing"]["search_s"], "refine s": s["timing"]["refine_s"],
                        "set aside": len(s["excluded"]), "extra singles": s["extra_singles"], "sets": s["sets_measured"],
                        "chosen": ", ".join(s["chosen"] or []), "target": s["chosen_target"],
                        "worst control": s["chosen_worst_control"]})
        p = r["probes"]
        out.append({"model": r["model"], "precision": r["precision"], "task": r["task"], "single controls": "both",
                    "chosen": f"same set: {'yes' if r['same_chosen_set'] else 'NO'}; same set aside: "
                              f"{'yes' if r['same_excluded'] else 'NO'}; probe scores equal {p['equal']}, "
                              f"differ {p['differ']}, not scored {p['not_scored']}"})
    return markdown_table(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="pairs: a run with until-excluded, then the same run with all")
    ap.add_argument("--out", type=Path, help="write <out>.json and <out>.md")
    args = ap.parse_args()
    if len(args.folders) % 2:
        ap.error(f"give run folders in pairs (until-excluded, all); got {len(args.folders)}")
    rows = [compare(args.folders[i], args.folders[i + 1]) for i in range(0, len(args.folders), 2)]
    md = table(rows)
    print(md)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(md + "\n")


if __name__ == "__main__":
    main()

"""Old heads vs new heads on every control: the selectivity table of a selective run.

    HF_HUB_OFFLINE=1 python recipes/bench/selectivity_table.py --run runs/smollm2-induction-cpu \\
        --old L16H0+L18H7+L11H4+L2H2+L29H1 --out recipes/results/selectivity_smollm2_induction.md
    python recipes/bench/selectivity_table.py --run runs/gemma3-induction-cpu --out ...   # the chosen set alone

``--run`` is a recipe's output folder (``locate/`` with heads.json and manifest.json). The chosen
set and the ``--old`` set are validated the same way (``capsense validate``'s library call: the
same held-out documents, the run's target, its controls and the held-out control suite, base,
ablated and random K-head sets), and one markdown table puts them side by side: per task its
role (target, named control, default suite, held out), base, each set's value and change, and
each validation's random-K mean change. Each verdict line follows. The raw validations are
written beside the table (``<out stem>.json``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from capsense.core.files import atomic_write_json, atomic_write_text
from capsense.core.heads import HeadSet, load_heads_file, write_heads_file
from capsense.evaluation.validate import validate
from capsense.tasks.suite import suite_of


def heads_file_for(run: Path, spec: str, folder: Path) -> Path:
    """A heads.json for ``spec`` beside a copy of the run's manifest (same documents held out)."""
    hf = load_heads_file(run / "heads.json")
    heads = [{"layer": h.layer, "head": h.head, "importance": float(-i)} for i, h in enumerate(HeadSet.parse(spec))]
    shutil.copy(run / "manifest.json", folder / "manifest.json")
    meta = {k: hf.meta[k] for k in ("task", "controls") if k in hf.meta}
    return write_heads_file(folder / "heads.json", type(hf)(model=hf.model, heads=heads, meta=meta))


def role(task: str, target: str, controls: list[str]) -> str:
    if task == target:
        return "target"
    suite = suite_of(task)
    if task in controls:
        return "default suite (searched)" if suite == "default" else "named control (searched)"
    return "held out" if suite == "held-out" else "other"


def pct(x) -> str:
    return "" if x is None else f"{100 * x:+.1f}%"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", required=True, help="a recipe's output folder (with locate/) or a locate run folder")
    ap.add_argument("--old", default=None, help="the head set to compare with, e.g. L16H0+L18H7+L11H4+L2H2+L29H1 "
                    "(omitted: the chosen set alone, from the recipe's own validation when it has one)")
    ap.add_argument("--top-k", type=int, default=5, help="size of the chosen set when --old is omitted")
    ap.add_argument("--model", default=None)
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--random", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    run = Path(args.run) / "locate" if (Path(args.run) / "locate").is_dir() else Path(args.run)
    hf = load_heads_file(run / "heads.json")
    model = args.model or hf.model
    top_k = len(HeadSet.parse(args.old)) if args.old else args.top_k
    new_spec = "+".join(str(h) for h in hf.head_set.top(top_k))
    results = {}
    done = run.parent / "validate" / "validation.json"  # the recipe's own validation of the chosen set, when it matches
    if done.is_file():
        data = json.loads(done.read_text())
        if data.get("heads") == new_spec and all(len(v) <= args.limit for v in data["samples"].values()) \
                and len(data.get("random_sets", [])) == args.random:
            results["new"] = {"heads": new_spec, "rows": data["rows"], "verdict": data["verdict"],
                              "random_sets": data["random_sets"], "samples": {t: len(d) for t, d in data["samples"].items()},
                              "from": str(done)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in (("new", new_spec), ("old", args.old)):
            if name in results or spec is None:
                continue
            folder = Path(tmp) / name
            folder.mkdir()
            rows, info = validate(model, heads_file_for(run, spec, folder), top_k, n_random=args.random, limit=args.limit)
            results[name] = {"heads": spec, "rows": [r.__dict__ for r in rows], "verdict": info["verdict"],
                             "random_sets": info["random_sets"], "samples": {t: len(d) for t, d in info["samples"].items()}}
    target, controls = hf.meta["task"], list(hf.meta.get("controls") or [])
    old = {(r["task"], r["metric"]): r for r in results["old"]["rows"]} if "old" in results else None
    lines = [f"# Selectivity: {target}, old vs new heads ({model})", "",
             f"- new (chosen by this run): {new_spec}", f"- old: {args.old or 'none compared'}",
             "- documents per task (held out from the search): "
             + ", ".join(f"{t} {n}" for t, n in results["new"]["samples"].items()), "",
             "| task | role | metric | base | new | change | random-K (new) |"
             + (" old | change | random-K (old) |" if old is not None else ""),
             "|---|---|---|---|---|---|---|" + ("---|---|---|" if old is not None else "")]
    for r in results["new"]["rows"]:
        o = old.get((r["task"], r["metric"])) if old is not None else None
        if r["metric"] == "acc" and r["base"] == 0:
            continue  # no accuracy to speak of (prose)
        lines.append((f"| {r['task']} | {role(r['task'], target, controls)} | {r['metric']} | {r['base']:.4f} | "
                     f"{r['ablated']:.4f} | {pct(r['change_rel'])} | {pct(r['random_change_rel_mean'])} | "
                     + ("" if old is None else f"{o['ablated']:.4f} | {pct(o['change_rel'])} | {pct(o['random_change_rel_mean'])} |"
                            if o else "| | |")).rstrip())
    lines += ["", f"**New:** {results['new']['verdict']['line']}.", ""]
    if "old" in results:
        lines += [f"**Old:** {results['old']['verdict']['line']}.", ""]
    out = Path(args.out)
    atomic_write_text(out, "\n".join(lines))
    atomic_write_json(out.with_suffix(".json"), {"run": str(run), "model": model, **results})
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Replay measure-and-choose from run folders, cut short: what a stop rule would have handed on and saved.

The search (:mod:`capsense.localize.refine`) is deterministic and records every set it measured, in order
(``heads.json``: ``refine.measured``). Stopping it after ``n`` evaluations therefore hands on
:func:`~capsense.localize.refine.choose` over the K-sets among the first ``n``: this is a replay of the real
run, not a simulation. For each run folder it prints when the set finally handed on was first measured and when
it became the choice for good, and, for each patience P, the rule "stop once P evaluations in a row have not
changed the choice": the evaluations and forward-equivalents (prefix reuse's cost,
:func:`~capsense.scoring.cost.mask_cost`) it saves, and whether it hands on the same set.

    python recipes/bench/replay_refine_stop.py RUN [RUN ...] --patience 4,8,12 [--md OUT.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _flat(name: str, n_heads: int) -> int:
    layer, head = name[1:].split("H")
    return int(layer) * n_heads + int(head)


def load_run(folder: Path) -> dict:
    """The run's measured sets (as :class:`SetQuality`), K, layout and the heads its screen set aside."""
    from capsense.localize.head_sets import SetQuality

    heads = json.loads((folder / "heads.json").read_text())
    manifest = json.loads((folder / "manifest.json").read_text())
    ref = heads.get("refine")
    if not ref:
        raise SystemExit(f"{folder}: heads.json has no `refine` section (a run without measure-and-choose)")
    tol = float(ref["tolerance"])
    sets = [SetQuality(tuple(m["heads"]), float(m["target_damage"]), {c: float(v) for c, v in m["control_damage"].items()},
                       tol) for m in ref["measured"]]
    aside = set(ref.get("extra_singles", {}).get("set_aside", []))
    return {"name": folder.name, "sets": sets, "k": len(ref["heads"]), "chosen": tuple(ref["chosen"]["heads"]),
            "layout": manifest["layout"], "aside": aside, "fe": heads.get("forward_equivalents"),
            "within": bool(ref["within_tolerance"])}


def choice_after(run: dict, n: int):
    """The set :func:`choose` hands on from the first ``n`` evaluations (the run's own filter: K-sets, without a
    head the extra singles' screen set aside unless every one holds one)."""
    from capsense.localize.head_sets import choose

    ksets = [q for q in run["sets"][:n] if len(q.heads) == run["k"]]
    kept = [q for q in ksets if not set(q.heads) & run["aside"]] or ksets
    return choose(kept) if kept else None


def replay(run: dict, patience: list[int]) -> dict:
    from capsense.scoring.cost import mask_cost

    n_layers, n_heads = run["layout"]["n_layers"], run["layout"]["n_heads"]
    costs = [mask_cost([_flat(h, n_heads) for h in q.heads], n_layers, n_heads) for q in run["sets"]]
    choices = [choice_after(run, n) for n in range(1, len(run["sets"]) + 1)]
    final = choices[-1]
    first = next(i + 1 for i, q in enumerate(run["sets"]) if set(q.heads) == set(final.heads))
    settled = len(choices)
    while settled > 1 and choices[settled - 2] is not None and set(choices[settled - 2].heads) == set(final.heads):
        settled -= 1
    out = {"name": run["name"], "n": len(run["sets"]), "fe_refine": round(sum(costs), 2), "first": first,
           "settled": settled, "final": final, "rules": {}}
    for p in patience:
        stop, last_change = len(choices), 0
        for i in range(1, len(choices)):
            if choices[i] is None or choices[i - 1] is None or set(choices[i].heads) != set(choices[i - 1].heads):
                last_change = i
            if i - last_change >= p:
                stop = i + 1
                break
        got = choices[stop - 1]
        out["rules"][p] = {"stop": stop, "saved_evals": len(choices) - stop, "saved_fe": round(sum(costs[stop:]), 2),
                           "same": set(got.heads) == set(final.heads), "got": got}
    return out


def _q(q) -> str:
    return f"{', '.join(q.heads)} (target {100 * q.target:+.1f}%, {q.worst()} {100 * q.control:+.1f}%)"


def table(rows: list[dict], patience: list[int]) -> str:
    head = ("| run | sets measured (refine FE) | final choice first measured / settled | "
            + " | ".join(f"P={p}: stop, FE saved, same set" for p in patience) + " |")
    lines = [head, "|" + "---|" * (3 + len(patience))]
    for r in rows:
        cells = [f"{r['name']}", f"{r['n']} ({r['fe_refine']})", f"{r['first']} / {r['settled']}"]
        for p in patience:
            x = r["rules"][p]
            cells.append(f"{x['stop']}, {x['saved_fe']}, " + ("yes" if x["same"] else f"**no**: {_q(x['got'])}"))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"- {r['name']}: handed on {_q(r['final'])}" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--patience", default="4,8,12", help="comma-separated patiences, in evaluations")
    ap.add_argument("--md", type=Path, help="also write the table here")
    args = ap.parse_args(argv)
    patience = [int(p) for p in args.patience.split(",")]
    rows = [replay(load_run(f), patience) for f in args.runs]
    text = table(rows, patience)
    print(text)
    if args.md:
        args.md.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

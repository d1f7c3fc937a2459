"""Measure-and-choose's two searches side by side, from run folders of the same targets.

Each pair of run folders is one target located twice with the same settings but ``refine_search`` (``swaps``
and ``predicted``, see :mod:`capsense.localize.refine`); everything before measure-and-choose is deterministic
and the same in both. The table gives, per run, the run's forward-equivalents, the sets measured (for the predicted search,
how many the prediction proposed and how many the swaps it handed over to, from each set's ``found_by``), why the
search ended, the set handed on, its target damage and its worst control (on the run's documents), and whether
it is within tolerance; a last column says which search handed on the better set by :func:`choose`'s own rule
(within tolerance first, then target damage; with neither within tolerance, the smaller control damage among
sets doing at least half the larger target damage), and which cost fewer forward-equivalents.

    python recipes/bench/compare_refine_searches.py NAME=SWAPS_RUN,PREDICTED_RUN [...] [--md OUT.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(folder: Path) -> dict:
    """What a run folder says of its measure-and-choose."""
    from capsense.localize.head_sets import SetQuality

    heads = json.loads((folder / "heads.json").read_text())
    ref = heads.get("refine")
    if not ref:
        raise SystemExit(f"{folder}: heads.json has no `refine` section (a run without measure-and-choose)")
    c = ref["chosen"]
    return {"fe": float(heads["forward_equivalents"]), "sets": int(ref["n_evaluations"]), "stopped": ref.get("stopped", "?"),
            "search": ref.get("search", "swaps"), "extra": len((ref.get("extra_singles") or {}).get("measured", [])),
            "found_by": [m.get("found_by") for m in ref.get("measured", [])],  # (None in folders before round 31)
            "chosen": SetQuality(tuple(c["heads"]), float(c["target_damage"]),
                                 {k: float(v) for k, v in c["control_damage"].items()}, float(ref["tolerance"]))}


def better(a, b) -> str:
    """Which of two handed-on sets :func:`choose` prefers: "a", "b" or "same" (the same heads)."""
    from capsense.localize.head_sets import choose

    if set(a.heads) == set(b.heads):
        return "same"
    return "a" if choose([a, b]) is a else "b"


def row(name: str, swaps: dict, pred: dict) -> dict:
    if (swaps["search"], pred["search"]) != ("swaps", "predicted"):
        raise SystemExit(f"{name}: give the swaps run first, then the predicted one (got {swaps['search']}, {pred['search']})")
    pick = {"a": "swaps", "b": "predicted", "same": "same set"}[better(swaps["chosen"], pred["chosen"])]
    return {"name": name, "swaps": swaps, "predicted": pred, "better": pick}


def _cell(r: dict) -> str:
    q = r["chosen"]
    worst = q.worst()
    extra = f" (+{r['extra']} singles)" if r["extra"] else ""
    found = r["found_by"]
    if r["search"] == "predicted" and found and None not in found:
        extra += f": {found.count('prediction')} predicted, {found.count('swaps')} by swaps"
    return (f"{r['fe']:.1f} | {r['sets']}{extra} | {r['stopped']} | "
            f"{', '.join(q.heads)}: target {100 * q.target:+.1f}%, {worst} {100 * q.control:+.1f}% | "
            f"{'yes' if q.feasible else 'no'}")


def table(rows: list[dict]) -> str:
    head = ("| target | search | FE | sets | ended | set handed on | within tolerance |\n"
            "|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['name']} | swaps | {_cell(r['swaps'])} |")
        lines.append(f"| | predicted | {_cell(r['predicted'])} |")
    lines.append("")
    for r in rows:
        extra = r["predicted"]["fe"] - r["swaps"]["fe"] + 0.0  # (+ 0.0: no "-0.0" for the same cost)
        lines.append(f"- {r['name']}: better set: {r['better']}; predicted cost {extra:+.1f} FE against swaps")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pairs", nargs="+", help="NAME=SWAPS_RUN,PREDICTED_RUN")
    ap.add_argument("--md", type=Path, help="also write the table here")
    args = ap.parse_args(argv)
    rows = []
    for p in args.pairs:
        name, _, folders = p.partition("=")
        a, _, b = folders.partition(",")
        if not (name and a and b):
            raise SystemExit(f"{p!r}: give NAME=SWAPS_RUN,PREDICTED_RUN")
        rows.append(row(name, load(Path(a)), load(Path(b))))
    text = table(rows)
    print(text)
    if args.md:
        args.md.write_text(text + "\n")


if __name__ == "__main__":
    main()

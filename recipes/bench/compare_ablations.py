"""The same localization under zero and under mean ablation, validated held out: one table of both.

Each pair is a label and two validations of the same target with the same locate and validate settings but
``--ablation`` (``capsense validate``'s ``validation.json``, or a ``selectivity_table.py`` record's ``new``
validation): the zero-ablation run first, the mean-ablation run second. Per run the table gives the set,
the held-out target's change against the random K-head sets', the worst off-target row with its documents, and
the verdict's first clause. Nothing is re-judged: the verdicts are the recorded ones.

    python recipes/bench/compare_ablations.py \\
        "SmolLM2 induction=runs/zero/validate/validation.json,runs/mean/validate/validation.json" [--md OUT.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HEADER = ("| target | ablation | set | held-out target (random sets) | worst off-target (documents) | verdict |\n"
          "|---|---|---|---|---|---|")


def record(path: Path) -> dict:
    """One validation's record: the file itself, or a selectivity record's ``new`` validation."""
    data = json.loads(path.read_text())
    return data if "verdict" in data else data["new"]


def target_cell(rec: dict) -> str:
    """The target's judged change (its metric) and the random sets' mean change of the same row."""
    t = rec["verdict"]["target"]
    row = next((r for r in rec["rows"] if r["task"] == t["task"] and r["metric"] == t["metric"]), None)
    rnd = "" if row is None or row.get("random_change_rel_mean") is None else f" ({100 * row['random_change_rel_mean']:+.1f}%)"
    higher = row.get("higher_is_better") if row is not None else None
    sign = -1 if (higher if higher is not None else t["metric"] in ("acc", "exact_match")) else 1  # a fall in accuracy
    return f"{t['metric']} {t['base']:.3f} -> {t['ablated']:.3f} ({100 * sign * t['worsening']:+.1f}%){rnd}"


def worst_cell(rec: dict) -> str:
    w = rec["verdict"].get("worst")
    if not w:
        return "none"
    docs = "" if w.get("documents_net") is None else f", net {w['documents_net']} of {w['documents']}"
    z = "" if w.get("z") is None else f", z {w['z']:.1f}"
    return f"{w['task']} {w['metric']} {100 * w['worsening']:+.1f}% worse ({w['role']}{docs}{z})"


def verdict_cell(rec: dict) -> str:
    line = rec["verdict"]["line"]
    return line.split(" (")[0].split(";")[0]


def row(label: str, ablation: str, rec: dict) -> str:
    return (f"| {label} | {rec.get('ablation', ablation)} | {rec['heads'].replace('+', ', ')} | {target_cell(rec)} | "
            f"{worst_cell(rec)} | {verdict_cell(rec)} |")


def table(pairs: list[tuple[str, Path, Path]]) -> str:
    lines = [HEADER]
    for label, zero, mean in pairs:
        lines.append(row(label, "zero", record(zero)))
        lines.append(row("", "mean", record(mean)))
    return "\n".join(lines)


def parse_pair(text: str) -> tuple[str, Path, Path]:
    label, _, files = text.partition("=")
    paths = [Path(p) for p in files.split(",")]
    if not label or len(paths) != 2:
        raise SystemExit(f"a pair is LABEL=ZERO.json,MEAN.json, got {text!r}")
    for p in paths:
        if not p.is_file():
            raise SystemExit(f"{p}: no such validation record")
    return label, paths[0], paths[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pairs", nargs="+", help="LABEL=ZERO_VALIDATION.json,MEAN_VALIDATION.json")
    ap.add_argument("--md", type=Path, help="also write the table here")
    args = ap.parse_args()
    text = table([parse_pair(p) for p in args.pairs])
    print(text)
    if args.md:
        args.md.write_text(text + "\n")


if __name__ == "__main__":
    main()

"""Recorded validations judged again with today's selectivity rule, each verdict beside the one it was given.

A validation's rows (base, ablated and random values per task and metric) and its held-out documents are
recorded (``capsense validate``'s ``validation.json``; ``selectivity_table.py``'s ``<out>.json``, one
validation per set), so a change of :func:`capsense.evaluation.selectivity.judge` can be checked against
every recorded run without running a model. The target and the searched controls are read from the
recorded verdict; per file and set the table gives the verdict then and now, and the off-target rows that
fail now but did not then (or the reverse), with their documents and ``z``.

    python recipes/bench/rejudge_validations.py recipes/results/validation_*.json recipes/results/selectivity_*.json \\
        [--md OUT.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def validations(path: Path) -> list[tuple[str, dict]]:
    """(label, one validation's record) for each validation a file holds."""
    data = json.loads(path.read_text())
    if "rows" in data and "verdict" in data:
        return [(path.stem, data)]
    return [(f"{path.stem} ({key})", data[key]) for key in ("new", "old") if isinstance(data.get(key), dict)
            and "rows" in data[key] and "verdict" in data[key]]


def rejudge(record: dict) -> tuple[dict, dict]:
    """(the recorded verdict, today's verdict of the same rows and documents)."""
    from capsense.evaluation.selectivity import judge
    from capsense.evaluation.validate import ValidationRow

    old = record["verdict"]
    target = (old.get("target") or {}).get("task") or record.get("locate_task")
    if target is None:
        raise SystemExit("a recorded verdict without its target: cannot judge it again")
    searched = [r["task"] for r in old["rows"] if r["role"] == "searched"]
    counts = {t: d if isinstance(d, int) else len(d) for t, d in (record.get("samples") or {}).items()}  # ids, or a count
    rows = [ValidationRow(**r) for r in record["rows"]]
    return old, judge(rows, target, searched, old["tolerance"], counts)


def changed_rows(old: dict, new: dict) -> list[str]:
    """Rows that fail under one verdict and not the other, as "task metric worsening (net n of N, z) now fails".
    Each verdict's own ``fails`` is read, not worked out again with today's rule (which would hide the change);
    a row recorded before round 32 has none, and failed by the rule of its time: beyond the tolerance and
    not within the random band."""

    def failing(v):
        return {(r["task"], r["metric"]): r for r in v["rows"]
                if r.get("fails", not r["within_tolerance"] and r.get("within_random") is not True)}

    was, now = failing(old), failing(new)
    out = []
    for key in sorted(set(was) ^ set(now)):
        r = now.get(key) or was[key]
        docs = "" if r.get("documents_net") is None else f" (net {r['documents_net']} of {r['documents']}, z {r['z']:.1f})"
        out.append(f"{key[0]} {key[1]} {100 * r['worsening']:+.1f}%{docs} " + ("now fails" if key in now else "now passes"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--md", type=Path, help="also write the table here")
    args = ap.parse_args()
    lines = ["| validation | verdict recorded | verdict now | rows that changed |", "|---|---|---|---|"]
    for path in args.files:
        for label, record in validations(path):
            old, new = rejudge(record)
            said = ["selective" if v["selective"] else "NOT selective" for v in (old, new)]
            lines.append(f"| {label} | {said[0]} | {said[1]} | {'; '.join(changed_rows(old, new)) or 'none'} |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.md:
        args.md.write_text(text)


if __name__ == "__main__":
    main()

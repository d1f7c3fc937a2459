"""Which recorded validations compared their set with random sets that hold the target's own strongest heads?

    python recipes/bench/random_sets_audit.py recipes/results/validation_*.json recipes/results/selectivity_*.json \\
        --sweeps smollm2-135m:recipes/results/locate_smollm2_sweeps.json \\
        --sweeps gemma3-270m:recipes/results/locate_gemma3_sweeps.json [--md OUT.md]

The selectivity verdict asks whether the target is hurt beyond what K random heads do to it. A random set that
happens to hold one of the target's few decisive heads hurts the target as much as any located set, and with
three random sets one such set makes the band wide enough that no set can be "clearly" beyond it. For every
recorded validation (the files ``rejudge_validations.py`` reads) this lists the random sets, the heads of the
exhaustive single-head sweep's top 5 for the target (zero ablation, ``--sweeps``) each of them holds, and what
each did to the target's accuracy, beside the recorded verdict on the target. It runs no model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rejudge_validations import validations  # noqa: E402


def top_heads(sweep: dict, n: int = 5) -> dict[str, float]:
    """The sweep's ``n`` heads of largest single-head effect on the target, with their effects."""
    eff = sweep["effects"]
    return dict(sorted(eff.items(), key=lambda kv: -kv[1])[:n])


def audit(label: str, record: dict, sweeps: dict[str, dict]) -> dict | None:
    """One validation's random sets against its target's top heads; None where no sweep covers it."""
    target = (record["verdict"].get("target") or {}).get("task") or record.get("locate_task")
    sweep = sweeps.get(record.get("model"), {}).get(target)
    if sweep is None or not record.get("random_sets"):
        return None
    top = top_heads(sweep)
    acc = next((r for r in record["rows"] if r["task"] == target and r["metric"].split(",")[0] == "acc"), None)
    values = acc["random_values"] if acc else [None] * len(record["random_sets"])
    sets = [{"set": s, "top_heads": [h for h in s.split("+") if h in top], "target_acc": v}
            for s, v in zip(record["random_sets"], values)]
    tgt = record["verdict"].get("target") or {}
    hit = tgt and tgt.get("worsening", 0) > record["verdict"].get("tolerance", 0.1) and tgt.get("within_random") is not True
    return {"label": label, "model": record["model"], "target": target, "set": record.get("heads"),
            "set_top_heads": [h for h in str(record.get("heads", "")).split("+") if h in top],
            "base_acc": acc["base"] if acc else None, "set_acc": acc["ablated"] if acc else None,
            "target_hit": bool(hit), "random": sets, "top5": top}


def table(rows: list[dict]) -> str:
    out = ["| validation | target | set's acc (base) | its top-5 heads | random sets: acc, top-5 heads held | target clearly hurt |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        rnd = "; ".join(f"{x['target_acc']:.2f} {'+'.join(x['top_heads']) or '-'}" if x["target_acc"] is not None
                        else f"- {'+'.join(x['top_heads']) or '-'}" for x in r["random"])
        acc = "-" if r["set_acc"] is None else f"{r['set_acc']:.2f} ({r['base_acc']:.2f})"
        out.append(f"| {r['label']} | {r['target']} | {acc} | {'+'.join(r['set_top_heads']) or '-'} | {rnd} | "
                   f"{'yes' if r['target_hit'] else 'no'} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--sweeps", action="append", default=[], help="MODEL:PATH of a recorded sweeps file (repeatable)")
    p.add_argument("--md", type=Path, help="also write the table here")
    args = p.parse_args(argv)
    sweeps = {}
    for spec in args.sweeps:
        model, _, path = spec.partition(":")
        if not path:
            p.error(f"--sweeps takes MODEL:PATH, got {spec!r}")
        sweeps[model] = json.loads(Path(path).read_text())
    rows = [a for f in args.files for label, rec in validations(f) if (a := audit(label, rec, sweeps)) is not None]
    text = table(rows)
    held = [r for r in rows if any(x["top_heads"] for x in r["random"])]
    summary = (f"{len(rows)} validations with a sweep of their target; in {len(held)} a random set holds one of the "
               f"target's top-5 heads; of those, the target was judged clearly hurt in "
               f"{sum(r['target_hit'] for r in held)}.")
    print(text + "\n\n" + summary)
    if args.md:
        from capsense.core.files import atomic_write_text

        atomic_write_text(args.md, text + "\n\n" + summary + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

``--draw-layout 18x4 --draw-head L11H2`` then compares the two draws on a layout: over ``--draw-samples``
random 5-head sets under test, how often one / two or more of the three random sets hold that head, drawn as
``capsense.evaluation.validate.random_head_sets`` draws them (keyed on the seed and the set, round 35) and as
it drew them before (keyed on the seed alone: the same pool positions for every set).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rejudge_validations import validations

from capsense.evaluation.selectivity import DEFAULT_TOLERANCE, target_hit


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
    hit = bool(tgt) and target_hit(tgt.get("worsening"), tgt.get("within_random"),
                                   record["verdict"].get("tolerance", DEFAULT_TOLERANCE))
    return {"label": label, "model": record["model"], "target": target, "set": record.get("heads"),
            "set_top_heads": [h for h in str(record.get("heads", "")).split("+") if h in top],
            "base_acc": acc["base"] if acc else None, "set_acc": acc["ablated"] if acc else None,
            "target_hit": bool(hit), "random": sets, "top5": top}


def _seed_only_draw(n_layers: int, n_heads: int, k: int, count: int, seed: int, avoid) -> list[set]:
    """The draw before round 35, kept here as the comparison: positions from a generator keyed on the seed alone."""
    rng = np.random.default_rng([seed, 17])
    pool = [(l, h) for l in range(n_layers) for h in range(n_heads) if (l, h) not in set(avoid)]
    return [{pool[i] for i in rng.choice(len(pool), size=k, replace=False)} for _ in range(count)]


def draw_shares(n_layers: int, n_heads: int, head: tuple[int, int], samples: int, k: int = 5, count: int = 3) -> dict:
    """Share of ``samples`` random ``k``-head sets under test whose ``count`` random sets hold ``head`` at least
    once / at least twice, under today's draw and the seed-only one."""
    from capsense.core.heads import HeadSet
    from capsense.evaluation.validate import random_head_sets

    rng = np.random.default_rng(0)
    counts = {"keyed": [0, 0], "seed_only": [0, 0]}
    for _ in range(samples):
        flat = rng.choice(n_layers * n_heads, k, replace=False)
        avoid = HeadSet.from_pairs([(int(x) // n_heads, int(x) % n_heads) for x in flat])
        for name, sets in (("keyed", [set(s) for s in random_head_sets(n_layers, n_heads, k, count, 0, avoid)]),
                           ("seed_only", _seed_only_draw(n_layers, n_heads, k, count, 0, avoid))):
            held = sum(head in s for s in sets)
            counts[name][0] += held >= 1
            counts[name][1] += held >= 2
    return {name: {"at_least_one": a / samples, "at_least_two": b / samples} for name, (a, b) in counts.items()}


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
    p.add_argument("--draw-layout", help="LAYERSxHEADS: compare the two random draws on this layout")
    p.add_argument("--draw-head", default="L11H2", help="the head whose presence in the random sets is counted")
    p.add_argument("--draw-samples", type=int, default=3000)
    args = p.parse_args(argv)
    layout = _draw_layout(p, args) if args.draw_layout else None
    sweeps = {}
    for spec in args.sweeps:
        model, _, path = spec.partition(":")
        if not path:
            p.error(f"--sweeps takes MODEL:PATH, got {spec!r}")
        sweeps[model] = json.loads(Path(path).read_text())
    rows = [a for f in args.files for label, rec in validations(f) if (a := audit(label, rec, sweeps)) is not None]
    text = table(rows)
    held = [r for r in rows if any(x["top_heads"] for x in r["random"])]
    rest = [r for r in rows if r not in held]
    summary = (f"{len(rows)} validations with a sweep of their target; in {len(held)} a random set holds one of the "
               f"target's top-5 heads; of those, the target was judged clearly hurt in "
               f"{sum(r['target_hit'] for r in held)}; of the other {len(rest)}, in {sum(r['target_hit'] for r in rest)}.")
    if layout:
        shares = draw_shares(*layout, args.draw_samples)
        summary += "\n\n" + "; ".join(
            f"{name}: {args.draw_head} in at least one of the 3 random sets for {100 * v['at_least_one']:.1f}% of "
            f"{args.draw_samples} sets, in two or more for {100 * v['at_least_two']:.1f}%" for name, v in shares.items())
    print(text + "\n\n" + summary)
    if args.md:
        from capsense.core.files import atomic_write_text

        atomic_write_text(args.md, text + "\n\n" + summary + "\n")
    return 0


def _draw_layout(p: argparse.ArgumentParser, args) -> tuple[int, int, tuple[int, int]]:
    """(layers, heads, head) from ``--draw-layout`` and ``--draw-head``, or one usage error naming both."""
    from capsense.core.heads import HeadSet
    from capsense.errors import CapsenseError

    try:
        n_layers, n_heads = (int(x) for x in args.draw_layout.lower().split("x"))
        (head,) = HeadSet.from_spec(args.draw_head)
    except (ValueError, CapsenseError):
        p.error(f"--draw-layout takes LAYERSxHEADS (18x4) and --draw-head one head (L11H2), "
                f"got {args.draw_layout!r} and {args.draw_head!r}")
    if not (head[0] < n_layers and head[1] < n_heads and args.draw_samples > 0):
        p.error(f"--draw-head {args.draw_head} is outside the {args.draw_layout} layout, or --draw-samples < 1")
    return n_layers, n_heads, (int(head[0]), int(head[1]))


if __name__ == "__main__":
    sys.exit(main())

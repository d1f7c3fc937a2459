"""Does integrating the gradient along a uniform scaling of every head (EAP-IG's path, applied to
head multipliers) rank the exhaustive top 5 better than the gradient at the clean model?

    HF_HUB_OFFLINE=1 python recipes/bench/bench_attribution_ig.py \\
        [--sweeps recipes/results/locate_smollm2_sweeps.json] [--out recipes/results/attribution_ig_smollm2.md]

Per task of the recorded float32 sweeps (same 24 documents, seed 0): the head-multiplier gradient
at every head scaled by a in {1, 0.75, 0.5, 0.25} (3 forward-equivalents each), and estimates
from them: grad@1 (capsense's attribution), the two-point path mean {1, 0.5}, the four-point
mean (a Riemann sum of the path integral), grad@0.75 and grad@0.5 alone. Reports the top-5 hits
(a head within 5% of the fifth-largest exhaustive effect), Spearman over every head, and where
the sweep's true top 5 land in each estimate's ranking (signed, and by |estimate|).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from capsense.core.heads import Head
from capsense.core.models import load_model
from capsense.scoring.attribution import AttributionScorer
from capsense.scoring.probe import build_probe

SCALES = (1.0, 0.75, 0.5, 0.25)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(np.argsort(np.argsort(a)), np.argsort(np.argsort(b)))[0, 1])


def row(label: str, e: np.ndarray, eff: np.ndarray, true: list[int], thr: float) -> dict:
    order, aorder = list(np.argsort(-e)), list(np.argsort(-np.abs(e)))
    return {"estimator": label, "top5_hits": int(sum(eff[h] >= thr * (1 - 1e-9) for h in order[:5])),
            "spearman": round(spearman(e, eff), 3),
            "true_top5_ranks": [order.index(h) + 1 for h in true], "true_top5_abs_ranks": [aorder.index(h) + 1 for h in true]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweeps", type=Path, default=Path("recipes/results/locate_smollm2_sweeps.json"))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=Path("recipes/results/attribution_ig_smollm2.md"))
    a = ap.parse_args()
    sweeps = json.loads(a.sweeps.read_text())
    model, tok = load_model(a.model, "float32", "cpu")
    n_layers, n_heads = model.config.num_hidden_layers, model.config.num_attention_heads
    n = n_layers * n_heads
    lines, rows = [], []
    for task, d in sweeps.items():
        eff = np.array([d["effects"][str(Head.from_index(i, n_heads))] for i in range(n)])
        true = [next(i for i in range(n) if str(Head.from_index(i, n_heads)) == h) for h in d["top5"]]
        sc = AttributionScorer(model, build_probe(task, tok, d["limit"], d["seed"], ()), batch_size=16)
        g = {s: sc.attribute(torch.full((n_layers, n_heads), s)).flat() for s in SCALES}
        for label, e in (("grad@1", g[1.0]), ("path mean {1, 0.5}", (g[1.0] + g[0.5]) / 2),
                         ("path mean, 4 points", sum(g.values()) / len(g)), ("grad@0.75", g[0.75]), ("grad@0.5", g[0.5])):
            rows.append({"task": task, **row(label, e, eff, true, d["hit_threshold"])})
            print(rows[-1], flush=True)
    lines = ["| task | estimator | top-5 hits | Spearman | true top 5: rank (signed) | rank by abs |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['task']} | {r['estimator']} | {r['top5_hits']}/5 | {r['spearman']} | {r['true_top5_ranks']} | "
              f"{r['true_top5_abs_ranks']} |" for r in rows]
    a.out.write_text("\n".join(lines) + "\n")
    a.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

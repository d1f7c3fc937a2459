"""The float32 LM head of a bfloat16 model on CPU: cast per batch vs one kept copy per mask, one run.

    HF_HUB_OFFLINE=1 python recipes/bench/bench_lm_head_copy.py [--model smollm2-135m] [--threads 1] [--repeats 2]

The main job's probes (``recipes/smollm2_induction_cpu.yaml``: induction, 24 documents, and the
default control suite plus arithmetic, 16 each), the model in bfloat16, prefix reuse, the locate
default batch size, one process.
The same masks (clean, a layer-0 head, a middle head, a late head) are evaluated alternately with
each way of computing the float32 logits: ``per batch`` (the scorers called directly, each batch
casting the head's weight as before round 13) and ``kept`` (:class:`MaskEvaluator`, whose call
keeps one float32 copy for all its batches, :func:`capsense.scoring.logits.float32_head`). Prints
seconds per mask both ways and their ratio, and checks the scores are identical. Writes
``recipes/results/lm_head_copy_<model>.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch

CONTROLS = "capsense_facts,capsense_names,capsense_dates,capsense_syntax,capsense_dialogue,capsense_prose,capsense_antonyms,capsense_arithmetic"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from capsense.core.models import load_model
    from capsense.localize.config import LocateConfig
    from capsense.localize.evaluator import MaskEvaluator
    from capsense.scoring.probe import build_probe

    model, tok = load_model(args.model, "bfloat16", "cpu")
    tasks = ["capsense_induction", *CONTROLS.split(",")]
    probes = {t: build_probe(t, tok, 24 if t == "capsense_induction" else 16, 0, ()) for t in tasks}
    ev = MaskEvaluator(model, probes, LocateConfig.batch_size, 1, True)  # the locate default
    n_layers, n_heads = ev.layout.n_layers, ev.layout.n_heads
    heads = {"clean": None, "L0H1": (0, 1), f"L{n_layers // 4}H0": (n_layers // 4, 0), f"L{2 * n_layers // 3}H0": (2 * n_layers // 3, 0)}

    def per_batch(ko):  # what MaskEvaluator.__call__ did before round 13: no kept copy
        return {name: s.score(ko) for name, s in ev.scorers.items()}

    rows = []
    ev(np.zeros((1, n_layers * n_heads), bool))  # the clean capture, so both ways reuse the same prefix
    for label, h in heads.items():
        m = np.zeros((1, n_layers * n_heads), bool)
        if h is not None:
            m[0, h[0] * n_heads + h[1]] = True
        times = {"per batch": [], "kept": []}
        for _ in range(args.repeats):
            t = time.perf_counter()
            a = per_batch(ev.knockouts(m))
            times["per batch"].append(time.perf_counter() - t)
            t = time.perf_counter()
            b = ev(m)
            times["kept"].append(time.perf_counter() - t)
        same = all(float(a[task][k][0]) == b[0][task][k] for task in a for k in a[task])
        row = {"mask": label, **{k: round(min(v), 3) for k, v in times.items()}, "identical_scores": same}
        row["ratio kept / per batch"] = round(row["kept"] / row["per batch"], 3)
        rows.append(row)
        print(row, flush=True)
    out = Path(args.out or f"recipes/results/lm_head_copy_{args.model}.json")
    out.write_text(json.dumps({"model": args.model, "threads": args.threads, "repeats": args.repeats,
                               "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                               "documents": {t: p.n_docs for t, p in probes.items()},
                               "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

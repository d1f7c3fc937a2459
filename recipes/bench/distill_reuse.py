"""Distillation's data-reuse penalty: E passes over N texts against one pass over E x N new texts.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python recipes/bench/distill_reuse.py \\
        [--model smollm2-135m] [--density 0.5] [--epochs 4] [--texts 48] [--arms reused,fresh]

Student: ``--model`` pruned by Wanda (row scope, default calibration) at ``--density``; teacher:
the model itself. Both arms train the same number of steps with the same seed and learning
rate; the *reused* arm reads ``--texts`` texts ``--epochs`` times, the *fresh* arm reads
``--epochs`` x ``--texts`` texts once (each evaluated every ``--texts`` steps). Texts are the
last documents of the repo's tasks (never the probe documents: at 48 x 4 texts every source
still has its first 32 documents untouched). dL per capability against the teacher on the first
``--probes`` documents; :func:`capsense.compress.study.epochs.fit_reuse_penalty` fits the fresh arm
and the decay constant R* of repeated data. Each arm resumes after a kill (its own folder
under ``--work``). Writes ``recipes/results/compress/distill_reuse_<model>.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from capsense.compress.budget import uniform_budget
from capsense.compress.distill import DistillConfig, capability_evaluator, run_distill
from capsense.compress.study.epochs import epoch_fits, fit_reuse_penalty
from capsense.compress.engine import calibrate, compress_model
from capsense.core.files import atomic_write_json
from capsense.core.models import load_model

HERE = Path(__file__).resolve().parents[1]
CAPS = ("math", "code", "qa", "arithmetic", "induction")


def pruned_student(teacher, tok, density: float):
    """The teacher pruned by Wanda at ``density`` (a copy) and its size ratio."""
    student = copy.deepcopy(teacher)
    budget = uniform_budget({"method": "wanda", "density": density})
    stats, _ = calibrate(student, tok, budget)
    return student, compress_model(student, budget, stats).summary["size_ratio"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--density", type=float, default=0.5)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--texts", type=int, default=48)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--probes", type=int, default=32)
    ap.add_argument("--arms", default="reused,fresh")
    ap.add_argument("--work", type=Path, default=Path("/tmp/capsense-distill-reuse"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or set(arms) - {"reused", "fresh"}:
        ap.error(f"--arms takes reused and/or fresh, got {args.arms!r}")
    out = args.out or HERE / "results" / "compress" / f"distill_reuse_{args.model}.json"
    teacher, tok = load_model(args.model)
    evaluate = capability_evaluator(teacher, tok, CAPS, args.probes)
    doc = {"model": args.model, "density": args.density, "probes": args.probes, "arms": {}}
    if out.is_file():  # a finished arm of the same run is kept, not trained again
        old = json.loads(out.read_text())
        if {k: old.get(k) for k in ("model", "density", "probes")} == {k: doc[k] for k in ("model", "density", "probes")}:
            doc = old
    for arm in arms:
        cfg = DistillConfig(student=f"{args.model}+wanda@d{args.density:g}", teacher=args.model, n_texts=args.texts,
                            epochs=args.epochs, lr=args.lr, fresh=arm == "fresh")
        if doc["arms"].get(arm, {}).get("config") == cfg.__dict__:
            print(f"{arm}: recorded in {out}, kept")
            continue
        student, size = pruned_student(teacher, tok, args.density)
        t0 = time.perf_counter()
        records = run_distill(cfg, args.work / f"{args.model}-{arm}", evaluate, overwrite=True,
                              models=(student, teacher, tok))
        doc["size_ratio"] = size
        doc["arms"][arm] = {"config": cfg.__dict__, "epochs": records, "fits": epoch_fits(records),
                            "wall_s_this_call": round(time.perf_counter() - t0, 1)}
        for r in records:
            print(f"{arm} epoch {r['epoch']}: " + "  ".join(f"{c} {v:+.4f}" for c, v in r["dL"].items()))
        atomic_write_json(out, doc)
    if {"reused", "fresh"} <= doc["arms"].keys():
        doc["reuse"] = fit_reuse_penalty(doc["arms"]["reused"]["epochs"], doc["arms"]["fresh"]["epochs"])
        for c, f in doc["reuse"].items():
            print(f"{c}: R* {f['r_star']}  rms {f['rms']}  (no penalty {f['rms_no_penalty']:.4f}); "
                  f"final dL reused {f['final']['reused']:+.4f} fresh {f['final']['fresh']:+.4f}")
    atomic_write_json(out, doc)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()

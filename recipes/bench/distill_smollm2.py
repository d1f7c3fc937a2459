"""Distillation on SmolLM2-135M-Instruct: recover a Wanda-pruned student from the dense teacher.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 flock /tmp/capsense-heavy.lock \\
        python recipes/bench/distill_smollm2.py [--density 0.5] [--epochs 4] [--texts 160] [--dtype bfloat16]

The student is SmolLM2 pruned by Wanda (row scope, default calibration) at ``--density``; the
teacher is SmolLM2 itself. Training text: the last documents of the repo's tasks (never the
probe documents) each followed by 32 tokens the teacher generates, cut to 128 tokens: one fixed
set of unique tokens, passed over ``--epochs`` times. dL per capability (against the teacher, first
``--probes`` documents) before and after each epoch, and the fit dL(E) = d0 + a log(1+E). Resumable:
rerun after a kill. Writes ``recipes/results/compress/distill_smollm2.json`` (``_bfloat16`` before ``.json`` for
``--dtype bfloat16``: the student is pruned in float32, then both models train and are measured in bfloat16, Adam on
float32 masters of the trained matrices; the wall time of the run is recorded with it).
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import torch

from capsense.compress.distill import DistillConfig, capability_evaluator, run_distill
from capsense.compress.study.epochs import epoch_fits
from capsense.core.files import atomic_write_json
from capsense.core.models import TRAIN_DTYPES, load_model
from capsense.core.provenance import cpu_info

HERE = Path(__file__).resolve().parents[1]


def _reuse_bench():
    """``distill_reuse.py`` beside this script: its Wanda student and capability list, so both benches train the same student."""
    spec = importlib.util.spec_from_file_location("distill_reuse", Path(__file__).with_name("distill_reuse.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--density", type=float, default=0.5)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--texts", type=int, default=160)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--probes", type=int, default=32)
    ap.add_argument("--dtype", choices=TRAIN_DTYPES, default="float32")
    ap.add_argument("--work", type=Path, default=None, help="default: /tmp/capsense-distill/student[_DTYPE]")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    suffix = "" if args.dtype == "float32" else f"_{args.dtype}"
    work = args.work or Path(f"/tmp/capsense-distill/student{suffix}")
    out = args.out or HERE / "results" / "compress" / f"distill_smollm2{suffix}.json"
    torch.set_num_threads(2)
    reuse = _reuse_bench()
    teacher, tok = load_model("smollm2-135m")
    student, size_ratio = reuse.pruned_student(teacher, tok, args.density)
    teacher, student = (m.to(getattr(torch, args.dtype)) for m in (teacher, student))
    cfg = DistillConfig(student=f"smollm2-135m+wanda@d{args.density:g}", teacher="smollm2-135m", n_texts=args.texts,
                        epochs=args.epochs, lr=args.lr, dtype=args.dtype)
    start = time.perf_counter()
    evaluate = capability_evaluator(teacher, tok, reuse.CAPS, args.probes)
    records = run_distill(cfg, work, evaluate, overwrite=True, models=(student, teacher, tok))
    fits = epoch_fits(records)
    doc = {"config": cfg.__dict__, "probes": args.probes, "size_ratio": size_ratio, "epochs": records, "fits": fits,
           "wall_s": round(time.perf_counter() - start, 1), "cpu": cpu_info()}
    atomic_write_json(out, doc)
    for r in records:
        print(f"epoch {r['epoch']}: " + "  ".join(f"{c} {v:+.4f}" for c, v in r["dL"].items()))
    for c, f in fits.items():
        print(f"{c}: dL(E) = {f['d0']:+.4f} {f['a']:+.4f} log(1+E)  rms {f['rms']:.4f}")
    print(f"{args.dtype}: {doc['wall_s']} s (the evaluator's teacher pass, the corpus and the epochs; resumed runs count "
          "only this process)")


if __name__ == "__main__":
    main()

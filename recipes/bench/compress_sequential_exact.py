"""Layer-by-layer calibration on a real model, passing the original outputs on, against one pass: bit-identical?

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python recipes/bench/compress_sequential_exact.py --model gemma3-270m \\
        [--method wanda] [--samples 8] [--out recipes/results/compress/seqcal_exact.jsonl]

Wanda at density 0.5 (calibrated, no solver: the check is cheap) on ``--samples`` texts of the default
calibration: the model compressed with one-pass statistics (``collect_stats`` + ``compress_model``) and
with ``compress_sequential(..., "original")`` from the same weights; every tensor of the state dict
compared with ``torch.equal``. On Gemma 3 the layers of its two kinds (sliding, full) take different
position embeddings, so a capture that handed every layer the first layer's arguments would differ.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from capsense.compress.budget import uniform_budget
from capsense.compress.calibration import DEFAULT_CALIBRATION, calibration_samples, collect_stats
from capsense.compress.engine import compress_model, plan
from capsense.compress.sequential import compress_sequential
from capsense.core.files import append_jsonl
from capsense.core.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--method", default="wanda", help="A calibrated method: wanda (density 0.5) or gptq (4 bits, group 64).")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results/compress/seqcal_exact.jsonl")
    args = ap.parse_args()
    torch.set_num_threads(1)
    setting = {"method": "wanda", "density": 0.5} if args.method == "wanda" else {"method": "gptq", "bits": 4, "group_size": 64}
    budget = uniform_budget(setting)
    model, tok = load_model(args.model, dtype="float32")
    samples, _ = calibration_samples(DEFAULT_CALIBRATION, tok, args.samples)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    t0 = time.time()
    compress_model(model, budget, collect_stats(model, [t for t, _ in plan(model, budget)], samples, gram=args.method != "wanda"))
    one_s, one = time.time() - t0, {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(saved)
    t0 = time.time()
    compress_sequential(model, budget, samples, "original")
    seq_s, layered = time.time() - t0, model.state_dict()
    row = {"part": "seqcal-exact", "model": args.model, "setting": setting, "samples": args.samples,
           "sample_tokens": [len(s) for s in samples], "bit_identical": all(torch.equal(one[k], layered[k]) for k in one),
           "max_abs_diff": max((one[k] - layered[k]).abs().max().item() for k in one),
           "one_pass_s": round(one_s, 1), "sequential_original_s": round(seq_s, 1)}
    append_jsonl(args.out, row)
    print(row)


if __name__ == "__main__":
    main()

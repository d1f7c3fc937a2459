"""Why a guided allocation loses to the uniform setting: one factor changed at a time, predicted vs measured.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python recipes/bench/compress_guided_diag.py --model gemma3-270m \\
        --keep math --setting 2 --pricing wanda --probes 16 [--variants uniform,flat8,guided8,guided0,narrow8,narrow0]

Calibrates as ``capsense compress --keep CAP`` does (:func:`capsense.compress.calibration.kept_calibration`),
then per variant: allocate at the uniform setting's size (``Guide`` with the variant's head protection and
level band), compress, and record the kept capability's dL on its held-out probes (the first ``--probes``
documents) and on its calibration documents (the last ``Guide.samples``, the documents the Fisher was
computed on), beside the allocator's own estimate ``estimated_cost / (2 n)`` (the Fisher is a sum of
squared gradients over n samples, so the second-order loss change is half the Fisher-weighted error over n).
Variants: ``uniform`` (no heads, only the uniform level: its estimate is the uniform setting's),
``flat8`` (8 heads protected, their cost spread over the uniform level and the one below), ``guidedK``
(the Fisher allocation, K heads, default band 0.4x-2x), ``narrowK`` (band 0.8x-1.25x).
Rows appended to recipes/results/compress/diag_MODEL.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compress_ship_smollm2 import CAPS, GROUP, doc_nll, keep_settings, peak_rss_mb, restore  # noqa: E402

from capsense.compress.budget import uniform_budget  # noqa: E402
from capsense.compress.calibration import kept_calibration  # noqa: E402
from capsense.compress.capability_loss import build_probes, capability_probe, measure_probe  # noqa: E402
from capsense.compress.engine import calibrate, compress_model  # noqa: E402
from capsense.compress.guided import Guide, guided_budget  # noqa: E402
from capsense.core.files import append_jsonl  # noqa: E402
from capsense.core.models import load_model  # noqa: E402

VARIANTS = {
    "uniform": dict(protect_top_k=0, spread=(1.0, 1.0)),
    "flat8": dict(protect_top_k=8, sensitivity="flat"),
    "guided8": dict(protect_top_k=8),
    "guided0": dict(protect_top_k=0),
    "narrow8": dict(protect_top_k=8, spread=(0.8, 1.25)),
    "narrow0": dict(protect_top_k=0, spread=(0.8, 1.25)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m", choices=sorted(GROUP))
    ap.add_argument("--keep", default="math")
    ap.add_argument("--setting", type=int, default=2, help="Index into keep_settings (gptq 3b, gptq 4b, sparsegpt 0.5).")
    ap.add_argument("--pricing", default=None)
    ap.add_argument("--probes", type=int, default=16)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(__file__).resolve().parents[1] / "results" / "compress" / f"diag_{args.model.split('-')[0]}.jsonl"
    model, tok = load_model(args.model, dtype="float32")
    probes = build_probes(tok, CAPS, args.probes)
    calib_probe = capability_probe(args.keep, tok, 32, use="calibration")
    base, base_cal = doc_nll(model, probes), measure_probe(model, calib_probe).nll
    saved = {k: p.detach().clone() for k, p in model.named_parameters()}
    spec = kept_calibration([args.keep])
    t0 = time.time()
    stats, _ = calibrate(model, tok, uniform_budget({"method": "gptq", "bits": 4}), spec)
    print(f"calibrated in {time.time() - t0:.0f} s on {spec}", flush=True)
    setting = keep_settings(GROUP[args.model])[args.setting]
    cache: dict = {}
    for name in args.variants.split(","):
        kw = dict(VARIANTS[name]) | ({"pricing": args.pricing} if args.pricing else {})
        t0 = time.time()
        alloc = guided_budget(model, tok, uniform_budget(setting), stats, Guide([args.keep], **kw), print, cache)
        t1 = time.time()
        compress_model(model, alloc.budget, stats)
        after, after_cal = doc_nll(model, probes), measure_probe(model, calib_probe).nll
        restore(model, saved)
        levels: dict = {}
        for lab in alloc.info["per_matrix"].values():
            levels[lab] = levels.get(lab, 0) + 1
        row = {"model": args.model, "keep": args.keep, "setting": setting, "variant": name, "guide": {k: list(v) if isinstance(v, tuple) else v for k, v in kw.items()},
               "calibration": spec, "probes": args.probes, "protected_heads": alloc.info["protected_heads"],
               "allocated_bits": alloc.info["allocated_bits"], "target_bits": alloc.info["target_bits"],
               "predicted_dL": alloc.info["estimated_cost"] / (2 * 32), "dL_calib_docs": after_cal - base_cal,
               "dL": {c: after[c][-1] - base[c][-1] for c in CAPS}, "levels": levels,
               "allocate_s": round(t1 - t0, 1), "total_s": round(time.time() - t0, 1), "peak_rss_mb": round(peak_rss_mb())}
        append_jsonl(out, row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""Shippable checkpoints and GPTQ on SmolLM2-135M-Instruct: bytes on disk, reload exactness, GPTQ vs RTN.

    HF_HUB_OFFLINE=1 flock /tmp/capsense-heavy.lock python recipes/bench/compress_ship_smollm2.py \\
        [--probes 32] [--parts pack,guided,dl] [--pack 0,1] [--dl 0,1,2,3] [--out recipes/results/compress/ship_smollm2.jsonl]

``pack``: for RTN and GPTQ at 4 bits, group 64 (128 does not divide SmolLM2's 576-column
matrices, which compressed-tensors refuses), compress in memory and write the checkpoint with the
pipeline's writer (compressed-tensors, bfloat16 elsewhere); record the safetensors bytes against
the bytes ``capsense.json`` accounts, wall time and peak RSS, then reload it with plain
``AutoModelForCausalLM.from_pretrained`` and compare per-document nats/token on the probes with
the in-memory model (its parameters cast to the checkpoint's bfloat16; and as compressed, float32).

``guided``: the same for the ``--keep math`` allocation of each (mixed precision: one config
group per bit width and group size; levels restricted to group sizes that pack).

``dl``: uniform RTN vs GPTQ at equal bits (3 and 4, group 128, in memory): dL (nats/token vs the
base model) on the first ``--probes`` documents of math, code and qa; calibration (the default
prose,math,code,qa set, their last documents) never sees a probe document.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch

from capsense.compress.budget import uniform_budget
from capsense.compress.capability_loss import build_probes, measure_probe
from capsense.compress.engine import calibrate, compress_model
from capsense.compress.packed import size_on_disk
from capsense.compress.pipeline import _write_checkpoint
from capsense.core.files import append_jsonl
from capsense.core.models import load_model

HERE = Path(__file__).resolve().parents[1]
CAPS = ("math", "code", "qa")
PACK = ({"method": "rtn", "bits": 4, "group_size": 64}, {"method": "gptq", "bits": 4, "group_size": 64})
DL = ({"method": "rtn", "bits": 3, "group_size": 128}, {"method": "gptq", "bits": 3, "group_size": 128},
      {"method": "rtn", "bits": 4, "group_size": 128}, {"method": "gptq", "bits": 4, "group_size": 128})


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def doc_nll(model, probes) -> dict[str, list[float]]:
    out = {}
    for c in CAPS:
        m = measure_probe(model, probes[c], c)
        out[c] = [n / max(t, 1) for n, t in zip(m.doc_nats, m.doc_tokens)] + [m.nll]  # per document, then the mean
    return out


def max_delta(a, b) -> dict[str, dict[str, float]]:
    return {c: {"mean": abs(a[c][-1] - b[c][-1]), "max_doc": max(abs(x - y) for x, y in zip(a[c][:-1], b[c][:-1]))}
            for c in CAPS}


def restore(model, saved) -> None:
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.data = saved[k].clone()


def guided(model, tok, stats, setting: dict, keep: str):
    """The ``--keep`` allocation of ``setting`` restricted to packable levels, and its info."""
    from capsense.compress.guided import Guide, guided_budget

    al = guided_budget(model, tok, uniform_budget(setting), stats, Guide([keep], protect_top_k=0), print, packed=True)
    return al.budget, al


def pack_part(model, tok, probes, stats, saved, base, keep: str | None = None, which=(0, 1)):
    """Yields one row per setting, as measured."""
    for setting in (PACK[i] for i in which):
        t0 = time.time()
        budget, allocation = guided(model, tok, stats, setting, keep) if keep else (uniform_budget(setting), None)
        result = compress_model(model, budget, stats)
        seconds = time.time() - t0
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "ckpt"
            t1 = time.time()
            _write_checkpoint(model, tok, "smollm2-135m", budget, result, allocation, out, False, "compressed-tensors")
            write_s = time.time() - t1
            meta = json.loads((out / "capsense.json").read_text())
            from transformers import AutoModelForCausalLM

            loaded = AutoModelForCausalLM.from_pretrained(out).eval()  # plain transformers, bfloat16
            loaded(input_ids=torch.tensor([[1, 2]]))  # compressed-tensors unpacks on the first forward
            reloaded = doc_nll(loaded, probes)
            del loaded
        in_mem32 = doc_nll(model, probes)
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
        in_mem16 = doc_nll(model, probes)
        restore(model, saved)
        yield {
            "part": "guided" if keep else "pack", "setting": result.summary["label"], "keep": keep, "groups": meta["format"]["groups"], "compress_s": round(seconds, 1), "write_s": round(write_s, 1),
            "bytes_on_disk": meta["size"]["bytes_on_disk"], "bytes_accounted": meta["size"]["bytes_accounted"],
            "disk_over_accounted": meta["size"]["bytes_on_disk"] / meta["size"]["bytes_accounted"],
            "size_ratio": result.summary["size_ratio"], "base_model_has_path": "path" in meta["base_model"],
            "reload_vs_memory_bf16": max_delta(reloaded, in_mem16), "reload_vs_memory_fp32": max_delta(reloaded, in_mem32),
            "dL_reloaded": {c: reloaded[c][-1] - base[c][-1] for c in CAPS}, "peak_rss_mb": round(peak_rss_mb()),
        }


def dl_part(model, probes, stats, saved, base, which=(0, 1, 2, 3)):
    """Yields one row per setting, as measured."""
    for setting in (DL[i] for i in which):
        t0 = time.time()
        result = compress_model(model, uniform_budget(setting), stats)
        seconds = time.time() - t0
        after = doc_nll(model, probes)
        restore(model, saved)
        yield {"part": "dl", "setting": result.summary["label"], "compress_s": round(seconds, 1),
               "size_ratio": result.summary["size_ratio"], "dL": {c: after[c][-1] - base[c][-1] for c in CAPS},
               "peak_rss_mb": round(peak_rss_mb())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probes", type=int, default=32)
    ap.add_argument("--parts", default="pack,dl")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pack", default="0,1", help="Indices into PACK (rtn, gptq) for the pack and guided parts.")
    ap.add_argument("--dl", default="0,1,2,3", help="Indices into DL for the dl part.")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "compress" / "ship_smollm2.jsonl",
                    help="JSONL, one line per row, appended as measured.")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    which = [int(i) for i in args.pack.split(",")]
    t0 = time.time()
    model, tok = load_model("smollm2-135m", dtype="float32")
    probes = build_probes(tok, CAPS, args.probes)
    base = doc_nll(model, probes)
    saved = {k: p.detach().clone() for k, p in model.named_parameters()}
    t1 = time.time()
    stats, calib = calibrate(model, tok, uniform_budget({"method": "gptq", "bits": 4}))
    print(f"calibrated in {time.time() - t1:.0f} s on {calib}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def emit(rows) -> None:
        for r in rows:
            append_jsonl(args.out, {"probes": args.probes, **r})
            print(json.dumps(r), flush=True)

    if "pack" in args.parts:
        emit(pack_part(model, tok, probes, stats, saved, base, which=which))
    if "guided" in args.parts:
        emit(pack_part(model, tok, probes, stats, saved, base, keep="math", which=which))
    if "dl" in args.parts:
        emit(dl_part(model, probes, stats, saved, base, [int(i) for i in args.dl.split(",")]))
    print(f"done in {time.time() - t0:.0f} s; appended to {args.out}")


if __name__ == "__main__":
    main()

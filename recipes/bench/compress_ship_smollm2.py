"""Shippable checkpoints, GPTQ and SparseGPT on an embedded model: bytes on disk, reload exactness, GPTQ vs RTN.

    HF_HUB_OFFLINE=1 python recipes/bench/compress_ship_smollm2.py [--model smollm2-135m|gemma3-270m] \\
        [--probes 32] [--parts pack,keep,dl] [--pack 0,1] [--dl 0,1,2,3] \\
        [--keep math,code] [--keep-settings 0,1,2] [--reload] [--parts keepcal] [--out recipes/results/compress/ship_MODEL.jsonl]
    HF_HUB_OFFLINE=1 python recipes/bench/compress_ship_smollm2.py --parts keepcal --keep code --keep-settings 0 \
        --variants guided --calibrate sequential --threads 1 --out recipes/results/compress/seqprop_smollm2_r20.jsonl
    HF_HUB_OFFLINE=1 python recipes/bench/compress_ship_smollm2.py --parts seqcal --dl 3 \\
        --calibrate one-pass|sequential|sequential-original --threads 1 --out recipes/results/compress/seqcal_smollm2.jsonl

Packed group size ``GROUP``: 64 on SmolLM2 (128 does not divide its 576-column matrices, which
compressed-tensors refuses), 128 on Gemma 3 270M (it divides 640, 1024 and 2048).

``pack``: for RTN and GPTQ at 4 bits, the model's packed group, compress in memory and write the
checkpoint with the pipeline's writer (compressed-tensors, bfloat16 elsewhere); record the
safetensors bytes against the bytes ``capsense.json`` accounts, wall time and peak RSS, then reload
it with plain ``AutoModelForCausalLM.from_pretrained`` and compare per-document nats/token on the
probes with the in-memory model (its parameters cast to the checkpoint's bfloat16; and as
compressed, float32).

``keep``: capability-guided rows. For each of ``keep_settings`` (GPTQ 3 and 4 bits at the packed
group, SparseGPT density 0.5; ``--keep-settings`` picks) and each variant at the uniform setting's
exact accounted size: ``uniform``; ``agnostic`` (the allocation priced by the Fisher of generic
prose text, no heads protected: a capability-agnostic control); ``guided:CAP`` for each ``--keep``
capability (what ``capsense compress --keep CAP`` does: the Fisher of CAP's last documents, the
method's default head protection: none for GPTQ, 8 heads for SparseGPT). Each is compressed,
written as the pipeline writes it (GPTQ packed with compressed-tensors, levels restricted to those
that pack; SparseGPT dense, as compressed-tensors has no sparse storage) to record bytes on disk,
and its dL measured in memory (float32) on math, code and qa. How levels are priced:
:mod:`capsense.compress.compensated` (GPTQ: the Fisher-weighted output error of GPTQ's own result,
rows marked ``pricing: gptq-output-error``; earlier rows priced GPTQ by RTN's weight error;
SparseGPT: before round 10 Wanda's weight error, rows marked ``pricing: wanda-weight-error``, since
then by default its own solved output error, ``sparsegpt-output-error``; ``--pricing`` picks; every
row records its ``calibration`` set). ``--reload`` also reloads the guided checkpoints (packed or
dense) with plain transformers and compares them with the in-memory model, float32 and cast to
bfloat16.

``keepcal``: per ``--keep`` CAP, calibrate as ``capsense compress --keep CAP`` does GPTQ and SparseGPT
(the default mix plus CAP: :func:`capsense.compress.calibration.kept_calibration`); ``uniform-kc:CAP``
(the uniform setting so calibrated) and ``guided-kc:CAP`` (since round 11 what ``capsense compress``
ships of the guided allocation(s) and uniform-kc measured on CAP's calibration documents, the lowest dL
(round 12 measured a 2-standard-error margin for the allocation and left it off): row ``selection``).

``--calibrate`` for the keep and keepcal parts: ``one-pass`` (the default, every row before round 20) or one
decoder layer at a time (:mod:`capsense.compress.sequential`), ``sequential`` passing the compressed layers'
outputs on (GPTQ's order), ``sequential-original`` the original ones (the one-pass weights). Layer by layer
a guided variant is what ``capsense compress --keep CAP --sequential [--sequential-propagate compressed]``
does (:mod:`capsense.compress.guided_sequential`: levels priced on the original outputs, each candidate
compressed with the chosen propagation, one shipped); ``uniform`` and ``uniform-kc`` are the uniform setting
compressed the same way (the fair bar for a compressed-propagation guided row). Rows record ``calibrate``.

``seqcal``: GPTQ (``--dl`` indices into DL: 1 = 3 bits, 3 = 4 bits, group 128) calibrated in one pass or one
decoder layer at a time (``--calibrate``; :mod:`capsense.compress.sequential`): wall time, peak RSS and dL
(one mode per process, as the process's peak RSS never falls).

Since round 22 every keep and keepcal row also keeps its probe documents' losses (``probe_losses``: nats and
tokens per document, per capability), so the tables give a kept capability's change vs a bar as a percentage and,
where both rows kept them, as the paired difference with its standard error over the probe documents
(``(+d +- se)``); rows from before carry means only.

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
from capsense.compress.engine import DEFAULT_CALIBRATION, calibrate, compress_model
from capsense.compress.pipeline import _write_checkpoint
from capsense.core.files import append_jsonl
from capsense.core.models import load_model
from capsense.core.provenance import host_info

HERE = Path(__file__).resolve().parents[1]
CAPS = ("math", "code", "qa")
#: Packed group size per model: 128 does not divide SmolLM2's 576 columns (compressed-tensors
#: dequantizes whole groups only); it divides Gemma 3 270M's 640, 1024 and 2048.
GROUP = {"smollm2-135m": 64, "gemma3-270m": 128}


def pack_settings(group: int):
    return ({"method": "rtn", "bits": 4, "group_size": group}, {"method": "gptq", "bits": 4, "group_size": group})


def keep_settings(group: int):
    return ({"method": "gptq", "bits": 3, "group_size": group}, {"method": "gptq", "bits": 4, "group_size": group},
            {"method": "sparsegpt", "density": 0.5})


DL = ({"method": "rtn", "bits": 3, "group_size": 128}, {"method": "gptq", "bits": 3, "group_size": 128},
      {"method": "rtn", "bits": 4, "group_size": 128}, {"method": "gptq", "bits": 4, "group_size": 128})
#: How a guided allocation priced its levels (``Guide.pricing``), per method; GPTQ rows without the field: RTN's.
PRICING = {("gptq", "output"): "gptq-output-error", ("gptq", "rtn"): "rtn-weight-error",
           ("sparsegpt", "output"): "sparsegpt-output-error", ("sparsegpt", "wanda"): "wanda-weight-error"}


def pricing_for(setting, pricing: str | None) -> dict:
    """``{"pricing": pricing}`` for a Guide of ``setting``'s method when that pricing applies to it, else {}."""
    return {"pricing": pricing} if (setting["method"], pricing) in PRICING else {}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure_caps(model, probes) -> dict:
    """Each capability's :class:`~capsense.compress.capability_loss.CapabilityLoss` on its probes."""
    return {c: measure_probe(model, probes[c], c) for c in CAPS}


def per_doc(losses) -> dict[str, list[float]]:
    """Per capability: each document's nats/token, then the token-weighted mean (the last entry)."""
    return {c: [n / max(t, 1) for n, t in zip(m.doc_nats, m.doc_tokens)] + [m.nll] for c, m in losses.items()}


def doc_nll(model, probes) -> dict[str, list[float]]:
    return per_doc(measure_caps(model, probes))


def paired_cell(r, other, cap) -> str:
    """`` (d +- se)``: ``r``'s kept loss minus ``other``'s on the same probe documents with the paired standard
    error (:func:`~capsense.compress.capability_loss.paired_difference`), when both rows kept their documents'
    losses (``probe_losses``, rows since round 22); else empty."""
    from capsense.compress.capability_loss import CapabilityLoss, paired_difference

    if not other or "probe_losses" not in r or "probe_losses" not in other:
        return ""
    diff, se = paired_difference(CapabilityLoss(**other["probe_losses"][cap]), CapabilityLoss(**r["probe_losses"][cap]))
    return f" ({diff:+.4f}" + (f" +- {se:.4f})" if se is not None else ")")


def max_delta(a, b) -> dict[str, dict[str, float]]:
    return {c: {"mean": abs(a[c][-1] - b[c][-1]), "max_doc": max(abs(x - y) for x, y in zip(a[c][:-1], b[c][:-1]))}
            for c in CAPS}


def restore(model, saved) -> None:
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.data = saved[k].clone()


def write_and_reload(model, name, tok, budget, result, allocation, fmt: str, reload: bool, probes=None):
    """Write the checkpoint as the pipeline does: (capsense.json, per-document nats/token of the
    checkpoint reloaded with plain transformers or None, write seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ckpt"
        t1 = time.time()
        _write_checkpoint(model, tok, name, budget, result, allocation, out, False, fmt)
        write_s = time.time() - t1
        meta = json.loads((out / "capsense.json").read_text())
        if not reload:
            return meta, None, write_s
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(out).eval()  # plain transformers, bfloat16
        loaded(input_ids=torch.tensor([[1, 2]]))  # compressed-tensors unpacks on the first forward
        reloaded = doc_nll(loaded, probes)
        del loaded
        return meta, reloaded, write_s


def reload_check(model, saved, reloaded, probes) -> dict:
    """The reloaded checkpoint vs the in-memory model, as compressed (float32) and cast to bfloat16."""
    in_mem32 = doc_nll(model, probes)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    in_mem16 = doc_nll(model, probes)
    restore(model, saved)
    return {"reload_vs_memory_bf16": max_delta(reloaded, in_mem16), "reload_vs_memory_fp32": max_delta(reloaded, in_mem32)}


def pack_part(model, name, tok, probes, stats, saved, base, which=(0, 1)):
    """Yields one row per setting, as measured."""
    for setting in (pack_settings(GROUP[name])[i] for i in which):
        t0 = time.time()
        budget = uniform_budget(setting)
        result = compress_model(model, budget, stats)
        seconds = time.time() - t0
        meta, reloaded, write_s = write_and_reload(model, name, tok, budget, result, None, "compressed-tensors", True, probes)
        yield {
            "part": "pack", "setting": result.summary["label"], "keep": None, "groups": meta["format"]["groups"],
            "compress_s": round(seconds, 1), "write_s": round(write_s, 1),
            "bytes_on_disk": meta["size"]["bytes_on_disk"], "bytes_accounted": meta["size"]["bytes_accounted"],
            "disk_over_accounted": meta["size"]["bytes_on_disk"] / meta["size"]["bytes_accounted"],
            "size_ratio": result.summary["size_ratio"], "base_model_has_path": "path" in meta["base_model"],
            **reload_check(model, saved, reloaded, probes),
            "dL_reloaded": {c: reloaded[c][-1] - base[c][-1] for c in CAPS}, "peak_rss_mb": round(peak_rss_mb()),
        }


def keep_variants(keep: list[str], spread, pricing: dict):
    """(variant name, Guide or None for uniform) of one setting."""
    from capsense.compress.guided import Guide

    tag = "" if spread is None else f"~{spread[0]:g}-{spread[1]:g}"
    extra = ({} if spread is None else {"spread": spread}) | pricing
    yield "uniform", None
    yield "agnostic" + tag, Guide(keep[:1], sensitivity="generic", protect_top_k=0, check_uniform=False, **extra)
    for cap in keep:
        yield f"guided{tag}:{cap}", Guide([cap], **extra)


def keep_part(model, name, tok, probes, stats, saved, base, settings, keep, spread=None, reload=False, variants=None,
              pricing=None, mode="one-pass"):
    """Yields one row per (setting, variant), as measured (see the module docstring); ``mode``: ``--calibrate``
    (``stats``, the one-pass statistics, are None unless one pass)."""
    from capsense.compress.calibration import calibration_samples

    samples = None if mode == "one-pass" else calibration_samples(DEFAULT_CALIBRATION, tok)[0]
    fisher_cache: dict = {}
    for setting in settings:
        for variant, guide in keep_variants(keep, spread, pricing_for(setting, pricing)):
            if variants and not variant.startswith(tuple(variants)):
                continue
            yield keep_row(model, name, tok, probes, stats, saved, base, setting, variant, guide, fisher_cache, reload,
                           mode, samples)


def keepcal_part(model, name, tok, probes, saved, base, settings, keep, reload=False, variants=None, pricing=None,
                 check_docs=None, mode="one-pass"):
    """Per kept capability CAP, calibrated as ``capsense compress --keep CAP`` calibrates a compensating
    method (:func:`~capsense.compress.calibration.kept_calibration`): ``uniform-kc:CAP`` (the uniform
    setting with that calibration: how much is calibration) and ``guided-kc:CAP`` (the guided allocation);
    ``mode``: ``--calibrate`` (one pass, or the samples kept for a layer-by-layer run)."""
    from capsense.compress.calibration import calibration_samples, kept_calibration
    from capsense.compress.guided import Guide

    fisher_cache: dict = {}
    for cap in keep:
        spec = kept_calibration([cap])
        t0 = time.time()
        stats, samples = None, None
        if mode == "one-pass":
            stats, _ = calibrate(model, tok, uniform_budget({"method": "gptq", "bits": 4}), spec)
            print(f"calibrated in {time.time() - t0:.0f} s on {spec}", flush=True)
        else:
            samples, _ = calibration_samples(spec, tok)
        fisher_cache.pop("level_costs", None)  # solved errors and Wanda scores depend on the calibration
        for setting in settings:
            for variant, guide in ((f"uniform-kc:{cap}", None), (f"guided-kc:{cap}", Guide([cap], check_docs=check_docs, **pricing_for(setting, pricing)))):
                if variants and not variant.startswith(tuple(variants)):
                    continue
                row = keep_row(model, name, tok, probes, stats, saved, base, setting, variant, guide, fisher_cache, reload,
                               mode, samples)
                yield {**row, "part": "keepcal", "calibration": spec, "calibrate_s": round(time.time() - t0, 1)}


def keep_row(model, name, tok, probes, stats, saved, base, setting, variant, guide, fisher_cache, reload,
             mode="one-pass", samples=None) -> dict:
    """Allocate (``guide`` None: uniform), compress, measure, write (and with ``reload`` reload) one variant:
    from the one-pass ``stats``, or (``mode`` sequential*) one decoder layer at a time on ``samples`` as
    ``capsense compress --sequential`` does (the module docstring)."""
    from collections import Counter

    from capsense.compress.guided_sequential import guided_candidates_sequential
    from capsense.compress.pipeline import resolve_format
    from capsense.compress.select import compress_guided, guided_candidates
    from capsense.compress.sequential import compress_sequential

    uni = uniform_budget(setting)
    fmt = resolve_format("auto", uni)
    packed = fmt == "compressed-tensors"
    t0 = time.time()
    compress = None  # one pass: compress_model with stats
    if mode == "one-pass":
        allocs = [] if guide is None else guided_candidates(model, tok, uni, stats, guide, print, fisher_cache,
                                                             packed=packed)
    else:
        propagate = "original" if mode == "sequential-original" else "compressed"
        allocs = [] if guide is None else guided_candidates_sequential(model, tok, uni, samples, guide, print, packed)

        def compress(b):
            return compress_sequential(model, b, samples, propagate)
    t1 = time.time()
    result, budget, allocation = compress_guided(model, tok, uni, allocs, stats, guide, print, compress)  # the best, unless told
    t2 = time.time()
    losses = measure_caps(model, probes)
    after = per_doc(losses)
    check = reload and guide is not None and guide.sensitivity == "kept"  # packed (GPTQ) or dense (SparseGPT)
    meta, reloaded, write_s = write_and_reload(model, name, tok, budget, result, allocation, fmt, check, probes)
    row = {
        "part": "keep", "setting": result.summary["label"], "variant": variant, "format": fmt, "calibrate": mode,
        "pricing": _pricing(setting, allocation),
        "keep": guide.keep if guide is not None and guide.sensitivity == "kept" else None,
        "spread": list(guide.spread) if guide is not None else None,
        "protected_heads": allocation.info.get("protected_heads") if allocation else None,
        "levels": dict(Counter(allocation.info["per_matrix"].values())) if allocation else None,  # the allocation's
        "selection": allocation.info.get("selection") if allocation else None,  # and what was shipped
        "groups": meta["format"].get("groups"), "size_ratio": result.summary["size_ratio"],
        "bytes_on_disk": meta["size"]["bytes_on_disk"], "bytes_accounted": meta["size"]["bytes_accounted"],
        "dL": {c: after[c][-1] - base[c][-1] for c in CAPS},
        "probe_losses": {c: m.to_dict(per_doc=True) for c, m in losses.items()},  # for paired differences
        "allocate_s": round(t1 - t0, 1), "compress_s": round(t2 - t1, 1), "write_s": round(write_s, 1),
        "peak_rss_mb": round(peak_rss_mb()),
        "host": host_info(),  # since round 23 (as {cpu, threads} until round 24): dL differs between CPUs
    }
    if reloaded is not None:
        row.update(reload_check(model, saved, reloaded, probes))
        row["dL_reloaded"] = {c: reloaded[c][-1] - base[c][-1] for c in CAPS}
    restore(model, saved)
    return row


def _pricing(setting, allocation) -> str | None:
    """How the allocation priced its levels (None for uniform): ``Guide.pricing`` (capsense.compress.compensated)."""
    if allocation is None:
        return None
    return PRICING.get((setting["method"], allocation.info.get("pricing")))


def keep_table(records) -> str:
    """Markdown: one row per keep-part (setting, variant): bytes on disk, size, dL per capability; a kept
    capability's cell in bold with its change vs uniform and vs the agnostic allocation of the same size."""
    from capsense.core.tables import format_percent, markdown_table, relative_change

    rows = [r for r in records if r.get("part") == "keep"]
    by = {(r["setting"], _priced(r)): r for r in rows}  # the last measurement of each wins
    out = []
    for (setting, variant), r in by.items():
        uni = by.get((setting, "uniform"))
        tag = r["variant"].split(":")[0].removeprefix("guided").removeprefix("agnostic")  # the spread tag, if any
        agn = by.get((setting, "agnostic" + tag + _pricing_tag(r)))
        kept = variant.split(":")[1].split(" ")[0] if ":" in variant else None
        row = {"setting": setting, "variant": variant, "bytes on disk": r["bytes_on_disk"],
               "size ratio": f"{r['size_ratio']:.4f}"}
        for c in CAPS:
            cell = f"{r['dL'][c]:+.3f}"
            if c == kept:
                vs_u = format_percent(relative_change(uni["dL"][c], r["dL"][c])) + paired_cell(r, uni, c) if uni else "-"
                vs_a = format_percent(relative_change(agn["dL"][c], r["dL"][c])) if agn else "-"
                cell = f"**{cell}** ({vs_u} vs uniform, {vs_a} vs agnostic)"
            row[c] = cell
        row["compress s"] = r["compress_s"]
        row["peak RSS MB"] = r["peak_rss_mb"]
        out.append(row)
    return markdown_table(out)


def keepcal_table(records) -> str:
    """Markdown: one row per keepcal-part (setting, variant): the kept capability's dL vs the issue's
    baselines (``uniform`` and the best, for that capability, of the keep part's ``agnostic`` rows however
    priced, default calibration) and, for ``guided-kc``,
    vs ``uniform-kc`` (the same kept-capability calibration: what the allocation adds)."""
    from capsense.core.tables import format_percent, markdown_table, relative_change

    keep = {(r["setting"], _priced(r)): r for r in records if r.get("part") == "keep"}
    # rows whose choice read other than the Fisher's calibration documents (``--check-docs``) are rows of their own
    rows = {(r["setting"], r["variant"] + _check_docs_tag(r), r.get("pricing")): r
            for r in records if r.get("part") == "keepcal"}
    out = []
    for (setting, variant, pricing), r in rows.items():
        cap = variant.split(":")[1].split(" ")[0]  # "guided-kc:code (no uniform check)" keeps code
        kept = r["dL"][cap]
        uni = keep.get((setting, "uniform"))
        agn = min((a for (st, v), a in keep.items() if st == setting and v.split(" ")[0] == "agnostic"),
                  key=lambda a: a["dL"][cap], default=None)
        ukc = rows.get((setting, f"uniform-kc:{cap}", None))

        def vs(other):
            return format_percent(relative_change(other["dL"][cap], kept)) + paired_cell(r, other, cap) if other else "-"

        out.append({"setting": setting, "variant": variant + (f" [{pricing}]" if pricing else ""),
                    "bytes on disk": r["bytes_on_disk"], **{c: f"{r['dL'][c]:+.3f}" for c in CAPS},
                    "kept vs uniform": vs(uni), "kept vs agnostic": vs(agn),
                    "kept vs uniform-kc": vs(ukc) if variant.startswith("guided") else "",
                    "compress s": r["compress_s"]})
    return markdown_table(out)


def _check_docs_tag(r) -> str:
    """`` (N check docs)`` for a row whose choice read other than the Fisher's documents (``Guide.samples``)."""
    from capsense.compress.guided import Guide

    n = (r.get("selection") or {}).get("n_docs")
    return f" ({n} check docs)" if n not in (None, Guide.samples) else ""


def _pricing_tag(r) -> str:
    return f" [{r['pricing']}]" if r.get("pricing") in ("gptq-output-error", "sparsegpt-output-error") else ""


def _priced(r) -> str:
    """The variant's name, marked when GPTQ's levels were priced by GPTQ's own output error."""
    return r["variant"] + _pricing_tag(r)


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


def seqcal_part(model, tok, probes, saved, base, which=(3,), mode="one-pass"):
    """Yields one row per GPTQ setting of ``DL``: calibrated in one pass (``calibrate`` + ``compress_model``)
    or one decoder layer at a time (``compress_sequential``, propagating the compressed or the original
    outputs), on the default calibration (64 texts, up to 512 tokens): wall seconds of calibration and
    compression together, the process's peak RSS before and after (run one mode per process: the peak
    never falls), the Gram bytes held at once, and dL on the probes."""
    from capsense.compress.calibration import calibration_samples, gram_memory
    from capsense.compress.engine import plan
    from capsense.compress.sequential import compress_sequential

    for setting in (DL[i] for i in which):
        budget = uniform_budget(setting)
        targets = [t for t, _ in plan(model, budget)]
        gram_bytes = sum(gram_memory(model, targets, [1, 2, 3], per_layer=mode != "one-pass").values())
        rss_before = peak_rss_mb()
        t0 = time.time()
        if mode == "one-pass":
            stats, _ = calibrate(model, tok, budget)
            result = compress_model(model, budget, stats)
            del stats
        else:
            samples, _ = calibration_samples(DEFAULT_CALIBRATION, tok)
            result = compress_sequential(model, budget, samples, "original" if mode == "sequential-original" else "compressed")
        seconds = time.time() - t0
        rss_after = peak_rss_mb()
        after = doc_nll(model, probes)
        restore(model, saved)
        yield {"part": "seqcal", "setting": result.summary["label"], "calibrate": mode, "threads": torch.get_num_threads(),
               "calibrate_compress_s": round(seconds, 1), "gram_bytes_held": gram_bytes,
               "peak_rss_mb_before": round(rss_before), "peak_rss_mb_after": round(rss_after),
               "size_ratio": result.summary["size_ratio"], "dL": {c: after[c][-1] - base[c][-1] for c in CAPS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(GROUP), help="Embedded model to compress.")
    ap.add_argument("--probes", type=int, default=32)
    ap.add_argument("--parts", default="pack,dl", help="Comma-separated, run in this order: pack, keep, keepcal, dl.")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pack", default="0,1", help="Indices into pack_settings (rtn, gptq) for the pack part.")
    ap.add_argument("--keep", default="math,code", help="Capabilities of the keep part's guided variants.")
    ap.add_argument("--keep-settings", default="0,1,2", help="Indices into keep_settings (gptq 3b, gptq 4b, sparsegpt) for the keep part.")
    ap.add_argument("--variants", default=None, help="Keep part: only the variants whose name starts with one of these.")
    ap.add_argument("--spread", default=None, help="Keep part: size band of the levels, e.g. 0.9,1.7 (default: the Guide's).")
    ap.add_argument("--pricing", default=None, choices=["output", "rtn", "wanda"], help="Keep/keepcal: how levels are priced.")
    ap.add_argument("--reload", action="store_true", help="Keep part: reload the guided packed checkpoints and compare.")
    ap.add_argument("--check-docs", type=int, default=None,
                    help="Keepcal: calibration documents per kept capability the uniform check measures (default: the Fisher's 32).")
    ap.add_argument("--dl", default="0,1,2,3", help="Indices into DL for the dl and seqcal parts.")
    ap.add_argument("--calibrate", default="one-pass", choices=["one-pass", "sequential", "sequential-original"],
                    help="Seqcal, keep and keepcal parts: one pass over the model, or one layer at a time: `sequential` "
                    "passes the compressed layers' outputs on (GPTQ's order), `sequential-original` the original ones "
                    "(capsense's default).")
    ap.add_argument("--out", type=Path, default=None,
                    help="JSONL, one line per row, appended as measured (default: results/compress/ship_MODEL.jsonl).")
    ap.add_argument("--table", action="store_true", help="Only print the keep part's table from --out.")
    args = ap.parse_args()
    if unknown := set(args.parts.split(",")) - {"pack", "keep", "keepcal", "dl", "seqcal"}:
        ap.error(f"--parts {','.join(sorted(unknown))}: valid parts are pack, keep, keepcal, dl, seqcal")
    if args.out is None:
        args.out = HERE / "results" / "compress" / f"ship_{args.model.split('-')[0]}.jsonl"
    if args.table:
        from capsense.core.files import read_jsonl

        records = read_jsonl(args.out)
        print(keep_table(records) + "\n\n" + keepcal_table(records))
        return
    torch.set_num_threads(args.threads)
    which = [int(i) for i in args.pack.split(",")]
    t0 = time.time()
    model, tok = load_model(args.model, dtype="float32")
    probes = build_probes(tok, CAPS, args.probes)
    base = doc_nll(model, probes)
    saved = {k: p.detach().clone() for k, p in model.named_parameters()}
    stats = None
    # keepcal calibrates per kept capability, seqcal per row, a layer-by-layer keep part per layer
    if set(args.parts.split(",")) - {"keepcal", "seqcal"} - ({"keep"} if args.calibrate != "one-pass" else set()):
        t1 = time.time()
        stats, calib = calibrate(model, tok, uniform_budget({"method": "gptq", "bits": 4}))
        print(f"calibrated in {time.time() - t1:.0f} s on {calib}", flush=True)
    calibration = f"{DEFAULT_CALIBRATION} (64 texts, their last documents)"  # calibrate's defaults; keepcal rows record their own
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def emit(rows) -> None:
        for r in rows:
            append_jsonl(args.out, {"probes": args.probes, "calibration": calibration, **r})
            print(json.dumps(r), flush=True)

    spread = tuple(float(x) for x in args.spread.split(",")) if args.spread else None
    parts = {
        "pack": lambda: pack_part(model, args.model, tok, probes, stats, saved, base, which=which),
        "keep": lambda: keep_part(model, args.model, tok, probes, stats, saved, base,
                                  [keep_settings(GROUP[args.model])[int(i)] for i in args.keep_settings.split(",")],
                                  args.keep.split(","), spread, args.reload,
                                  args.variants.split(",") if args.variants else None, args.pricing, args.calibrate),
        "keepcal": lambda: keepcal_part(model, args.model, tok, probes, saved, base,
                                        [keep_settings(GROUP[args.model])[int(i)] for i in args.keep_settings.split(",")],
                                        args.keep.split(","), args.reload,
                                        args.variants.split(",") if args.variants else None, args.pricing,
                                        args.check_docs, args.calibrate),
        "dl": lambda: dl_part(model, probes, stats, saved, base, [int(i) for i in args.dl.split(",")]),
        "seqcal": lambda: seqcal_part(model, tok, probes, saved, base, [int(i) for i in args.dl.split(",")], args.calibrate),
    }
    for part in args.parts.split(","):  # in the order given
        emit(parts[part]())
    print(f"done in {time.time() - t0:.0f} s; appended to {args.out}")


if __name__ == "__main__":
    main()

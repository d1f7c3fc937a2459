"""Capability-guided compression on SmolLM2-135M-Instruct: uniform vs guided at equal size.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 flock /tmp/capsense-heavy.lock \\
        python recipes/bench/compress_guided_smollm2.py [--probes 32] [--keep math,code] [--model gemma3-270m]

Variants, each at the exact size of the uniform setting (bits of the compressed matrices):

* ``uniform``: the plain setting (Wanda density d, or RTN b bits, g128);
* ``first3``: (Wanda only) capability-agnostic layer-wise: layers 0-2 at d+0.3, the rest
  lower to match the size (the issue's trial);
* ``agnostic``: Fisher-guided allocation from generic prose text (no capability, no protection);
* ``protect:<cap>``: the capability's top-8 heads (gradient importance) protected whole, the
  rest uniform with the cost spread over the level below (``flat``);
* ``fisher:<cap>``: Fisher-guided allocation from the capability's text, no protection;
* ``guided:<cap>``: both (what ``capsense compress --keep <cap>`` does);
* ``measured:<cap>``: levels per unit (a layer's attention or MLP) priced by the capability's
  loss measured in the uniformly compressed model (``--sensitivity measured``), no protection.

``--variants uniform,measured`` runs only the variants whose name starts with one of these.

dL (nats/token) on the first ``--probes`` documents of each capability; sensitivities and
heads come from the capability's last 32 documents and Wanda calibrates on the default
calibration set (last documents too), so no probe document chooses the allocation.
Resumable: one JSONL line per (setting, variant, capability), appended as measured.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from capsense.compress.engine import calibrate, compress_model
from capsense.compress.budget import Budget, Override, uniform_budget
from capsense.compress.guided import Guide, guided_budget, target_bits
from capsense.compress.capability_loss import build_probes, measure_probe
from capsense.compress.methods import parse_setting
from capsense.compress.targets import find_targets
from capsense.core.files import append_jsonl, read_jsonl, repair_jsonl_tail
from capsense.core.models import load_model

HERE = Path(__file__).resolve().parents[1]
CAPS = ("math", "code", "qa", "arithmetic", "induction")
SETTINGS = ({"method": "wanda", "density": 0.5}, {"method": "rtn", "bits": 3},
            {"method": "wanda", "density": 0.6}, {"method": "rtn", "bits": 4})


def first_layers_budget(model, base: dict, n_first: int = 3, boost: float = 0.3) -> Budget:
    """Layers ``< n_first`` at density d+boost, the others at the density that keeps the size."""
    s = parse_setting(base)
    targets = find_targets(model)
    goal = target_bits(model, s, targets, None)
    dense_d = min(1.0, s.density + boost)
    first = [t for t in targets if t.layer < n_first]
    rest = [t for t in targets if t.layer >= n_first]
    used = sum(parse_setting({**base, "density": dense_d}).size(t.shape, None, 16)[1] for t in first)
    lo, hi = 0.01, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        bits = sum(parse_setting({**base, "density": mid}).size(t.shape, None, 16)[1] for t in rest)
        lo, hi = (mid, hi) if used + bits <= goal else (lo, mid)
    ov = [Override(layers=set(range(n_first)), setting={"density": dense_d}),
          Override(layers=set(range(n_first, 10_000)), setting={"density": round(lo, 6)})]
    return Budget(default=uniform_budget(base).default, overrides=ov)


def variants(model, tok, base: dict, stats, keep, fisher_cache, spread, tag, top_k=8, measured=("kind", 6, "", 1)):
    """(name, a function returning (budget, info)) for each variant; budgets are built only when needed."""
    uni = uniform_budget(base)

    def guided(caps, sens, k):
        def make():
            g = Guide(caps, sensitivity=sens, protect_top_k=k, spread=spread)
            al = guided_budget(model, tok, uni, stats, g, print, fisher_cache)
            return al.budget, al.info
        return make

    yield "uniform", lambda: (uni, {})
    if base["method"] == "wanda":
        yield "first3", lambda: (first_layers_budget(model, base), {})
    yield f"protect{'' if top_k == 8 else f'k{top_k}'}:" + keep[0], guided(keep[:1], "flat", top_k)
    yield "agnostic" + tag, guided(list(keep[:1]), "generic", 0)
    for cap in keep:
        for name, sens, k in (("guided", "kept", top_k), ("fisher", "kept", 0)):
            yield f"{name}{tag}:{cap}", guided([cap], sens, k)
    for cap in keep[1:]:
        yield f"protect{'' if top_k == 8 else f'k{top_k}'}:" + cap, guided([cap], "flat", top_k)
    unit, n_levels, spread_tag, rounds = measured
    mtag = spread_tag + ("" if unit == "kind" else f"-{unit}") + ("" if n_levels == 6 else f"-n{n_levels}") + (
        "" if rounds == 1 else f"-r{rounds}")
    for cap in keep:
        def make(cap=cap):
            g = Guide([cap], sensitivity="measured", protect_top_k=0, spread=spread, unit=unit, n_levels=n_levels,
                      rounds=rounds)
            al = guided_budget(model, tok, uni, stats, g, print)
            return al.budget, al.info
        yield f"measured{mtag}:{cap}", make


def results_table(records) -> str:
    """Markdown: dL per capability for each (setting, variant), with the size and, for a kept
    capability, its dL change relative to uniform."""
    from capsense.core.tables import format_percent, markdown_table, relative_change

    by = {}
    for r in records:
        by.setdefault((r["setting"], r["variant"]), {})[r["capability"]] = r
    rows = []
    for (setting, variant), caps in by.items():
        uni = by.get((setting, "uniform"), {})
        kept = variant.split(":")[1] if ":" in variant else None
        row = {"setting": setting, "variant": variant, "size": f"{next(iter(caps.values()))['size_ratio']:.4f}"}
        for c in CAPS:
            r = caps.get(c)
            cell = "" if r is None else f"{r['dL']:+.3f}"
            if r is not None and c == kept and c in uni:
                cell = f"**{cell}** ({format_percent(relative_change(uni[c]['dL'], r['dL']))})"
            row[c] = cell
        rows.append(row)
    return markdown_table(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="Embedded model name (or folder); the default --out "
                    "names it when it is not SmolLM2.")
    ap.add_argument("--probes", type=int, default=32)
    ap.add_argument("--keep", default="math,code")
    ap.add_argument("--settings", default="0,1,2,3", help="Indices into SETTINGS, in order.")
    ap.add_argument("--out", type=Path, default=None, help="default: results/compress/guided_smollm2.jsonl, or "
                    "guided_<model>.jsonl for another --model")
    ap.add_argument("--table", action="store_true", help="Only print the results table of --out.")
    ap.add_argument("--spread", default="0.4,2.0", help="Allowed level sizes, as factors of the uniform setting's.")
    ap.add_argument("--spread-rtn", default=None, help="--spread for RTN settings (default: --spread).")
    ap.add_argument("--protect-k", type=int, default=8, help="Heads protected per kept capability.")
    ap.add_argument("--protect-k-rtn", type=int, default=None, help="--protect-k for RTN settings (16-bit heads are dear).")
    ap.add_argument("--variants", default=None, help="Only variants whose name starts with one of these (comma-separated).")
    ap.add_argument("--measured-unit", default="kind", help="measured: unit of allocation (kind or layer).")
    ap.add_argument("--measured-levels", type=int, default=6, help="measured: levels per unit.")
    ap.add_argument("--measured-rounds", type=int, default=1, help="measured: rounds of measuring and allocating.")
    args = ap.parse_args()
    if args.out is None:
        name = "smollm2" if args.model == "smollm2-135m" else Path(args.model).name
        args.out = HERE / "results" / "compress" / f"guided_{name}.jsonl"
    if args.table:
        print(results_table(read_jsonl(args.out)))
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))  # one thread on a shared machine
    keep = args.keep.split(",")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = {r["key"] for r in read_jsonl(args.out)}
    repair_jsonl_tail(args.out)
    model, tok = load_model(args.model, dtype="float32")
    probes = build_probes(tok, CAPS, args.probes)
    base_nll = {}
    for c in CAPS:
        base_nll[c] = measure_probe(model, probes[c], c).nll
    targets = find_targets(model)
    saved = {t.name: t.get().clone() for t in targets}
    chosen = [int(x) for x in args.settings.split(",")]
    stats = {}  # Wanda's calibration, only when a chosen setting needs it
    if any(parse_setting(SETTINGS[i]).calibrated for i in chosen):
        stats, _ = calibrate(model, tok, uniform_budget({"method": "wanda", "density": 0.5}))
    fisher_cache: dict = {}
    for i in chosen:
        base = SETTINGS[i]
        label = parse_setting(base).label
        text = args.spread_rtn if base["method"] == "rtn" and args.spread_rtn else args.spread
        spread = tuple(float(x) for x in text.split(","))
        top_k = args.protect_k_rtn if base["method"] == "rtn" and args.protect_k_rtn is not None else args.protect_k
        spread_tag = "" if spread == (0.4, 2.0) else f"~{spread[0]:g}-{spread[1]:g}"
        tag = spread_tag + ("" if top_k == 8 else f"k{top_k}")
        wanted = tuple(args.variants.split(",")) if args.variants else ("",)
        measured = (args.measured_unit, args.measured_levels, spread_tag, args.measured_rounds)
        for name, make in variants(model, tok, base, stats, keep, fisher_cache, spread, tag, top_k, measured):
            if all(f"{label}|{name}|{c}" in done for c in CAPS) or not name.startswith(wanted):
                continue
            t0 = time.time()
            budget, info = make()
            res = compress_model(model, budget, stats)
            for c in CAPS:
                m = measure_probe(model, probes[c], c)
                rec = {"key": f"{label}|{name}|{c}", "setting": label, "variant": name, "capability": c,
                       "nll": m.nll, "nll0": base_nll[c], "dL": m.nll - base_nll[c], "acc": m.acc,
                       "size_ratio": res.summary["size_ratio"], "target_bits_per_param": res.summary["target_bits_per_param"],
                       "protected_heads": info.get("protected_heads"), "probes": args.probes,
                       **({"per_unit": info["per_unit"]} if "per_unit" in info else {}),
                       **({"measured_costs": info["measured_costs"], "levels": info["levels"]}
                          if "measured_costs" in info and name.endswith(":" + c) else {}),
                       "seconds": round(time.time() - t0, 1)}
                append_jsonl(args.out, rec)
                print(f"{label:14s} {name:16s} {c:10s} dL={rec['dL']:+.4f} size={rec['size_ratio']:.5f}", flush=True)
            for t in targets:
                t.set(saved[t.name])


if __name__ == "__main__":
    main()

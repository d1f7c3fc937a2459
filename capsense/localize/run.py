"""A localization run: ``locate(config)`` loads the model once, turns the target task (and
control tasks) into probes, evaluates the method's knockout masks (resumably, into a run
folder), fits a ranking, measures and chooses the top-K set, and writes the outputs.

**Selective mode** (``controls``; the CLI and recipes default to the ``default`` control suite of
:mod:`capsense.tasks.suite`): every mask is also scored on the control tasks (but prior-guided's
group knockouts, which only decide where to split: target alone) and the solver fits
the target score *residualized on the control scores* (OLS over the same masks), so heads that
hurt everything (early generic heads) drop out of the ranking. The collateral screen
(:mod:`capsense.localize.screen`) then sets aside every head whose measured knockout hurts a
control beyond its noise, and measure-and-choose picks the K-set from the heads left. The
screen costs no evaluation of its own: the suite's probes ride along in every single-head forward (the
forward-equivalent unit is a forward over *all* the run's documents, so a larger suite makes
each unit slower, not the count larger).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from capsense.core.arch import HeadLayout
from capsense.core.distributed import DistContext
from capsense.core.heads import Head
from capsense.core.precision import autocast, autocast_attention, precision_name, search_precision
from capsense.core.progress import Phase, RunProgress
from capsense.localize.config import LocateConfig
from capsense.errors import CapsenseError
from capsense.localize.designs import heads_per_mask
from capsense.localize.evaluator import MaskEvaluator, MaskRunner, task_metric_scorers
from capsense.localize.fit import LocateResult, put_first
from capsense.localize.identity import EARLIER_IDENTITY, identity_keys, run_identity
from capsense.localize.methods import Method, Search, get_method, no_knockout, refine_budget
from capsense.localize.outputs import write_outputs
from capsense.localize.choice import (
    accuracy_line, chosen_accuracy, coverage_step, metric_note, refine_ranking, screen_step, shortfall,
)
from capsense.core.lock import RunFolderLock
from capsense.localize.pool import refine_candidates, single_effects, widener
from capsense.localize.store import REFINE_ROUND, Evaluation, RunStore, check_run_folder, join_probes, recorded_identity
from capsense.scoring import CHOICE_METRICS
from capsense.scoring.attribution import check_gradient_metric
from capsense.scoring.cost import ATTRIBUTION
from capsense.scoring.probe import build_probe, model_max_length
from capsense.scoring.requests import check_accuracy_metric, check_choice_metric

def random_mask_size(cfg: LocateConfig, method: Method, layout: HeadLayout) -> int:
    """Heads per random mask (1 for methods without random masks)."""
    n = layout.n_total
    if not method.random_masks:
        return 1
    if cfg.heads_per_mask is not None and cfg.heads_per_mask > n:
        raise CapsenseError(
            f"`heads_per_mask` {cfg.heads_per_mask} is more than the model's {n} heads "
            f"({layout.n_layers} layers x {layout.n_heads} heads)"
        )
    return heads_per_mask(n, cfg.sparsity, cfg.heads_per_mask)


def run_ablator(cfg: LocateConfig, model, tokenizer, log: Callable[[str], None]):
    """``(means, ablator)`` of the run's ``ablation``: (None, None) for zero (every scorer's own zero
    ablator), else the head means over the reference texts and the one ablator every scorer shares."""
    from capsense.core.ablation import HeadAblator, reference_means

    if cfg.ablation == "zero":
        return None, None
    log(f"mean ablation: head means over {cfg.mean_reference or 'capsense neutral prose'}")
    means = reference_means(model, tokenizer, cfg.ablation, cfg.mean_reference)
    return means, HeadAblator(model, cfg.ablation, means)


def run_manifest(cfg: LocateConfig, fingerprint: dict, dtype: str, k: int, layout: HeadLayout, probes: dict, extra: dict,
                 placed: dict[str, Any]) -> dict[str, Any]:
    """``manifest.json``: what ran, on what, with which versions (the CPU too: float kernels differ by CPU)."""
    from capsense.core.provenance import provenance

    return {
        "capsense_run": "locate",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": fingerprint,
        "layout": layout.to_dict(),
        "task": cfg.task,
        "controls": list(cfg.controls),
        "metric": cfg.metric,
        "heads_per_mask": k,
        "args": {**asdict(cfg), "dtype_resolved": dtype, "batch_size_resolved": placed["batch_size"],
                 "attribution_batch_size_resolved": placed["attribution_batch_size"],
                 "masks_per_forward_resolved": placed["masks_per_forward"],
                 "prefix_reuse_resolved": placed["prefix_reuse"], "refine_dtype_resolved": placed["refine_dtype"],
                 "autocast_attention_resolved": placed["autocast_attention"]},
        "probes": {
            t: {"doc_ids": [int(d) for d in p.doc_ids], "n_requests": p.n_requests, "kind": p.kind, **p.meta}
            for t, p in probes.items()
        },
        "identity": run_identity(cfg, fingerprint, dtype, k, probes, placed["refine_dtype"], placed["autocast_attention"]),
        "task_metric": {
            t: {"metric": cfg.metric, "label": sc.metric.label, "higher_is_better": sc.metric.higher_is_better,
                "scored_by": "lm-eval under each mask (capsense-masked)"}
            for t, sc in extra.items()
        },
        **provenance(placed["device"], device_map=cfg.device_map, processes=placed["processes"]),
    }


def _in_phase(runner: MaskRunner, progress: RunProgress | None, name: str, resumed: int, work: Callable[[], Any]) -> Any:
    """``work()`` as phase ``name`` of ``progress`` (``resumed`` units already in the run folder), timed
    (:attr:`MaskRunner.phase_s`)."""
    if progress is None:
        return runner.timed(name, work)
    with progress.phase(name) as phase:
        phase.update(resumed, resumed=True)
        runner.bar = phase
        try:
            return runner.timed(name, work)
        finally:
            runner.bar = None


def locate_phases(cfg: LocateConfig, n_evaluations: int) -> list[Phase]:
    """The progress phases of a locate: its evaluations, then refine's sets (when it refines)."""
    budget = refine_budget(cfg)
    return [Phase("locate", n_evaluations, "evaluations")] + ([Phase("refine", budget, "sets")] if budget else [])


def _refine_step(runner: MaskRunner, cfg: LocateConfig, layout: HeadLayout, result: LocateResult,
                 evals: list[Evaluation], done: int, log: Callable[[str], None],
                 progress: RunProgress | None, dtypes: tuple[str, str]) -> list[Evaluation]:
    """Measure-and-choose after the method; the chosen set leads the ranking. Returns its evaluations
    (with the heads it measured alone to widen its pool, :mod:`capsense.localize.pool`).
    ``dtypes``: (the search's precision, :func:`~capsense.core.precision.precision_name`; measure-and-choose's
    dtype); when they differ (a bfloat16 search, or a float32 one under autocast) the model is recast in place
    where its dtype changes, the search's prefix caches are dropped, and the clean model is evaluated again in
    the new precision (the base of every set's damage)."""
    n, k = layout.n_total, min(cfg.top_k, layout.n_total)
    ranking = refine_candidates(result, k, cfg.task)
    singles = single_effects(result, cfg, ranking)

    def measure_and_choose() -> tuple:
        base, clean, extra = evals[0], [], []
        if dtypes[1] != dtypes[0]:  # the handed-on set is measured in its own precision, against its own clean model
            runner.evaluate = runner.evaluate.recast(dtypes[1])
            log(f"refine: measuring sets in {dtypes[1]} (the search ran in {dtypes[0]})")
            clean = runner(no_knockout(n), REFINE_ROUND)  # a clean forward's price does not depend on the checks
            runner.evaluate.check_scorers()  # before any set is priced
            base = clean[0]
        found, spent = refine_ranking(runner, cfg, n, base, ranking, singles, widener(runner, cfg, n, base, result, k, extra))
        return found, clean + extra + spent

    result.refinement, spent = _in_phase(runner, progress, "refine", max(0, done - len(evals)), measure_and_choose)
    result.scores = put_first(result.scores, result.refinement.heads)
    result.n_evaluations += len(spent)
    q, name = result.refinement.quality, lambda h: str(Head.from_index(h, layout.n_heads))  # noqa: E731
    if (w := result.refinement.widening) is not None:
        log(f"refine: {w.clean_before} clean heads measured alone, fewer than K + swaps per round = {w.wanted}: "
            f"{len(w.heads)} more measured alone (at most {w.cap}), clean: {', '.join(map(name, w.clean)) or 'none'}")
    log(
        f"refine: {len(result.refinement.measured)} sets measured; chosen "
        + ", ".join(map(name, result.refinement.heads))
        + f" (target {100 * q.target:+.1f}%, worst control {100 * q.control:+.1f}%, tolerance {100 * cfg.tolerance:.1f}%)"
    )
    if (line := shortfall(result.refinement)) is not None:
        log(f"refine: {line}")
    if (acc := chosen_accuracy(cfg, evals + spent, result.refinement.heads)) is not None:
        result.chosen_accuracy = acc
        log(f"refine: {accuracy_line(acc)}")
    return spent



def _display(cfg: LocateConfig, progress: RunProgress | None, n_evaluations: int) -> RunProgress | None:
    """The run's display with locate's counts set, or locate's own (``cfg.progress``), or None."""
    if progress is None:
        return RunProgress(locate_phases(cfg, n_evaluations)) if cfg.progress else None
    progress.set_units("locate", n_evaluations)
    if refine_budget(cfg):
        progress.set_units("refine", refine_budget(cfg))
    return progress


def locate(cfg: LocateConfig, log: Callable[[str], None] = print,
           progress: RunProgress | None = None) -> tuple[LocateResult, Path]:
    """Run (or resume) a localization and write the run folder; returns the result and heads.json.

    ``progress``: the display of a larger run (phases ``locate`` and ``refine``; their counts are
    set here once the model is loaded); by default, with ``cfg.progress``, locate shows its own.
    Launched as several processes (``accelerate launch``), each loads the model on its own
    device and evaluates its share of every block of masks; the main process holds the
    folder's lock, merges the shards, and writes the outputs (see :class:`MaskRunner`).
    """
    import torch

    from capsense.core.arch import head_layout
    from capsense.core.distributed import context
    from capsense.core.models import load_model, model_fingerprint

    ctx = context()
    method = _checked_method(cfg)
    out = Path(cfg.out)
    ctx.on_main(lambda: check_free(out))  # a file, a foreign or a busy folder: refused before the slow load
    device = ctx.device(cfg.device)
    cfg, dtype = _run_precision(cfg, "cuda" if cfg.device_map and torch.cuda.is_available() else device, log if ctx.is_main else _quiet)
    t_load = time.perf_counter()
    model, tokenizer = load_model(cfg.model, dtype, device, revision=cfg.revision, device_map=cfg.device_map)
    layout = head_layout(model)
    n = layout.n_total
    check_processes(ctx.world, method.n_evaluations(cfg, n) - 1)
    k = random_mask_size(cfg, method, layout)
    probes = {t: build_probe(t, tokenizer, cfg.limit_for(t), cfg.seed, cfg.include_path, window=model_max_length(model))
              for t in cfg.tasks}
    if (note := metric_note(cfg, probes[cfg.task])) is not None and ctx.is_main:
        log(note)
    placed = {"device": device, "processes": ctx.world, "autocast_attention": autocast_attention(model, cfg.autocast),
              **_plan_scoring(cfg, model, probes, dtype, log if ctx.is_main else _quiet)}
    means, ablator = run_ablator(cfg, model, tokenizer, log if ctx.is_main else _quiet)
    extra = task_metric_scorers(cfg, model, tokenizer, probes, placed["batch_size"], ablator)
    manifest = run_manifest(cfg, model_fingerprint(cfg.model, cfg.revision), dtype, k, layout, probes, extra, placed)
    lock = RunFolderLock(out)
    try:
        store = open_store(ctx, lock, manifest, identity_keys(cfg), layout.n_heads)
        load_s = time.perf_counter() - t_load
        if store.done and ctx.is_main:
            log(f"Resuming {out}: {len(join_probes(store.evaluations))} masks already evaluated")
        evaluator = MaskEvaluator(model, probes, placed["batch_size"], placed["masks_per_forward"], placed["prefix_reuse"], extra,
                                  ablator)
        runner = MaskRunner(store, evaluator, placed["masks_per_forward"], ctx=ctx)
        runner.extra_cost = ATTRIBUTION if method.attribution else 0.0
        search = Search(runner, cfg, n, k, model=model, tokenizer=tokenizer, probes=probes, log=log if ctx.is_main else _quiet,
                        attribution_batch_size=placed["attribution_batch_size"], means=means)
        t0 = time.perf_counter()
        result = _search_and_refine(runner, search, method, layout, len(store.done), log if ctx.is_main else _quiet,
                                    progress if ctx.is_main else None, own=progress is None and cfg.progress and ctx.is_main,
                                    dtypes=(precision_name(dtype, cfg.autocast, placed["autocast_attention"]),
                                            placed["refine_dtype"]), attention=placed["autocast_attention"])
        record_cost(store.manifest, result, runner, evaluator)
        store.manifest["timing"] = _timing(load_s, time.perf_counter() - t0, runner, result, ctx.world)
        ctx.barrier()  # every process's shard is complete
        return result, ctx.on_main(lambda: _finish(store, cfg, result, layout))
    finally:
        lock.release()


def _run_precision(cfg: LocateConfig, device: str, log: Callable[[str], None]) -> tuple[LocateConfig, str]:
    """The run's settings with the search's precision resolved, and the model's dtype
    (:func:`capsense.core.precision.search_precision`: ``auto`` on one CPU with native bf16 is a float32 model
    searched under bfloat16 autocast; a folder an earlier release's ``auto`` wrote in bfloat16 resumes so)."""
    recorded = recorded_identity(cfg.out)
    dtype, searched = search_precision(cfg.dtype, cfg.autocast, device, cfg.device_map,
                                       (recorded.get("dtype"), recorded.get("autocast")) if recorded else None)
    if searched == cfg.autocast:
        return cfg, dtype
    log(f"dtype auto on this CPU (native bf16): a float32 model whose search runs its products in {searched} "
        "(as --dtype float32 --autocast bfloat16), the sets measured in float32; --dtype bfloat16 loads a bfloat16 model")
    return replace(cfg, dtype=dtype, autocast=searched), dtype


def _checked_method(cfg: LocateConfig) -> Method:
    """``cfg``'s method, once the settings, the device and the metric (against the method and the target task)
    are checked: before the model loads, and before anything is written."""
    from capsense.core.placement import check_placement

    cfg.check()
    check_placement(cfg.device, cfg.device_map)  # exists on this machine
    method = get_method(cfg)
    if method.attribution:
        check_gradient_metric(cfg.metric)
    if cfg.metric in CHOICE_METRICS or cfg.metric == "acc":
        from capsense.tasks.common import tokenizer_from_metadata

        tokenizer = tokenizer_from_metadata({"pretrained": cfg.model, "revision": cfg.revision})
        check_choice_metric(cfg.metric, cfg.task, cfg.include_path, tokenizer)
        if cfg.metric == "acc":  # (the controls too: metric_for scores them by acc)
            check_accuracy_metric(cfg.tasks, cfg.include_path, tokenizer)
    return method


def _plan_scoring(cfg: LocateConfig, model, probes: dict, dtype: str, log: Callable[[str], None]) -> dict[str, Any]:
    """:func:`~capsense.core.placement.plan_scoring` for the run's settings and the requests of its ``probes``."""
    from capsense.core.placement import plan_scoring

    conts = [t for p in probes.values() for t in p.continuation_ids]
    lengths = [len(c) + len(t) for p in probes.values() for c, t in zip(p.context_ids, p.continuation_ids)]
    return plan_scoring(model, cfg.batch_size, lengths, cfg.prefix_reuse, cfg.masks_per_forward, dtype,
                        cfg.resolved_refine_dtype(dtype), refine_asked=cfg.refine_dtype is not None, log=log,
                        scored=max(map(len, conts), default=1),
                        most_requests=max((p.n_requests for p in probes.values()), default=1))


def _search_and_refine(runner: MaskRunner, search: Search, method: Method, layout: HeadLayout, done: int,
                       log: Callable[[str], None], progress: RunProgress | None, own: bool,
                       dtypes: tuple[str, str], attention: str | None = None) -> LocateResult:
    """The method's search and fit, then measure-and-choose, shown as the phases of ``progress``
    (``dtypes``: the search's and measure-and-choose's, see :func:`_refine_step`; ``attention``: the search's
    attention kernel under autocast, :func:`~capsense.core.precision.autocast_attention`)."""
    cfg, n = search.cfg, layout.n_total
    progress = _display(cfg, progress, method.n_evaluations(cfg, n)) if (progress is not None or own) else None
    try:
        with autocast(next(search.model.parameters()).device.type, cfg.autocast, attention):  # the search only
            if not method.attribution:  # (the attribution's methods check after it: guided.run_attribution)
                runner.evaluate.check_scorers()
            found = _in_phase(runner, progress, "locate", done, lambda: method.search(search))
        result = method.fit(found.evals, cfg, n)
        coverage_step(cfg, result, found.evals, layout, log)
        if found.chosen is not None:
            result.scores = put_first(result.scores, found.chosen)
        if cfg.controls:
            screen_step(cfg, result, layout, log)
        if refine_budget(cfg):
            _refine_step(runner, cfg, layout, result, found.evals, done, log, progress, dtypes)
        return result
    finally:
        if own and progress is not None:
            progress.close()


def record_cost(manifest: dict[str, Any], result: LocateResult, runner: MaskRunner, evaluator: MaskEvaluator) -> None:
    """The run's total cost in forward-equivalents, in the result and the manifest."""
    result.forward_equivalents = round(runner.forward_equivalents + runner.extra_cost, 2)
    manifest["forward_equivalents"] = result.forward_equivalents
    manifest["cost_model"] = {
        "unit": "one forward pass over the run's documents (every probe) = 1; a backward pass = 2; "
                "a prefix-reused forward = the fraction of layers it runs; the clean forward = 1 less the share the "
                "gradient attribution's forward already ran",
        "reuse_share": round(evaluator.reuse_share, 4),
        "token_share": {t: round(evaluator.token_share([t]), 6) for t in evaluator.probes},  # a mask scored on some probes costs their share
        "clean_forward_folded": round(evaluator.folded_share, 4),  # the clean forward's share the attribution ran
        "attribution": runner.extra_cost,
    }


def _timing(load_s: float, evaluate_s: float, runner: MaskRunner, result: LocateResult, processes: int) -> dict[str, Any]:
    """This attempt's wall time: the load, then the phases (``search_s`` is the locate phase less the
    attribution; ``checks_s``, the scorers' self-checks, lies within search and refine)."""
    phases = runner.phase_s
    attribution = phases.get("attribution", 0.0)
    return {
        "load_s": round(load_s, 2),
        "evaluate_s_this_attempt": round(evaluate_s, 2),
        "attribution_s": round(attribution, 2),
        "search_s": round(max(0.0, phases.get("locate", 0.0) - attribution), 2),
        "refine_s": round(phases.get("refine", 0.0), 2),
        "checks_s": round(getattr(runner.evaluate, "check_s", 0.0), 2),
        "new_evaluations_this_attempt": runner.new,
        "seconds_per_mask": round(result.seconds_per_mask, 4),
        "processes": processes,
    }


def _finish(store: RunStore, cfg: LocateConfig, result: LocateResult, layout: HeadLayout) -> Path:
    """Main process: one evaluations.jsonl in index order, the manifest, the outputs."""
    store.compact()
    store.write_manifest()
    return write_outputs(store.path, cfg, result, layout, store.manifest)


def check_free(out: Path) -> None:
    """Refuse a file, a foreign folder or a folder another run is writing, creating nothing."""
    check_run_folder(out)
    if out.is_dir():
        RunFolderLock(out).acquire().release()


def check_processes(world: int, masks: int) -> None:
    """Refuse more processes than the run has masks to share (one process needs none: attribution alone)."""
    if world > 1 and world > masks:
        raise CapsenseError(
            f"{world} processes for {masks} masks: at most one process per mask can have work; "
            f"launch at most {masks} processes (accelerate launch --num_processes)"
        )


def open_store(ctx: DistContext, lock: RunFolderLock, manifest: dict, keys: list[str], n_heads: int) -> RunStore:
    """The run folder, opened (locked, compacted) by the main process, then attached by the others."""
    opened: dict[str, RunStore] = {}

    def main() -> None:
        lock.acquire()
        opened["store"] = RunStore.open(lock.folder, manifest, keys, n_heads, EARLIER_IDENTITY)

    ctx.on_main(main)
    return opened["store"] if ctx.is_main else RunStore.attach(lock.folder, n_heads, ctx.rank)


def _quiet(message: str) -> None:
    """The log of processes other than the main one."""

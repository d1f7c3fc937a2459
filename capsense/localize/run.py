"""A localization run: ``locate(config)`` loads the model once, turns the target task (and
control tasks) into probes, evaluates the method's knockout masks (resumably, into a run
folder), fits a ranking, measures and chooses the top-K set, and writes the outputs.

**Selective mode** (``controls``): every mask is also scored on the control tasks and the
solver fits the target score *residualized on the control scores* (OLS over the same
masks), so heads that hurt everything (early generic heads) drop out of the ranking.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from capsense.core.arch import HeadLayout
from capsense.core.heads import Head
from capsense.core.progress import Phase, RunProgress
from capsense.localize.config import LocateConfig, LocateError
from capsense.localize.designs import heads_per_mask
from capsense.localize.evaluator import MaskEvaluator, MaskRunner, task_metric_scorers
from capsense.localize.fit import LocateResult, damage, put_first
from capsense.localize import guided  # noqa: F401  (registers the attribution and prior-guided methods)
from capsense.localize.methods import Method, Search, get_method, refine_budget
from capsense.localize.outputs import write_outputs
from capsense.localize.refine import Refinement, head_set_masks, refine
from capsense.localize.store import REFINE_ROUND, Evaluation, RunStore
from capsense.scoring import METRICS
from capsense.scoring.attribution import check_gradient_metric
from capsense.scoring.cost import ATTRIBUTION
from capsense.scoring.probe import build_probe

#: Settings every run folder is identified by (a method adds its own: :attr:`Method.identity_keys`).
BASE_IDENTITY = ("model", "task", "controls", "limit", "seed", "method", "dtype", "doc_ids")


def identity_keys(cfg: LocateConfig) -> list[str]:
    """The settings that must match for a run folder to be resumed by ``cfg``."""
    keys = [*BASE_IDENTITY, *get_method(cfg).identity_keys]
    if cfg.design == "adaptive":  # its rounds follow from fits of the earlier masks
        keys += ["metric", "solver", "alpha"]
    if cfg.metric not in METRICS:  # the task's own metric is stored beside nll and acc
        keys.append("metric")
    if refine_budget(cfg):  # refine's sets follow from the fit of every earlier mask
        keys += ["masks", "metric", "solver", "alpha", "top_k", "refine", "tolerance"]
    return list(dict.fromkeys(keys))


def library_versions() -> dict[str, str]:
    """Versions of Python and the libraries a run's numbers depend on."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("capsense", "torch", "transformers", "lm_eval", "scikit-learn", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def random_mask_size(cfg: LocateConfig, method: Method, layout: HeadLayout) -> int:
    """Heads per random mask (1 for methods without random masks)."""
    n = layout.n_total
    if not method.random_masks:
        return 1
    if cfg.heads_per_mask is not None and cfg.heads_per_mask > n:
        raise LocateError(
            f"--heads-per-mask {cfg.heads_per_mask} is more than the model's {n} heads "
            f"({layout.n_layers} layers x {layout.n_heads} heads)"
        )
    return heads_per_mask(n, cfg.sparsity, cfg.heads_per_mask)


def run_identity(cfg: LocateConfig, fingerprint: dict, dtype: str, k: int, probes: dict) -> dict[str, Any]:
    """Every setting that may identify a run folder (:func:`identity_keys` picks the ones compared)."""
    return {
        "model": fingerprint.get("content_sha256") or f"{cfg.model}@{fingerprint.get('revision_sha') or fingerprint.get('revision')}",
        "task": cfg.task,
        "controls": list(cfg.controls),
        "limit": cfg.limit,
        "seed": cfg.seed,
        "method": cfg.method,
        "dtype": dtype,
        "design": cfg.design,
        "heads_per_mask": k,
        "top_k": cfg.top_k,
        "masks": cfg.masks,
        "refine": refine_budget(cfg),
        "tolerance": cfg.tolerance,
        "metric": cfg.metric,
        "solver": cfg.solver,
        "alpha": cfg.alpha,
        "doc_ids": {t: [int(d) for d in p.doc_ids] for t, p in probes.items()},
    }


def run_manifest(cfg: LocateConfig, fingerprint: dict, dtype: str, k: int, layout: HeadLayout, probes: dict, extra: dict) -> dict[str, Any]:
    """``manifest.json``: what ran, on what, with which versions."""
    import torch

    return {
        "capsense_run": "locate",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": fingerprint,
        "layout": {"n_layers": layout.n_layers, "n_heads": layout.n_heads, "head_dim": layout.head_dim},
        "task": cfg.task,
        "controls": list(cfg.controls),
        "metric": cfg.metric,
        "heads_per_mask": k,
        "args": {**asdict(cfg), "dtype_resolved": dtype},
        "probes": {
            t: {"doc_ids": [int(d) for d in p.doc_ids], "n_requests": p.n_requests, "kind": p.kind, **p.meta}
            for t, p in probes.items()
        },
        "identity": run_identity(cfg, fingerprint, dtype, k, probes),
        "task_metric": {
            t: {"metric": cfg.metric, "label": sc.metric.label, "higher_is_better": sc.metric.higher_is_better,
                "scored_by": "lm-eval under each mask (capsense-masked)"}
            for t, sc in extra.items()
        },
        "versions": library_versions(),
        "host": {"platform": platform.platform(), "cpu_threads": torch.get_num_threads(), "device": cfg.device},
    }


def refine_ranking(run: MaskRunner, cfg: LocateConfig, n: int, base: Evaluation, ranking: Sequence[int]) -> tuple[Refinement, list[Evaluation]]:
    """Measure and choose the top-K set on the run's documents (see :mod:`capsense.localize.refine`)."""
    spent: list[Evaluation] = []

    def measure(sets: list[tuple[int, ...]]) -> list[tuple[float, dict[str, float]]]:
        evs = run(head_set_masks(sets, n), REFINE_ROUND)
        spent.extend(evs)
        return [
            (float(damage([e], cfg.task, cfg, base)[0]),
             {c: float(damage([e], c, cfg, base)[0]) for c in cfg.controls})
            for e in evs
        ]

    found = refine(ranking, min(cfg.top_k, n), measure, budget=refine_budget(cfg), tolerance=cfg.tolerance)
    return found, spent


def _in_phase(runner: MaskRunner, progress: RunProgress | None, name: str, resumed: int, work: Callable[[], Any]) -> Any:
    """``work()`` as phase ``name`` of ``progress`` (``resumed`` units already in the run folder)."""
    if progress is None:
        return work()
    with progress.phase(name) as phase:
        phase.update(resumed, resumed=True)
        runner.bar = phase
        try:
            return work()
        finally:
            runner.bar = None


def locate_phases(cfg: LocateConfig, n_evaluations: int) -> list[Phase]:
    """The progress phases of a locate: its evaluations, then refine's sets (when it refines)."""
    budget = refine_budget(cfg)
    return [Phase("locate", n_evaluations, "evaluations")] + ([Phase("refine", budget, "sets")] if budget else [])


def _refine_step(runner: MaskRunner, cfg: LocateConfig, layout: HeadLayout, result: LocateResult,
                 evals: list[Evaluation], done: int, log: Callable[[str], None],
                 progress: RunProgress | None) -> list[Evaluation]:
    """Measure-and-choose after the method; the chosen set leads the ranking. Returns its evaluations."""
    n = layout.n_total
    result.refinement, spent = _in_phase(runner, progress, "refine", max(0, done - len(evals)),
                                         lambda: refine_ranking(runner, cfg, n, evals[0], result.scores.rank))
    result.scores = put_first(result.scores, result.refinement.heads)
    result.n_evaluations += len(spent)
    q = result.refinement.quality
    log(
        f"refine: {len(spent)} sets measured; chosen "
        + ", ".join(str(Head.from_index(h, layout.n_heads)) for h in result.refinement.heads)
        + f" (target {100 * q.target:+.1f}%, worst control {100 * q.control:+.1f}%, tolerance {100 * cfg.tolerance:.1f}%)"
    )
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
    """
    from capsense.core.arch import head_layout
    from capsense.core.models import load_model, model_fingerprint, resolve_dtype

    cfg.check()
    method = get_method(cfg)
    if method.attribution:  # before anything is written
        check_gradient_metric(cfg.metric)
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise LocateError(f"--out {str(out)!r} is a file, not a run folder")
    dtype = resolve_dtype(cfg.dtype, cfg.device)
    t_load = time.perf_counter()
    model, tokenizer = load_model(cfg.model, dtype, cfg.device, revision=cfg.revision)
    layout = head_layout(model)
    n = layout.n_total
    k = random_mask_size(cfg, method, layout)
    probes = {t: build_probe(t, tokenizer, cfg.limit, cfg.seed, cfg.include_path) for t in cfg.tasks}
    extra = task_metric_scorers(cfg, model, tokenizer, probes)
    manifest = run_manifest(cfg, model_fingerprint(cfg.model, cfg.revision), dtype, k, layout, probes, extra)
    store = RunStore.open(out, manifest, identity_keys(cfg), layout.n_heads)
    load_s = time.perf_counter() - t_load
    done = len(store.evaluations)
    if done:
        log(f"Resuming {out}: {done} masks already evaluated")
    evaluator = MaskEvaluator(model, probes, cfg.batch_size, cfg.masks_per_forward, cfg.prefix_reuse, extra)
    runner = MaskRunner(store, evaluator, cfg.masks_per_forward)
    search = Search(runner, cfg, n, k, model=model, tokenizer=tokenizer, probes=probes, log=log)
    runner.extra_cost = ATTRIBUTION if method.attribution else 0.0
    t0 = time.perf_counter()
    own = progress is None and cfg.progress
    progress = _display(cfg, progress, method.n_evaluations(cfg, n))
    try:
        found = _in_phase(runner, progress, "locate", done, lambda: method.search(search))
        result = method.fit(found.evals, cfg, n)
        if found.chosen is not None:
            result.scores = put_first(result.scores, found.chosen)
        spent = _refine_step(runner, cfg, layout, result, found.evals, done, log, progress) if refine_budget(cfg) else []
    finally:
        if own and progress is not None:
            progress.close()
    result.forward_equivalents = round(runner.forward_equivalents + runner.extra_cost, 2)
    store.manifest["forward_equivalents"] = result.forward_equivalents
    store.manifest["cost_model"] = {
        "unit": "one forward pass over the run's documents (every probe) = 1; a backward pass = 2; "
                "a prefix-reused forward = the fraction of layers it runs",
        "reuse_share": round(evaluator.reuse_share, 4),
        "attribution": runner.extra_cost,
    }
    store.manifest["timing"] = {
        "load_s": round(load_s, 2),
        "evaluate_s_this_attempt": round(time.perf_counter() - t0, 2),
        "new_evaluations_this_attempt": max(0, len(found.evals) + len(spent) - done),
        "seconds_per_mask": round(result.seconds_per_mask, 4),
    }
    store.write_manifest()
    return result, write_outputs(out, cfg, result, layout, store.manifest)

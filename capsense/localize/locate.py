"""Localization: which heads a capability depends on, by compressed sensing or a baseline.

``locate(config)`` loads the model once, turns the target task (and control tasks) into
probes, evaluates knockout masks (resumably, into a run folder) and fits a ranking:

* ``cs`` (default): random masks from a design (balanced, Bernoulli or adaptive), each
  scored on every probe, and a sparse regression (:mod:`capsense.localize.solvers`) of the score on
  the 0/1 knockout matrix. This follows "compressed sensing" localization of LLM
  capabilities (knock out ~2% of heads per mask, 100 masks, 100 samples, Lasso alpha 0.01).
* ``exhaustive``: every head knocked out alone (with prefix reuse: the forward starts at
  the ablated layer from cached clean activations);
* ``greedy``: the exhaustive sweep, then heads added one at a time to the knocked-out set,
  each round choosing the candidate whose addition hurts most;
* ``thompson``: Thompson sampling on a Bayesian linear model of head effects: each mask
  knocks out the heads a posterior draw ranks most damaging.

**Selective mode** (``controls``): every mask is also scored on the control tasks and the
solver fits the target score *residualized on the control scores* (OLS over the same
masks), so heads that hurt everything (early generic heads) drop out of the ranking.
"""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from capsense.errors import CapsenseError
from capsense.localize.designs import ADAPTIVE_ROUND, DESIGNS, adaptive_round, balanced_design, bernoulli_design, heads_per_mask
from capsense.localize.refine import DEFAULT_BUDGET, DEFAULT_TOLERANCE, Refinement, head_set_masks, refine
from capsense.localize.solvers import SOLVERS, HeadScores, make_solver, residualize, ridge_effects, standardize
from capsense.core.placement import auto_masks_per_forward
from capsense.localize.lock import RunFolderLock
from capsense.localize.runner import MaskRunner
from capsense.localize.store import REFINE_ROUND, Evaluation, RunStore, check_run_folder

METHODS = ("cs", "exhaustive", "greedy", "thompson")
METRICS = ("nll", "acc")
DTYPES = ("auto", "float32", "bfloat16", "float16")


class LocateError(CapsenseError):
    """Bad settings for a localization run."""


@dataclass
class LocateConfig:
    """Every setting of a localization run (defaults follow the paper where they fit)."""

    model: str
    task: str
    out: str
    controls: list[str] = field(default_factory=list)
    metric: str = "nll"
    limit: int | None = 100  # paper: 100 samples per mask
    masks: int = 100  # paper: 100 masks
    sparsity: float | None = 0.02  # paper: ~2% of heads per mask
    heads_per_mask: int | None = None
    design: str = "balanced"
    solver: str = "lasso"
    alpha: float | None = None  # paper: 0.01
    method: str = "cs"
    seed: int = 0
    batch_size: int = 16
    masks_per_forward: int | None = None  # None: automatic (1 on CPUs, from free memory on GPUs)
    device: str = "cpu"
    device_map: str | None = None  # spread the model over devices (capsense.core.placement): auto, or a map
    dtype: str = "auto"
    include_path: list[str] = field(default_factory=list)
    revision: str | None = None
    top_k: int = 5  # heads in the set the run hands on (greedy's rounds, refine's set)
    refine: int | None = None  # measure-and-choose budget; None = refine.DEFAULT_BUDGET with controls, else 0
    tolerance: float = DEFAULT_TOLERANCE
    prefix_reuse: bool = True
    progress: bool = True
    confirm_run_unsafe_code: bool = False  # tasks that run model-written code (lm-eval asks the same)
    task_metric_higher_is_better: bool = True  # set by locate from the task when --metric is the task's own

    def check(self) -> None:
        """Raise :class:`LocateError` for settings that are wrong before any model is loaded."""
        def choice(name: str, value: str, valid: Sequence[str]) -> None:
            if value not in valid:
                raise LocateError(f"unknown {name} {value!r}: valid values are {', '.join(valid)}")

        choice("method", self.method, METHODS)
        choice("design", self.design, DESIGNS)
        choice("solver", self.solver, SOLVERS)
        choice("dtype", self.dtype, DTYPES)
        if not self.metric or not isinstance(self.metric, str):
            raise LocateError(
                "give a metric: nll (nats/token of the reference continuation, the default), acc (greedy "
                "exact match, or multiple-choice accuracy) or one of the target task's own lm-eval metrics"
            )
        if self.heads_per_mask is None and (self.sparsity is None or not 0 < self.sparsity < 1):
            raise LocateError(f"--sparsity must be strictly between 0 and 1, got {self.sparsity}")
        if self.heads_per_mask is not None and self.heads_per_mask < 1:
            raise LocateError(f"--heads-per-mask must be at least 1, got {self.heads_per_mask}")
        if self.masks < 2:
            raise LocateError(f"--masks must be at least 2, got {self.masks}")
        if self.limit is not None and self.limit < 1:
            raise LocateError(f"--limit must be at least 1, got {self.limit}")
        if self.task in self.controls:
            raise LocateError(f"the target task {self.task!r} is also listed as a control")
        if len(set(self.controls)) != len(self.controls):
            raise LocateError(f"duplicate control tasks in {self.controls}")
        if self.alpha is not None and self.alpha <= 0:
            raise LocateError(f"--alpha must be positive, got {self.alpha}")
        if self.top_k < 1:
            raise LocateError(f"--top-k must be at least 1, got {self.top_k}")
        if self.refine is not None and self.refine < 0:
            raise LocateError(f"--refine must be 0 (off) or a number of evaluations, got {self.refine}")
        if self.refine and self.method == "greedy":
            raise LocateError("--refine does not apply to --method greedy, which measures its own top-K set")
        if not self.tolerance >= 0:
            raise LocateError(f"--tolerance must be a relative worsening >= 0 (0.03 = 3%), got {self.tolerance}")
        if self.masks_per_forward is not None and self.masks_per_forward < 1:
            raise LocateError(f"--masks-per-forward must be at least 1 (or auto), got {self.masks_per_forward}")
        from capsense.core.placement import check_device, parse_device_map

        parse_device_map(self.device_map) if self.device_map else check_device(self.device)

    def design_masks(self, n: int) -> int:
        """Masks in the method's largest block (what several processes can share)."""
        return n if self.method in ("exhaustive", "greedy") else self.masks

    def metric_for(self, task: str) -> str:
        """The metric ``task`` is scored by: ``metric`` for the target, and for controls too
        when it is a probe metric (nll, acc); a task's own metric (``exact_match``) is the
        target's, so controls then use nll."""
        return self.metric if task == self.task or self.metric in METRICS else "nll"

    def higher_is_better(self, task: str) -> bool:
        m = self.metric_for(task)
        return {"nll": False, "acc": True}.get(m, self.task_metric_higher_is_better)

    @property
    def refine_budget(self) -> int:
        """Evaluations for measure-and-choose: ``refine``, or by default 24 in selective mode."""
        if self.refine is not None:
            return self.refine
        return DEFAULT_BUDGET if self.controls and self.method != "greedy" else 0


def resolve_dtype(dtype: str, device: str) -> str:
    """``auto``: bfloat16 on accelerators and on CPUs with native bf16 (AVX-512 BF16, AMX), else float32."""
    if dtype != "auto":
        return dtype
    if not device.startswith("cpu"):
        return "bfloat16"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    return "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"


# -- probes ------------------------------------------------------------------------------
def build_probe(task: str, tokenizer, limit: int | None, seed: int, include_path: Sequence[str] = (), exclude: Sequence[int] = ()):
    """A probe for any lm-eval task; generation tasks score their reference answer's nats/token.

    Log-likelihood and multiple-choice tasks use their own requests. For ``generate_until``
    tasks (GSM8K-style) the probe pairs each request's prompt with the document's reference
    target: a fast proxy for the task's own generated metric (``acc`` is then greedy exact
    match of the reference, not the task's answer extraction).
    """
    from capsense.scoring.probe import Probe, ProbeError, load_task

    try:
        return Probe.from_task(task, tokenizer, limit=limit, seed=seed, include_path=include_path, exclude=exclude)
    except ProbeError as e:
        if "generate_until" not in str(e):
            raise
    task_obj = load_task(task, include_path, tokenizer)
    docs = task_obj.eval_docs
    order = [int(i) for i in np.random.default_rng(seed).permutation(len(docs)) if int(i) not in set(exclude)]
    doc_ids = order[:limit] if limit else order
    task_obj.build_all_requests(samples=list(doc_ids), rank=0, world_size=1)
    by_rank = sorted(doc_ids)
    delim = task_obj.config.target_delimiter or ""
    pairs, ids = [], []
    for inst in task_obj.instances:
        d = by_rank[inst.doc_id] if inst.doc_id < len(by_rank) else inst.doc_id
        target = task_obj.doc_to_target(docs[d])
        target = target[0] if isinstance(target, list) else target
        pairs.append((inst.args[0], delim + str(target)))
        ids.append(d)
    probe = Probe.from_pairs(task, pairs, tokenizer, doc_ids=ids)
    probe.meta = {"n_task_docs": len(docs), "proxy": "reference answer of a generation task"}
    return probe


def task_metric_scorers(cfg: LocateConfig, model, tokenizer, probes: dict) -> dict:
    """With ``--metric`` one of the target task's own lm-eval metrics (not nll/acc): a scorer that
    runs the task through lm-eval under each mask on the probe's documents (faithful, slow)."""
    if cfg.metric in METRICS:
        return {}
    from capsense.scoring.probe import load_task
    from capsense.scoring.task_metric import TaskMetricScorer, resolve_task_metric

    task_obj = load_task(cfg.task, cfg.include_path, tokenizer)
    scorer = TaskMetricScorer(model, tokenizer, cfg.task, probes[cfg.task].doc_ids, None, cfg.metric,
                              batch_size=cfg.batch_size, include_path=cfg.include_path,
                              confirm_run_unsafe_code=cfg.confirm_run_unsafe_code)
    try:
        try:
            tm = resolve_task_metric(cfg.task, task_obj, cfg.metric)
        except ValueError:  # maybe a name a metric function reports at run time: run the clean model once
            tm = resolve_task_metric(cfg.task, task_obj, cfg.metric, reported=scorer.reported())
    except ValueError as e:
        raise LocateError(str(e)) from None
    scorer.metric = tm
    cfg.task_metric_higher_is_better = tm.higher_is_better
    return {cfg.task: scorer}


# -- evaluation --------------------------------------------------------------------------
class MaskEvaluator:
    """Scores masks (flat head index sets) on every probe with one loaded model."""

    def __init__(self, model, probes: dict, batch_size: int, masks_per_forward: int, prefix_reuse: bool,
                 extra: dict | None = None) -> None:
        from capsense.core.arch import head_layout
        from capsense.scoring.prefix import PrefixReuseScorer
        from capsense.scoring.probe import ProbeScorer
        from capsense.scoring.shared_context import SharedContextScorer, shared_context_groups

        self.layout = head_layout(model)
        def scorer_class(probe):
            if masks_per_forward > 1:
                return ProbeScorer
            if shared_context_groups(probe) is not None:  # multiple choice: each context once per mask
                return SharedContextScorer
            return PrefixReuseScorer if prefix_reuse else ProbeScorer

        self.scorers = {
            name: scorer_class(probe)(model, probe, batch_size=batch_size, masks_per_forward=masks_per_forward)
            for name, probe in probes.items()
        }
        self.extra = dict(extra or {})  # task -> a scorer adding metrics (e.g. TaskMetricScorer)

    def knockouts(self, masks: np.ndarray):
        import torch

        return torch.from_numpy(np.asarray(masks, dtype=bool).reshape(-1, self.layout.n_layers, self.layout.n_heads).copy())

    def __call__(self, masks: np.ndarray) -> list[dict[str, dict[str, float]]]:
        ko = self.knockouts(masks)
        per_task = {name: s.score(ko) for name, s in self.scorers.items()}
        for name, s in self.extra.items():
            per_task[name] = {**per_task.get(name, {}), **s.score(ko)}
        return [
            {name: {k: float(v[i]) for k, v in r.items()} for name, r in per_task.items()} for i in range(len(masks))
        ]


# -- scores and fits ---------------------------------------------------------------------
def design_matrix(evals: Sequence[Evaluation], n: int) -> np.ndarray:
    X = np.zeros((len(evals), n), dtype=bool)
    for i, e in enumerate(evals):
        X[i, e.heads] = True
    return X


def task_scores(evals: Sequence[Evaluation], task: str, cfg: LocateConfig) -> np.ndarray:
    """Score per mask of ``task`` by its metric, signed so that higher = better (``-nll``, ``acc``)."""
    v = np.array([e.scores[task][cfg.metric_for(task)] for e in evals], dtype=float)
    return v if cfg.higher_is_better(task) else -v


def damage(evals: Sequence[Evaluation], task: str, cfg: LocateConfig, base: Evaluation) -> np.ndarray:
    """Relative worsening of ``task``'s metric per mask vs the clean model (+0.2 = 20% worse)."""
    s, s0 = task_scores(evals, task, cfg), float(task_scores([base], task, cfg)[0])
    diff = s0 - s  # signed scores: a drop is damage whichever way the metric points
    return diff / abs(s0) if s0 != 0 else diff


def fit_target(evals: Sequence[Evaluation], cfg: LocateConfig, n: int, selective: bool = True) -> np.ndarray:
    """The vector the solver fits: the target score, residualized on the controls when selective."""
    y = task_scores(evals, cfg.task, cfg)
    if selective and cfg.controls:
        C = np.column_stack([task_scores(evals, c, cfg) for c in cfg.controls])
        y = residualize(y, C)
    return y


@dataclass
class LocateResult:
    """What a run found: ranked head scores (fitted), raw-target scores and per-task damage."""

    scores: HeadScores
    raw_scores: HeadScores | None
    target_effect: np.ndarray
    control_effects: dict[str, np.ndarray]
    n_evaluations: int
    base: dict[str, dict[str, float]]
    seconds_per_mask: float
    refinement: Refinement | None = None


def _single_head_scores(evals: Sequence[Evaluation], y: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Importance from single-head evaluations: standardized score drop vs the clean model."""
    z = standardize(y)
    imp = np.full(n, np.nan)
    for e, zi in zip(evals, z):
        if len(e.heads) == 1:
            imp[e.heads[0]] = z[0] - zi
    seen = ~np.isnan(imp)
    imp[~seen] = (np.nanmin(imp) - 1) if seen.any() else 0.0
    return imp, seen.astype(float)


def summarize(evals: list[Evaluation], cfg: LocateConfig, n: int, single_head: bool = False) -> LocateResult:
    """Fit the ranking and per-head effects from all evaluations of a run."""
    base = evals[0]
    X = design_matrix(evals, n)
    tasks = [cfg.task, *cfg.controls]
    dmg = {t: damage(evals, t, cfg, base) for t in tasks}
    if single_head:
        singles = [e for e in evals if len(e.heads) == 1]
        effects = {t: np.zeros(n) for t in tasks}
        for t in tasks:
            d = damage([base, *singles], t, cfg, base)
            for e, v in zip(singles, d[1:]):
                effects[t][e.heads[0]] = v
        sel = [base, *singles]
        imp, conf = _single_head_scores(sel, fit_target(sel, cfg, n), n)
        scores = HeadScores(imp, conf, imp.copy())
        raw = None
        if cfg.controls:
            r_imp, r_conf = _single_head_scores(sel, fit_target(sel, cfg, n, selective=False), n)
            raw = HeadScores(r_imp, r_conf, r_imp.copy())
    else:
        solver = make_solver(cfg.solver, cfg.alpha, cfg.seed)
        scores = solver.fit(X, fit_target(evals, cfg, n)).scores_
        raw = make_solver(cfg.solver, cfg.alpha, cfg.seed).fit(X, fit_target(evals, cfg, n, False)).scores_ if cfg.controls else None
        effects = {t: ridge_effects(X, dmg[t]) for t in tasks}
    secs = [e.seconds for e in evals if e.seconds > 0]
    return LocateResult(
        scores=scores,
        raw_scores=raw,
        target_effect=effects[cfg.task],
        control_effects={c: effects[c] for c in cfg.controls},
        n_evaluations=len(evals),
        base=base.scores,
        seconds_per_mask=float(np.mean(secs)) if secs else 0.0,
    )


# -- methods -----------------------------------------------------------------------------
def _empty(n: int) -> np.ndarray:
    return np.zeros((1, n), dtype=bool)


def run_cs(run: MaskRunner, cfg: LocateConfig, n: int, k: int) -> list[Evaluation]:
    evals = run(_empty(n))
    if cfg.design == "adaptive":
        imp = conf = None
        r = 0
        while len(evals) - 1 < cfg.masks:
            m = min(ADAPTIVE_ROUND, cfg.masks - (len(evals) - 1))
            X = design_matrix(evals[1:], n)
            masks = adaptive_round(r, m, n, k, cfg.seed, X, imp, conf)
            evals += run(masks, r)
            s = make_solver(cfg.solver, cfg.alpha, cfg.seed).fit(design_matrix(evals, n), fit_target(evals, cfg, n)).scores_
            imp, conf = s.importance, s.confidence
            r += 1
        return evals
    if cfg.design == "balanced":
        masks = balanced_design(cfg.masks, n, k, cfg.seed)
    else:
        masks = bernoulli_design(cfg.masks, n, k / n, cfg.seed)
    return evals + run(masks)


def single_head_masks(n: int) -> np.ndarray:
    """Every head alone, in layer order (prefix reuse then shares each layer's cached input)."""
    return np.eye(n, dtype=bool)


def run_exhaustive(run: MaskRunner, cfg: LocateConfig, n: int) -> list[Evaluation]:
    return run(_empty(n)) + run(single_head_masks(n))


def run_greedy(run: MaskRunner, cfg: LocateConfig, n: int) -> tuple[list[Evaluation], list[int]]:
    """Exhaustive sweep, then grow the knocked-out set one head per round (top candidates only)."""
    evals = run_exhaustive(run, cfg, n)
    imp, _ = _single_head_scores(evals, fit_target(evals, cfg, n), n)
    order = [int(i) for i in np.argsort(-imp, kind="stable")]
    chosen = [order[0]]
    n_cand = min(n - 1, max(20, 4 * cfg.top_k))
    for r in range(1, cfg.top_k):
        cands = [h for h in order if h not in chosen][:n_cand]
        masks = np.zeros((len(cands), n), dtype=bool)
        masks[:, chosen] = True
        for i, h in enumerate(cands):
            masks[i, h] = True
        evals += run(masks, r)
        y = fit_target(evals, cfg, n)[-len(cands):]
        chosen.append(cands[int(np.argmin(y))])
    return evals, chosen


def run_thompson(run: MaskRunner, cfg: LocateConfig, n: int, k: int) -> list[Evaluation]:
    """Warm-up balanced masks, then each mask = the k heads a posterior draw finds most damaging."""
    evals = run(_empty(n))
    warm = min(cfg.masks, max(10, cfg.masks // 5))
    evals += run(balanced_design(warm, n, k, cfg.seed))
    while len(evals) - 1 < cfg.masks:
        mean, cov = _posterior(design_matrix(evals, n), fit_target(evals, cfg, n))
        rng = np.random.default_rng([cfg.seed, 7, len(evals)])
        draw = mean + np.linalg.cholesky(cov + 1e-9 * np.eye(n)) @ rng.standard_normal(n)
        mask = np.zeros((1, n), dtype=bool)
        mask[0, np.argsort(draw, kind="stable")[:k]] = True  # most negative effect = most damaging
        evals += run(mask, len(evals))
    return evals


def _posterior(X: np.ndarray, y: np.ndarray, prior_sd: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Posterior of additive effects ``beta`` in ``z(y) = c + X beta + noise`` (Gaussian prior)."""
    X = X.astype(float)
    z = standardize(y)
    Xc, zc = X - X.mean(0), z - z.mean()
    noise = max(float(np.var(zc)) * 0.5, 1e-3)
    prec = Xc.T @ Xc / noise + np.eye(X.shape[1]) / prior_sd**2
    cov = np.linalg.inv(prec)
    cov = (cov + cov.T) / 2
    return cov @ (Xc.T @ zc) / noise, cov


def thompson_scores(evals: Sequence[Evaluation], y: np.ndarray, n: int) -> HeadScores:
    """Posterior mean importance (= -effect) and P(effect < 0) as confidence."""
    from scipy.stats import norm

    mean, cov = _posterior(design_matrix(evals, n), y)
    sd = np.sqrt(np.clip(np.diag(cov), 1e-12, None))
    return HeadScores(-mean, norm.cdf(-mean / sd), -mean)


def run_refine(run: MaskRunner, cfg: LocateConfig, n: int, base: Evaluation, ranking: Sequence[int]) -> tuple[Refinement, list[Evaluation]]:
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

    found = refine(ranking, min(cfg.top_k, n), measure, budget=cfg.refine_budget, tolerance=cfg.tolerance)
    return found, spent


def put_first(scores: HeadScores, chosen: Sequence[int]) -> HeadScores:
    """The same scores, re-ranked so that ``chosen`` (in its order) leads."""
    imp = scores.importance
    top = np.nanmax(np.abs(imp[np.isfinite(imp)])) if np.isfinite(imp).any() else 0.0
    boost = np.zeros(len(imp))
    boost[list(chosen)] = np.arange(len(chosen), 0, -1) + top
    return HeadScores(imp + boost, scores.confidence, scores.marginal)


# -- the run -----------------------------------------------------------------------------
def expected_evaluations(cfg: LocateConfig, n: int) -> int:
    if cfg.method == "greedy":
        n_cand = min(n - 1, max(20, 4 * cfg.top_k))
        return n + 1 + sum(min(n - r, n_cand) for r in range(1, cfg.top_k))
    return (n + 1 if cfg.method == "exhaustive" else cfg.masks + 1) + cfg.refine_budget


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("capsense", "torch", "transformers", "lm_eval", "scikit-learn", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def identity_keys(cfg: LocateConfig) -> list[str]:
    keys = ["model", "task", "controls", "limit", "seed", "method", "dtype", "doc_ids"]
    if cfg.method in ("cs", "thompson"):
        keys += ["design", "heads_per_mask"]
    if cfg.method == "greedy":
        keys += ["top_k", "metric"]
    if cfg.method == "thompson" or cfg.design == "adaptive":
        keys += ["metric", "solver", "alpha"]
    if cfg.metric not in METRICS:  # the task's own metric is stored beside nll and acc
        keys.append("metric")
    if cfg.refine_budget:  # refine's sets follow from the fit of every earlier mask
        keys += [k for k in ("masks", "metric", "solver", "alpha", "top_k", "refine", "tolerance") if k not in keys]
    return keys


def _bar(cfg: LocateConfig, total: int, done: int, desc: str):
    if not cfg.progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=min(done, total), unit="mask", desc=desc, dynamic_ncols=True)


def locate(cfg: LocateConfig, log: Callable[[str], None] = print) -> tuple[LocateResult, Path]:
    """Run (or resume) a localization and write the run folder; returns the result and heads.json."""
    import torch

    from capsense.core.arch import head_layout
    from capsense.core.distributed import context
    from capsense.core.models import load_model, model_fingerprint

    ctx = context()
    cfg.check()
    out = Path(cfg.out)
    ctx.on_main(lambda: check_free(out))  # a busy or foreign folder is refused before the slow load
    device = ctx.device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, "cuda" if cfg.device_map and torch.cuda.is_available() else device)
    t_load = time.perf_counter()
    model, tokenizer = load_model(cfg.model, dtype, device, revision=cfg.revision, device_map=cfg.device_map)
    layout = head_layout(model)
    n = layout.n_total
    if ctx.world > cfg.design_masks(n):
        raise LocateError(
            f"{ctx.world} processes for {cfg.design_masks(n)} masks: at most one process per mask can have work; "
            f"launch at most {cfg.design_masks(n)} processes (accelerate launch --num_processes)"
        )
    k = 1
    if cfg.method in ("cs", "thompson"):
        if cfg.heads_per_mask is not None and cfg.heads_per_mask > n:
            raise LocateError(
                f"--heads-per-mask {cfg.heads_per_mask} is more than the model's {n} heads "
                f"({layout.n_layers} layers x {layout.n_heads} heads)"
            )
        k = heads_per_mask(n, cfg.sparsity, cfg.heads_per_mask)
    probes = {}
    for t in [cfg.task, *cfg.controls]:
        probes[t] = build_probe(t, tokenizer, cfg.limit, cfg.seed, cfg.include_path)
    extra = task_metric_scorers(cfg, model, tokenizer, probes)
    mpf = cfg.masks_per_forward or auto_masks_per_forward(model, cfg.batch_size, longest_request(probes))
    fingerprint = model_fingerprint(cfg.model, cfg.revision)
    ident = {
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
        "refine": cfg.refine_budget,
        "tolerance": cfg.tolerance,
        "metric": cfg.metric,
        "solver": cfg.solver,
        "alpha": cfg.alpha,
        "doc_ids": {t: [int(d) for d in p.doc_ids] for t, p in probes.items()},
    }
    manifest = {
        "capsense_run": "locate",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": fingerprint,
        "layout": {"n_layers": layout.n_layers, "n_heads": layout.n_heads, "head_dim": layout.head_dim},
        "task": cfg.task,
        "controls": list(cfg.controls),
        "metric": cfg.metric,
        "heads_per_mask": k,
        "args": {**asdict(cfg), "dtype_resolved": dtype, "masks_per_forward_resolved": mpf},
        "probes": {
            t: {"doc_ids": [int(d) for d in p.doc_ids], "n_requests": p.n_requests, "kind": p.kind, **p.meta}
            for t, p in probes.items()
        },
        "identity": ident,
        "task_metric": {
            t: {"metric": cfg.metric, "label": sc.metric.label, "higher_is_better": sc.metric.higher_is_better,
                "scored_by": "lm-eval under each mask (capsense-masked)"}
            for t, sc in extra.items()
        },
        "versions": library_versions(),
        "host": {"platform": platform.platform(), "cpu_threads": torch.get_num_threads(), "device": device,
                 "device_map": cfg.device_map, "processes": ctx.world},
    }
    lock = RunFolderLock(out)
    try:
        store = open_store(ctx, lock, manifest, identity_keys(cfg), layout.n_heads)
        result = _run(cfg, ctx, store, model, probes, extra, mpf, n, k, layout, log, time.perf_counter() - t_load)
    finally:
        lock.release()
    return result


def check_free(out: Path) -> None:
    """Refuse a file, a foreign folder or a folder another run is writing, creating nothing."""
    check_run_folder(out)
    if out.is_dir():
        RunFolderLock(out).acquire().release()


def open_store(ctx, lock: RunFolderLock, manifest: dict, keys: list[str], n_heads: int) -> RunStore:
    """The run folder, opened (locked, compacted) by the main process, then attached by the others."""
    opened: dict[str, RunStore] = {}

    def main() -> None:
        lock.acquire()
        opened["store"] = RunStore.open(lock.folder, manifest, keys, n_heads)

    ctx.on_main(main)
    return opened["store"] if ctx.is_main else RunStore.attach(lock.folder, n_heads, ctx.rank)


def _run(cfg: LocateConfig, ctx, store: RunStore, model, probes, extra, mpf: int, n: int, k: int, layout, log,
         load_s: float) -> tuple[LocateResult, Path]:
    out = store.path
    done = len(store.done)
    if done and ctx.is_main:
        log(f"Resuming {out}: {done} masks already evaluated")
    evaluator = MaskEvaluator(model, probes, cfg.batch_size, mpf, cfg.prefix_reuse, extra)
    total = expected_evaluations(cfg, n)
    bar = _bar(cfg, total - cfg.refine_budget, done, f"locate {cfg.task}") if ctx.is_main else None
    runner = MaskRunner(store, evaluator, mpf, bar, ctx)
    t0 = time.perf_counter()
    chosen: list[int] | None = None
    try:
        if cfg.method == "cs":
            evals = run_cs(runner, cfg, n, k)
        elif cfg.method == "exhaustive":
            evals = run_exhaustive(runner, cfg, n)
        elif cfg.method == "greedy":
            evals, chosen = run_greedy(runner, cfg, n)
        else:
            evals = run_thompson(runner, cfg, n, k)
    finally:
        if bar is not None:
            bar.close()
    result = summarize(evals, cfg, n, single_head=cfg.method in ("exhaustive", "greedy"))
    if cfg.method == "thompson":
        result.scores = thompson_scores(evals, fit_target(evals, cfg, n), n)
        if cfg.controls:
            result.raw_scores = thompson_scores(evals, fit_target(evals, cfg, n, False), n)
    if chosen is not None:
        result.scores = put_first(result.scores, chosen)
    spent: list[Evaluation] = []
    if cfg.refine_budget:
        runner.bar = bar = _bar(cfg, cfg.refine_budget, max(0, done - len(evals)), f"refine top-{cfg.top_k}") if ctx.is_main else None
        try:
            result.refinement, spent = run_refine(runner, cfg, n, evals[0], result.scores.rank)
        finally:
            if bar is not None:
                bar.close()
        result.scores = put_first(result.scores, result.refinement.heads)
        result.n_evaluations += len(spent)
        (log if ctx.is_main else _quiet)(
            f"refine: {len(spent)} sets measured; chosen "
            + ", ".join(f"L{h // layout.n_heads}H{h % layout.n_heads}" for h in result.refinement.heads)
            + f" (target {100 * result.refinement.quality.target:+.1f}%, worst control "
            f"{100 * result.refinement.quality.control:+.1f}%, tolerance {100 * cfg.tolerance:.1f}%)"
        )
    wall = time.perf_counter() - t0
    from capsense.localize.report import write_outputs

    store.manifest["timing"] = {
        "load_s": round(load_s, 2),
        "evaluate_s_this_attempt": round(wall, 2),
        "new_evaluations_this_attempt": runner.new,
        "seconds_per_mask": round(result.seconds_per_mask, 4),
        "processes": ctx.world,
    }
    ctx.barrier()  # every process's shard is complete

    def finish() -> Path:
        store.compact()
        store.write_manifest()
        return write_outputs(out, cfg, result, layout, store.manifest)

    heads_path = ctx.on_main(finish)
    return result, heads_path


def _quiet(message: str) -> None:
    """The log of processes other than the main one."""


def longest_request(probes: dict) -> int:
    """Tokens in the longest request of any probe."""
    return max((len(c) + len(t) for p in probes.values() for c, t in zip(p.context_ids, p.continuation_ids)), default=1)

"""Localization methods: how each searches and fits; named in :data:`capsense.localize.registry.METHODS`.

* ``cs``: random masks from a design (balanced, Bernoulli or adaptive), each
  scored on every probe, and a sparse regression (:mod:`capsense.localize.solvers`) of the
  score on the 0/1 knockout matrix. This follows "compressed sensing" localization of LLM
  capabilities (knock out ~2% of heads per mask, 100 masks, 100 samples, Lasso alpha 0.01).
* ``exhaustive``: every head knocked out alone (with prefix reuse: the forward starts at
  the ablated layer from cached clean activations);
* ``greedy``: the exhaustive sweep, then heads added one at a time to the knocked-out set,
  each round choosing the candidate whose addition hurts most;
* ``thompson``: Thompson sampling on a Bayesian linear model of head effects: each mask
  knocks out the heads a posterior draw ranks most damaging.

``prior-guided`` (the default) and ``attribution`` are in :mod:`capsense.localize.guided`.

**Adding a method** is a :class:`Method` and one registration (a line in
:mod:`capsense.localize.registry` for capsense's own, or :func:`register`)::

    def search_mine(s: Search) -> Found:
        evals = s.run(no_knockout(s.n))          # the clean model first, always
        evals += s.run(my_masks(s.n, s.cfg.seed))  # any masks; s.run stores and resumes them
        return Found(evals)

    register(Method("mine", search_mine, fit=fit_regression,
                    n_evaluations=lambda cfg, n: ..., identity_keys=("seed-dependent settings",)))

``search`` decides which masks to evaluate (only through ``s.run``, so a killed run resumes
and replays the same masks), ``fit`` turns the evaluations into a :class:`LocateResult`,
``n_evaluations`` says how many masks the search evaluates (for the progress bar), and
``identity_keys`` names the settings that change which masks it evaluates (a run folder made
with other values is refused). ``--method`` accepts every registered name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from capsense.core.batching import AUTO
from capsense.localize.config import LocateConfig
from capsense.errors import CapsenseError
from capsense.localize.designs import balanced_design, run_design
from capsense.localize.evaluator import MaskRunner
from capsense.localize.fit import (
    LocateResult, design_matrix, fit_regression, fit_single_heads, fit_target, single_head_scores,
)
from capsense.localize.refine import DEFAULT_BUDGET
from capsense.localize.registry import METHODS
from capsense.localize.solvers import HeadScores, make_solver, standardize
from capsense.localize.store import Evaluation


@dataclass
class Search:
    """What a method's search works with.

    ``run(masks, round)`` evaluates 0/1 masks ``[m, n]`` (or returns their stored evaluations
    on resume); ``n`` heads in all, ``k`` heads per random mask (from ``sparsity`` or
    ``heads_per_mask``; 1 for methods without random masks). The loaded ``model``,
    ``tokenizer`` and ``probes`` are there for methods that need more than knockouts.
    """

    run: MaskRunner
    cfg: LocateConfig
    n: int
    k: int = 1
    model: Any = None
    tokenizer: Any = None
    probes: dict[str, Any] = field(default_factory=dict)
    log: Callable[[str], None] = print
    attribution_batch_size: int | None = None  # the gradient pass's requests per batch (None: cfg.batch_size)
    means: dict[int, Any] | None = None  # per-layer head means under cfg.ablation "mean" (core.ablation.reference_means)

    @property
    def gradient_batch_size(self) -> int:
        """The gradient pass's requests per batch: :attr:`attribution_batch_size` (locate resolves it from the device),
        else ``cfg.batch_size``, which must then be a count: ``auto`` is resolved against a device and a model."""
        size = self.attribution_batch_size or self.cfg.batch_size
        if size == AUTO:
            raise CapsenseError("this Search's batch_size is auto and it has no attribution_batch_size: give the "
                                "gradient pass's requests per batch (locate resolves both with "
                                "capsense.core.placement.plan_scoring)")
        return int(size)


@dataclass
class Found:
    """A search's evaluations (the clean model first) and, optionally, a head set it chose
    itself, which then leads the ranking."""

    evals: list[Evaluation]
    chosen: list[int] | None = None


@dataclass(frozen=True)
class Method:
    """A localization method: how it searches, how it fits, and what identifies its masks."""

    name: str
    search: Callable[[Search], Found]
    fit: Callable[[list[Evaluation], LocateConfig, int], LocateResult]
    n_evaluations: Callable[[LocateConfig, int], int]
    identity_keys: tuple[str, ...] = ()
    random_masks: bool = False  # masks of k heads (``sparsity`` / ``heads_per_mask`` apply)
    refines: bool = True  # measure-and-choose may follow (by default in selective mode)
    attribution: bool = False  # computes a gradient attribution (3 forward-equivalents)
    options: tuple[str, ...] = ()  # the settings of METHOD_OPTIONS it reads


#: Settings only some methods read; one given to a method that does not read it is an error
#: (it used to be ignored in silence: ``--heads-per-mask 999`` with prior-guided ran as if unset).
METHOD_OPTIONS = ("masks", "sparsity", "heads_per_mask", "design", "solver", "alpha", "budget", "top_m", "group_size",
                  "prior_score", "group_price", "single_controls")


def register(method: Method) -> Method:
    """Add ``method`` to :data:`~capsense.localize.registry.METHODS` under its name (capsense's own
    are declared there; this is for methods defined elsewhere)."""
    return METHODS.register(method.name, method)


def get_method(cfg: LocateConfig) -> Method:
    """The method ``cfg`` names, after checking that its settings apply to it."""
    method = METHODS[cfg.method]
    if cfg.refine and not method.refines:
        raise CapsenseError(f"`refine` does not apply to `method` {cfg.method}, which measures its own top-K set")
    check_method_options(cfg, method)
    if cfg.refine_dtype is not None and not refine_budget(cfg):
        raise CapsenseError("`refine_dtype` applies to measure-and-choose, which this run does not do "
                            "(it needs `controls` or a `refine` budget)")
    if cfg.refine_search is not None and not refine_budget(cfg):
        raise CapsenseError(f"`refine_search` {cfg.refine_search} applies to measure-and-choose, which this run does not "
                            "do (it needs `controls` or a `refine` budget)")
    if cfg.set_controls != "until-beyond" and not (cfg.controls and refine_budget(cfg)):
        raise CapsenseError(f"`set_controls` {cfg.set_controls} applies to measure-and-choose with `controls` (it stops "
                            f"a set's controls early), which this run does not do: it has "
                            f"{'no refine budget' if cfg.controls else 'no controls'}")
    if cfg.refine_dtype is not None and cfg.device_map and cfg.refine_dtype != cfg.dtype:
        raise CapsenseError("`refine_dtype` cannot recast a model spread over devices by `device_map`: "
                            "leave it unset (measure-and-choose then runs in the run's `dtype`)")
    return method


def check_method_options(cfg: LocateConfig, method: Method) -> None:
    """Refuse settings of other methods: a value set (not None, not the default) that ``method`` does not read."""
    from dataclasses import fields

    default = {f.name: f.default for f in fields(LocateConfig)}
    foreign = [o for o in METHOD_OPTIONS
               if o not in method.options and getattr(cfg, o) is not None and getattr(cfg, o) != default[o]]
    if foreign:
        readers = "; ".join(f"`{o}` is read by {', '.join(m.name for m in METHODS.values() if o in m.options)}"
                            for o in foreign)
        raise CapsenseError(f"{', '.join(f'`{o}`' for o in foreign)} {'does' if len(foreign) == 1 else 'do'} not apply "
                          f"to `method` {cfg.method}: {readers}")


def refine_budget(cfg: LocateConfig) -> int:
    """Evaluations for measure-and-choose: ``refine``, or by default 24 in selective mode."""
    if cfg.refine is not None:
        return cfg.refine
    return DEFAULT_BUDGET if cfg.controls and METHODS[cfg.method].refines else 0


def no_knockout(n: int) -> np.ndarray:
    """The clean model's mask: nothing knocked out (every search evaluates it first)."""
    return np.zeros((1, n), dtype=bool)


def single_head_masks(n: int) -> np.ndarray:
    """Every head alone, in layer order (prefix reuse then shares each layer's cached input)."""
    return np.eye(n, dtype=bool)


# -- cs ----------------------------------------------------------------------------------
def search_cs(s: Search) -> Found:
    """The clean model, then ``masks`` masks of the design (adaptive: refit between rounds)."""
    cfg = s.cfg
    evals = s.run(no_knockout(s.n))

    def evaluate(masks: np.ndarray, r: int) -> None:
        evals.extend(s.run(masks, r))

    def fit() -> tuple[np.ndarray, np.ndarray]:
        scores = make_solver(cfg.solver, cfg.alpha, cfg.seed).fit(design_matrix(evals, s.n), fit_target(evals, cfg, s.n)).scores_
        return scores.importance, scores.confidence

    run_design(cfg.design, cfg.masks, s.n, s.k, cfg.seed, evaluate, fit)
    return Found(evals)


CS = Method("cs", search_cs, fit_regression, lambda cfg, n: cfg.masks + 1,
                identity_keys=("design", "heads_per_mask"), random_masks=True,
                options=("masks", "sparsity", "heads_per_mask", "design", "solver", "alpha"))


# -- exhaustive --------------------------------------------------------------------------
def search_exhaustive(s: Search) -> Found:
    """The clean model, then every head alone."""
    return Found(s.run(no_knockout(s.n)) + s.run(single_head_masks(s.n)))


EXHAUSTIVE = Method("exhaustive", search_exhaustive, fit_single_heads, lambda cfg, n: n + 1)


# -- greedy ------------------------------------------------------------------------------
def greedy_candidates(cfg: LocateConfig, n: int) -> int:
    """Candidates tried per greedy round: the best-ranked ones not chosen yet."""
    return min(n - 1, max(20, 4 * cfg.top_k))


def search_greedy(s: Search) -> Found:
    """Exhaustive sweep, then grow the knocked-out set one head per round (top candidates only)."""
    cfg, n = s.cfg, s.n
    evals = search_exhaustive(s).evals
    imp, _ = single_head_scores(evals, fit_target(evals, cfg, n), n)
    order = [int(i) for i in np.argsort(-imp, kind="stable")]
    chosen = [order[0]]
    n_cand = greedy_candidates(cfg, n)
    for r in range(1, cfg.top_k):
        cands = [h for h in order if h not in chosen][:n_cand]
        masks = np.zeros((len(cands), n), dtype=bool)
        masks[:, chosen] = True
        for i, h in enumerate(cands):
            masks[i, h] = True
        evals += s.run(masks, r)
        y = fit_target(evals, cfg, n)[-len(cands):]
        chosen.append(cands[int(np.argmin(y))])
    return Found(evals, chosen)


def greedy_evaluations(cfg: LocateConfig, n: int) -> int:
    """The sweep (clean model + every head) plus one round of candidates per further head."""
    return n + 1 + sum(min(n - r, greedy_candidates(cfg, n)) for r in range(1, cfg.top_k))


GREEDY = Method("greedy", search_greedy, fit_single_heads, greedy_evaluations,
                identity_keys=("top_k", "metric"), refines=False)


# -- thompson ----------------------------------------------------------------------------
def search_thompson(s: Search) -> Found:
    """Warm-up balanced masks, then each mask = the k heads a posterior draw finds most damaging."""
    cfg, n = s.cfg, s.n
    evals = s.run(no_knockout(n))
    warm = min(cfg.masks, max(10, cfg.masks // 5))
    evals += s.run(balanced_design(warm, n, s.k, cfg.seed))
    while len(evals) - 1 < cfg.masks:
        mean, cov = posterior(design_matrix(evals, n), fit_target(evals, cfg, n))
        rng = np.random.default_rng([cfg.seed, 7, len(evals)])
        draw = mean + np.linalg.cholesky(cov + 1e-9 * np.eye(n)) @ rng.standard_normal(n)
        mask = np.zeros((1, n), dtype=bool)
        mask[0, np.argsort(draw, kind="stable")[: s.k]] = True  # most negative effect = most damaging
        evals += s.run(mask, len(evals))
    return Found(evals)


def posterior(X: np.ndarray, y: np.ndarray, prior_sd: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
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

    mean, cov = posterior(design_matrix(evals, n), y)
    sd = np.sqrt(np.clip(np.diag(cov), 1e-12, None))
    return HeadScores(-mean, norm.cdf(-mean / sd), -mean)


def fit_thompson(evals: list[Evaluation], cfg: LocateConfig, n: int) -> LocateResult:
    """Effects as :func:`fit_regression`; the ranking from the posterior."""
    result = fit_regression(evals, cfg, n)
    result.scores = thompson_scores(evals, fit_target(evals, cfg, n), n)
    if cfg.controls:
        result.raw_scores = thompson_scores(evals, fit_target(evals, cfg, n, False), n)
    return result


THOMPSON = Method("thompson", search_thompson, fit_thompson, lambda cfg, n: cfg.masks + 1,
                identity_keys=("design", "heads_per_mask", "metric", "solver", "alpha"), random_masks=True,
                options=("masks", "sparsity", "heads_per_mask", "solver", "alpha"))

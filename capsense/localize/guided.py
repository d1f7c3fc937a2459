"""Methods built on gradient attribution: ``attribution`` (the estimate alone) and
``prior-guided`` (the default: the estimate decides where knockouts look, knockouts decide).

Both compute every head's first-order ablation effect on the target and on each control
(:mod:`capsense.scoring.attribution`; 3 forward-equivalents per run, whose forward is also the
clean evaluation where the batches allow) and keep it in the run folder (``attribution.json``),
so a resumed run replays the same search.

* ``attribution`` ranks heads by the estimate (selective: target estimate minus the largest
  positive control estimate, both relative to the clean nll). Nothing is measured: a quick
  look, not a result to hand on.
* ``prior-guided`` runs :func:`capsense.localize.prior.prior_guided` on the target's estimate:
  single-head knockouts of the heads with the largest per-document magnitude (``prior_score``
  documents, the default: each document's ``|gradient|`` summed, which cancellation across
  documents cannot hide; ``estimate``: the largest ``|estimate|``), group knockouts over the
  rest (scored on the target alone in selective mode: a group is never handed on), splits of groups
  that hurt, within a budget of forward-equivalents (each knockout priced as scored on every probe, so
  the budget buys the same masks however few documents they end up scored on). In selective mode a
  single is scored on the target and its controls cheapest first until a control excludes it from the
  collateral screen (``single_controls``, :func:`controls_until_beyond`): a head a control cheaper than
  the target excludes has no target damage (NaN), which neither flags groups nor ranks. The ranking comes
  from the heads measured alone (selective mode: residualized on the controls, as the
  exhaustive sweep does), so every head handed on was knocked out, not only estimated.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from capsense.core.files import atomic_write_json
from capsense.errors import CapsenseError
from capsense.localize.config import LocateConfig
from capsense.localize.designs import head_set_masks
from capsense.localize.fit import LocateResult, damage, estimates_in_units, fit_single_heads
from capsense.localize.methods import Found, Method, Search, no_knockout
from capsense.localize.prior import PriorSettings, prior_guided
from capsense.localize.singles import controls_until_beyond, screen_thresholds
from capsense.localize.solvers import HeadScores
from capsense.localize.store import Evaluation
from capsense.scoring.attribution import (Attribution, attribute_probes, attribution_scorers,
                                          check_gradient_metric)
from capsense.scoring.cost import ATTRIBUTION, FORWARD

ATTRIBUTION_FILE = "attribution.json"


def run_attribution(s: Search) -> tuple[dict[str, np.ndarray], list[Evaluation]]:
    """Per task (target and controls) the estimated relative damage of knocking out each head,
    and the clean model's evaluation; the estimates are read from the run folder when an earlier
    attempt computed them.

    With one process the attribution's forward (a clean one: every multiplier is 1) also serves
    as the clean evaluation and fills the prefix cache wherever the batches are the same
    (:meth:`~capsense.localize.evaluator.MaskEvaluator.clean_sinks`): 1 forward-equivalent less.
    ``attribution.json`` is written after the clean evaluation is stored, with the share of the
    clean forward the attribution ran, so a resumed run counts the cost the first attempt paid.
    Under several processes each computes its share of the batches (:func:`attribute_probes`) and
    the clean forward runs on its own; the main process writes ``attribution.json``.
    """
    check_gradient_metric(s.cfg.metric)
    ctx, evaluator = s.run.ctx, s.run.evaluate
    stored = ctx.on_main(lambda: load_attribution(s.cfg))  # one answer for all: all compute, or none
    if stored is not None:
        estimates, evaluator.folded_share = stored
        evals = s.run(no_knockout(s.n))
        evaluator.check_scorers()  # as the first attempt did here, before the search priced anything
        return estimates, evals
    scorers = attribution_scorers(s.model, s.probes, s.gradient_batch_size, s.cfg.ablation, s.means,
                                  metrics={t: s.cfg.metric_for(t) for t in s.probes})
    sinks = {} if ctx.distributed else evaluator.clean_sinks({t: sc.batch_keys() for t, sc in scorers.items()})
    atts = s.run.timed("attribution", lambda: attribute_probes(s.model, s.probes, ctx=ctx, sinks=sinks, scorers=scorers))
    evals = s.run.timed("attribution", lambda: s.run(no_knockout(s.n)))  # (the clean scores, from its forward)
    evaluator.check_scorers()  # on the block inputs the attribution handed over, before the search prices anything
    folded = evaluator.folded_share
    return ctx.on_main(lambda: _write_attribution(Path(s.cfg.out) / ATTRIBUTION_FILE, atts, folded)), evals


def _write_attribution(path: Path, atts: dict[str, Attribution], folded: float = 0.0) -> dict[str, np.ndarray]:
    """``attribution.json`` (atomically); returns the estimates as written."""
    def relative(a: Attribution, v: np.ndarray) -> list[float]:  # over the clean nll, as stored
        return [round(float(x), 8) for x in (v / a.nll if a.nll else v)]

    est = {t: relative(a, a.flat()) for t, a in atts.items()}
    mag = {t: relative(a, a.flat_magnitude()) for t, a in atts.items()}
    atomic_write_json(path, {
        "estimate": est,
        "magnitude": mag,
        "clean_nll": {t: a.nll for t, a in atts.items()},  # (the clean choice_nll for a target scored by it)
        "clean_forward_folded": round(folded, 6),
        "meaning": "estimate: first-order estimate of the relative nll worsening when a head is zero-ablated "
                   "(-d nll/d xi / nll, xi = the head's multiplier at the output projection), flat head order; "
                   "magnitude: each document's |d nll/d xi| summed, over nll (>= |estimate|); "
                   "clean_forward_folded: share of the run's tokens whose clean evaluation came from this forward; "
                   "a target scored by choice_nll has it in place of nll here",
    })
    return {t: np.asarray(v, dtype=float) for t, v in est.items()}  # as a resumed run reads them


def load_estimates(cfg: LocateConfig) -> dict[str, np.ndarray] | None:
    """The run folder's attribution estimates (per task), or None."""
    stored = load_attribution(cfg)
    return None if stored is None else stored[0]


def load_attribution(cfg: LocateConfig) -> tuple[dict[str, np.ndarray], float] | None:
    """The run folder's attribution estimates (per task) and the share of the clean forward its
    forward ran (0 for folders from before round 10), or None."""
    path = Path(cfg.out) / ATTRIBUTION_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return {t: np.asarray(v, dtype=float) for t, v in data["estimate"].items()}, float(data.get("clean_forward_folded", 0.0))


def load_magnitudes(cfg: LocateConfig) -> np.ndarray:
    """The target's per-document gradient magnitude from the run folder (``prior_score`` documents)."""
    data = json.loads((Path(cfg.out) / ATTRIBUTION_FILE).read_text())
    if "magnitude" not in data:
        raise CapsenseError(f"{Path(cfg.out) / ATTRIBUTION_FILE} predates per-document magnitudes, which "
                            f"`prior_score` documents needs: delete it to recompute the attribution (3 "
                            f"forward-equivalents), or resume with `prior_score` estimate")
    return np.asarray(data["magnitude"][cfg.task], dtype=float)


def selective_estimate(est: dict[str, np.ndarray], cfg: LocateConfig) -> np.ndarray:
    """Target estimate minus the largest positive control estimate (raw target without controls)."""
    target = est[cfg.task]
    if not cfg.controls:
        return target
    worst = np.max(np.stack([np.clip(est[c], 0, None) for c in cfg.controls]), axis=0)
    return target - worst


# -- attribution -------------------------------------------------------------------------
def search_attribution(s: Search) -> Found:
    return Found(run_attribution(s)[1])


def fit_attribution(evals: list[Evaluation], cfg: LocateConfig, n: int) -> LocateResult:
    est = load_estimates(cfg)
    assert est is not None, "the attribution search writes the estimates first"
    imp = selective_estimate(est, cfg)
    raw = HeadScores(est[cfg.task], np.zeros(n), est[cfg.task].copy()) if cfg.controls else None
    return LocateResult(
        scores=HeadScores(imp, np.zeros(n), imp.copy()),
        raw_scores=raw,
        target_effect=np.full(n, np.nan),
        control_effects={c: np.full(n, np.nan) for c in cfg.controls},
        n_evaluations=len(evals),
        base=evals[0].scores,
        seconds_per_mask=0.0,
        estimates=est,
    )


ATTRIBUTION_METHOD = Method("attribution", search_attribution, fit_attribution, lambda cfg, n: 1, attribution=True,
                            options=("single_controls",))  # (measure-and-choose's extra singles read it)


# -- prior-guided ------------------------------------------------------------------------
def prior_settings(cfg: LocateConfig) -> PriorSettings:
    return PriorSettings(top_k=cfg.top_k, top_m=cfg.top_m, group_size=cfg.group_size, budget=cfg.budget)


def search_prior_guided(s: Search) -> Found:
    """The clean model, then the knockouts :func:`prior_guided` asks for (all through ``s.run``; groups
    on the target alone, :func:`measure_sets`). The budget prices each knockout as scored on every
    probe, as before groups went target-only (round 14), so the search measures the same masks with the
    same target scores; the run's forward-equivalents count the documents actually run, below it.
    ``group_price`` ``target`` prices a group at what it costs instead (:data:`~capsense.localize.prior.GROUP_PRICES`:
    measured in round 15, not the default)."""
    estimates, evals = run_attribution(s)
    est = estimates[s.cfg.task]
    if s.cfg.prior_score == "documents":
        est = s.run.ctx.on_main(lambda: load_magnitudes(s.cfg))
    also = selective_estimate(estimates, s.cfg) if s.cfg.controls else None
    base = evals[0]
    until = (base, screen_thresholds(s.cfg, estimates)) if s.cfg.controls_until_excluded else None

    def measure(sets: list[tuple[int, ...]]) -> list[float]:
        evs = measure_sets(s, sets, until)
        evals.extend(evs)
        return [float(d) for d in damage(evs, s.cfg.task, s.cfg, base)]

    cost = s.run.evaluate.cost
    sweep = sweep_cost(cost, s.n)
    settings = replace(prior_settings(s.cfg), already_spent=ATTRIBUTION + cost([]),  # + what the clean forward added
                       budget=min(s.cfg.budget, sweep))
    if settings.budget < s.cfg.budget:
        s.log(f"prior-guided: budget {settings.budget:.1f} forward-equivalents, the cost of measuring every head alone "
              f"(asked: {s.cfg.budget:g})")
    probes = [s.cfg.task] if s.cfg.controls and s.cfg.group_price == "target" else None  # a group's real probes

    def price(heads: tuple[int, ...]) -> float:
        return cost(list(heads), probes if len(heads) > 1 else None)

    prior_guided(est, measure, price, settings, also=also)
    return Found(evals)


def measure_sets(s: Search, sets: list[tuple[int, ...]],
                 until: tuple[Evaluation, dict[str, float]] | None = None) -> list[Evaluation]:
    """The evaluations of head sets, in order: a single head on every probe, a group (several heads)
    on the target alone when the run has controls (target first). ``until``: (the clean evaluation, the
    screen's threshold per control): singles are scored on their controls until one excludes them
    (:func:`controls_until_beyond`).

    A group knockout is never handed on: only its target damage decides whether it is split
    (:func:`capsense.localize.prior.groups_and_splits`), so scoring it on the controls (84% of the
    main job's documents) bought nothing. A single head keeps its control scores: the collateral
    screen, the selective ranking and measure-and-choose's prediction read them; with ``until``, those
    of a head the screen sets aside stop at the first control beyond its threshold (nothing reads the rest
    but the selective ranking, which takes attribution's estimate there, :func:`fit_prior_guided`). Runs of
    sets of one kind go to the runner as one block each, in order, so the masks' indices follow the search."""
    target = [s.cfg.task] if s.cfg.controls else None
    out: list[Evaluation] = []
    i = 0
    while i < len(sets):
        group = len(sets[i]) > 1
        j = i
        while j < len(sets) and (len(sets[j]) > 1) == group:
            j += 1
        if group or until is None:
            out += s.run(head_set_masks(sets[i:j], s.n), probes=target if group else None)
        else:
            out += controls_until_beyond(s.run, s.cfg, s.n, sets[i:j], *until,
                                         target_first=not s.cfg.target_after_cheaper_controls)
        i = j
    return out


def sweep_cost(cost, n: int) -> float:
    """Forward-equivalents of the exhaustive sweep (the clean forward, then every head alone with prefix
    reuse): the most a prior-guided budget spends. On a 72-head model the old default (50, then 32 in
    the recipes) cost more than the sweep (about 37 on Gemma 3 270M); the cap makes the budget follow
    the model instead of one number for every size. (The sweep has no attribution to fold its clean
    forward into: a full forward.)"""
    return FORWARD + sum(cost([h]) for h in range(n))


def fit_prior_guided(evals: list[Evaluation], cfg: LocateConfig, n: int) -> LocateResult:
    """Ranked by the heads measured alone; the estimates kept beside the measured effects (and, in the
    selective fit, standing in for the controls a set-aside single was not scored on)."""
    estimates = load_estimates(cfg)
    result = fit_single_heads(evals, cfg, n, fill=estimates_in_units(cfg, estimates))
    measured = np.zeros(n, dtype=bool)
    for e in evals[1:]:
        if len(e.heads) == 1:
            measured[e.heads[0]] = True
    result.target_effect = np.where(measured, result.target_effect, np.nan)
    result.control_effects = {c: np.where(measured, v, np.nan) for c, v in result.control_effects.items()}
    result.estimates = estimates
    return result


def expected_prior_evaluations(cfg: LocateConfig, n: int) -> int:
    """Roughly: the clean model, the singles, one group per ``group_size`` other heads, a few splits."""
    m = min(cfg.top_m, n)
    return 1 + m + -(-(n - m) // max(2, cfg.group_size)) + 8


PRIOR_GUIDED = Method("prior-guided", search_prior_guided, fit_prior_guided, expected_prior_evaluations,
                identity_keys=("top_k", "top_m", "group_size", "budget", "metric", "prior_score", "group_price",
                               "single_controls"), attribution=True,
                options=("budget", "top_m", "group_size", "prior_score", "group_price", "single_controls"))

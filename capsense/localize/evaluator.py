"""Evaluating knockout masks: scores on every probe (:class:`MaskEvaluator`), kept in the
run folder in order, replayed on resume and split across processes (:class:`MaskRunner`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from capsense.core.distributed import DistContext, split
from capsense.errors import CapsenseError, RunStoreError
from capsense.localize.config import LocateConfig
from capsense.localize.store import Evaluation, RunStore
from capsense.scoring import METRICS
from capsense.scoring.requests import load_task

#: Scores of one mask: task -> metric -> value.
MaskScores = dict[str, dict[str, float]]


class MaskEvaluator:
    """Scores masks (flat head index sets) on every probe with one loaded model."""

    def __init__(self, model, probes: dict, batch_size: int, masks_per_forward: int, prefix_reuse: bool,
                 extra: dict | None = None, ablator=None) -> None:
        from capsense.core.arch import head_layout

        self.model, self.probes, self.settings = model, probes, (batch_size, masks_per_forward, prefix_reuse)
        self.layout = head_layout(model)
        self.ablator = ablator  # a core.ablation.HeadAblator (mean ablation); None: zero ablation
        self.scorers = {
            name: scorer_class(probe, masks_per_forward, prefix_reuse)(
                model, probe, ablator=ablator, batch_size=batch_size, masks_per_forward=masks_per_forward)
            for name, probe in probes.items()
        }
        self.extra = dict(extra or {})  # task -> a scorer adding metrics (e.g. TaskMetricScorer)
        # share of the run's tokens whose clean forward another pass ran (set by clean_sinks' users; resumed runs restore it)
        self.folded_share = 0.0
        self.checks_before = 0.0  # the self-checks' wall time in the evaluator this one was recast from

    def clean_sinks(self, batches: dict[str, frozenset[tuple[int, ...]]]) -> dict:
        """Per probe whose clean forward the gradient attribution can stand in for, the sink that
        takes it (:data:`capsense.scoring.attribution.CleanSink`): the prefix-reuse scorers whose own
        batches are the attribution's (``batches``: per probe, its
        :meth:`~capsense.scoring.attribution.AttributionScorer.batch_keys`). They are for log-likelihood
        probes, and multiple-choice probes on the shared context (since round 12 the attribution runs their
        shared-context passes, every choice included, with their batches), at the same batch size. Not where
        the batches differ: a smaller gradient batch (``--batch-size auto`` on a GPU), or choices with
        contexts of their own (the gold choices alone, or whole documents for ``choice_nll``); handing
        those on raised in the first batch until round 28. Sets :attr:`folded_share` to the share of the
        tokens they hold."""
        from capsense.scoring.prefix import TakesClean

        if self.extra:  # a task's own metric needs its own clean run
            return {}
        sinks = {name: s.take_clean for name, s in self.scorers.items()
                 if isinstance(s, TakesClean) and s.can_take_clean() and s.batch_keys() == batches.get(name)}
        self.folded_share = self.token_share(set(sinks))
        return sinks

    def check_scorers(self) -> None:
        """Run the scorers' first-batch self-checks now, before anything is priced: a multiple-choice probe's
        shared context against plain scoring, and the prefix replays (a log-likelihood probe's replay from block 0
        against its clean forward, a multiple-choice probe's cache rebuild). A check that fails turns a scorer's
        prefix reuse off, which changes what a knockout costs, and the search orders its singles and spends its
        budget by that cost. Before round 39 a fresh run checked inside the attribution and at its first
        knockout, after pricing its singles, and a resumed one, which replays both from the folder, only when it
        first scored a mask: where a check failed the resume priced every knockout differently and asked for
        other masks than the folder held (found when a bfloat16-autocast run's check failed on rounding noise).
        Called after the attribution (whose clean forward hands the first batches' block inputs over) or, without
        one, before the search; on resume it captures one batch per probe. Their wall time is :attr:`check_s`."""
        for s in self.scorers.values():
            if callable(getattr(s, "checked", None)):
                s.checked()
            if callable(getattr(s, "check_replay", None)):
                s.check_replay()

    @property
    def check_s(self) -> float:
        """Wall time of the scorers' self-checks this attempt, wherever they ran (here, or in a clean
        evaluation's first batch): the run's forward-equivalents do not count them (a log-likelihood probe's replay from
        block 0 runs two rows of its first batch since round 44, a multiple-choice probe's first batch is scored plain and
        shared, and its two passes are replayed), so the manifest's timing states it."""
        return self.checks_before + sum(getattr(s, "check_s", 0.0) for s in self.scorers.values())

    def token_share(self, names) -> float:
        """The share of the run's tokens (every probe's documents) that the probes ``names`` hold."""
        names = set(names)
        tokens = {name: sum(len(x) for x in s._inputs) for name, s in self.scorers.items()}
        return sum(t for name, t in tokens.items() if name in names) / max(1, sum(tokens.values()))

    def recast(self, dtype: str) -> MaskEvaluator:
        """A new evaluator on the same probes after casting the model to ``dtype`` in place (this one's
        prefix caches hold activations of the old precision and must not be used again: also where the
        model is already in ``dtype`` and only autocast, :mod:`capsense.core.precision`, ends). The caller
        evaluates the clean model with it, then runs :meth:`check_scorers` before pricing a knockout: the
        checks then replay the batches the clean forward recorded instead of capturing them first."""
        import torch

        if next(self.model.parameters()).dtype != getattr(torch, dtype):
            self.model.to(getattr(torch, dtype))
        recast = MaskEvaluator(self.model, self.probes, *self.settings, extra=self.extra, ablator=self.ablator)
        recast.checks_before = self.check_s
        return recast

    @property
    def reuse_share(self) -> float:
        """Share of the run's tokens scored with prefix reuse (log-likelihood and multiple choice
        alike; the rest pays full forwards)."""
        return self.token_share({name for name, s in self.scorers.items() if getattr(s, "reuses_prefix", False)})

    def cost(self, heads, probes=None) -> float:
        """Forward-equivalents of evaluating one mask (flat head indices; :mod:`capsense.scoring.cost`)
        on every probe, or on ``probes`` only: their share of the run's tokens, priced as their own
        scorers run (a knockout scored on the target alone runs the target's documents only)."""
        from capsense.scoring.cost import mask_cost

        if probes is None or set(probes) >= set(self.scorers):
            return mask_cost(list(heads), self.layout.n_layers, self.layout.n_heads, self.reuse_share, self.folded_share)
        names = set(probes) & set(self.scorers)  # (a run scores its clean model on every probe: ``folded`` is the run's)
        share = self.token_share(names)
        reuse = {n for n in names if getattr(self.scorers[n], "reuses_prefix", False)}
        within = self.token_share(reuse) / share if share else 0.0
        return share * mask_cost(list(heads), self.layout.n_layers, self.layout.n_heads, within, self.folded_share)

    def knockouts(self, masks: np.ndarray):
        """``masks`` [m, layers * heads] as a boolean tensor [m, layers, heads]."""
        import torch

        return torch.from_numpy(np.asarray(masks, dtype=bool).reshape(-1, self.layout.n_layers, self.layout.n_heads).copy())

    def __call__(self, masks: np.ndarray, probes=None) -> list[MaskScores]:
        """Scores of each mask on every probe, or on the probes named in ``probes`` only (each probe's
        scorer runs on its own, so a probe's scores are the same whichever others run beside it)."""
        from capsense.scoring.logits import float32_head

        ko = self.knockouts(masks)
        wanted = set(self.scorers) | set(self.extra) if probes is None else set(probes)
        with float32_head(self.model):  # one float32 copy of a CPU bf16 LM head per call, not per batch
            per_task = {name: s.score(ko) for name, s in self.scorers.items() if name in wanted}
            for name, s in self.extra.items():
                if name in wanted:
                    per_task[name] = {**per_task.get(name, {}), **s.score(ko)}
        return [
            {name: {k: float(v[i]) for k, v in r.items()} for name, r in per_task.items()} for i in range(len(masks))
        ]


def scorer_class(probe, masks_per_forward: int, prefix_reuse: bool) -> type:
    """The fastest exact scorer for ``probe``: shared context for multiple choice, prefix reuse on
    top of either (a knockout starts at its first layer)."""
    from capsense.scoring.prefix import PrefixReuseScorer
    from capsense.scoring.probe import ProbeScorer
    from capsense.scoring.shared_context import SharedContextScorer, shared_context_groups
    from capsense.scoring.shared_prefix import SharedPrefixScorer

    if masks_per_forward > 1:
        return ProbeScorer
    if shared_context_groups(probe) is not None:  # multiple choice: each context once per mask
        return SharedPrefixScorer if prefix_reuse else SharedContextScorer
    return PrefixReuseScorer if prefix_reuse else ProbeScorer


class MaskRunner:
    """Evaluates blocks of masks (``[m, heads]`` booleans) in order into ``store``, reusing what it holds.

    A method calls the runner with a block of masks (a design, a refine round, one Thompson
    draw). Every process computes the same blocks in the same order (the masks follow from
    the seed and from earlier scores, which every process holds), so a mask's *index* in the
    run is the same everywhere. The runner reuses every index the folder already holds
    (checking its heads), cuts the rest into one contiguous share per process, evaluates this
    process's share (``masks_per_forward`` at a time, each logged durably as it finishes) and
    exchanges the new evaluations, so that every process returns the whole block. With one
    process it is a plain resumable loop.
    """

    def __init__(self, store: RunStore, evaluate: Callable[[np.ndarray], list[MaskScores]], masks_per_forward: int, bar=None,
                 ctx: DistContext | None = None) -> None:
        self.store, self.evaluate = store, evaluate
        self.mpf = max(1, masks_per_forward)
        self.ctx = ctx or DistContext()
        self.cursor = 0
        self.bar = bar
        self.new = 0  # evaluations this attempt added (all processes)
        self.forward_equivalents = 0.0  # of every mask this runner returned, stored or new
        self.extra_cost = 0.0  # forward-equivalents spent outside masks (gradient attribution)
        self.phase_s: dict[str, float] = {}  # wall time of this attempt's phases ("locate", "refine", "attribution")

    def timed(self, phase: str, work: Callable[[], object]) -> object:
        """``work()``, its wall time added to :attr:`phase_s` under ``phase``."""
        t0 = time.perf_counter()
        try:
            return work()
        finally:
            self.phase_s[phase] = self.phase_s.get(phase, 0.0) + time.perf_counter() - t0

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Evaluations within the block do not move the progress bar: they complete masks already counted
        (a single's further controls, :func:`capsense.localize.singles.controls_until_beyond`); their cost counts."""
        bar, self.bar = self.bar, None
        try:
            yield
        finally:
            self.bar = bar

    def _count(self, ev: Evaluation) -> None:
        """Add ``ev``'s forward-equivalents: the price of the probes it holds scores of (the evaluator's
        ``cost`` prices every probe at the full mask's price, a subset at its share)."""
        cost = getattr(self.evaluate, "cost", None)
        if cost is not None:
            self.forward_equivalents += cost(ev.heads, sorted(ev.scores))

    def _show(self, n: int) -> None:
        if self.bar is not None:
            self.bar.label(f"{self.forward_equivalents + self.extra_cost:.1f} FE")  # a phase of capsense.core.progress
            self.bar.update(n)

    def __call__(self, masks: np.ndarray, round_index: int = 0, probes: list[str] | None = None) -> list[Evaluation]:
        """The evaluations of ``masks`` (stored ones reused), scored on every probe or on ``probes`` only.

        A stored evaluation is reused when it knocks out the same heads and holds scores of at least
        the probes asked for (a folder from before ``probes`` holds every probe's)."""
        masks = np.atleast_2d(np.asarray(masks, dtype=bool))
        first, self.cursor = self.cursor, self.cursor + len(masks)
        todo = []
        for i, mask in enumerate(masks):
            idx = first + i
            heads = [int(h) for h in np.flatnonzero(mask)]
            ev = self.store.done.get(idx)
            if ev is None:
                todo.append(idx)
            elif ev.heads != heads or (probes is not None and not set(probes) <= set(ev.scores)):
                raise RunStoreError(
                    f"mask {idx} in {self.store.path} knocks out other heads or was scored on other probes than "
                    f"this run's mask {idx}: the settings or capsense changed; choose another `out`"
                )
            else:
                self._count(ev)
        mine = split(todo, self.ctx)[self.ctx.rank]
        local = self._evaluate([(i, masks[i - first]) for i in mine], round_index, probes)
        if self.ctx.distributed:
            others = [e for r, evs in enumerate(self.ctx.gather(local)) if r != self.ctx.rank for e in evs]
            self.store.record(others)
            for e in others:
                self._count(e)
            self._show(len(others))
        self.new += len(todo)
        return [self.store.done[first + i] for i in range(len(masks))]

    def _evaluate(self, items: list[tuple[int, np.ndarray]], round_index: int, probes: list[str] | None) -> list[Evaluation]:
        out = []
        for g in range(0, len(items), self.mpf):
            group = items[g : g + self.mpf]
            t0 = time.perf_counter()
            stacked = np.stack([m for _, m in group])
            scores = self.evaluate(stacked) if probes is None else self.evaluate(stacked, probes)
            dt = (time.perf_counter() - t0) / len(group)
            for (idx, mask), sc in zip(group, scores):
                ev = Evaluation(idx, [int(h) for h in np.flatnonzero(mask)], sc, dt, round_index)
                self.store.append(ev)
                self._count(ev)
                out.append(ev)
                self._show(1)
        return out


def task_metric_scorers(cfg: LocateConfig, model, tokenizer, probes: dict, batch_size: int, ablator=None) -> dict:
    """With ``metric`` one of the target task's own lm-eval metrics (not nll/acc): a scorer that
    runs the task through lm-eval under each mask on the probe's documents (faithful, slow), ``batch_size``
    requests per forward (the run's, resolved), sharing the run's ``ablator`` (mean ablation: None for zero).

    Sets ``cfg.task_metric_higher_is_better`` from the task.
    """
    from capsense.scoring.task_metric import TaskMetricScorer, resolve_task_metric

    if cfg.metric in METRICS:
        return {}
    task_obj = load_task(cfg.task, cfg.include_path, tokenizer)
    scorer = TaskMetricScorer(model, tokenizer, cfg.task, probes[cfg.task].doc_ids, None, cfg.metric,
                              batch_size=batch_size, include_path=cfg.include_path,
                              confirm_run_unsafe_code=cfg.confirm_run_unsafe_code,
                              ablation=cfg.ablation, mean_reference=cfg.mean_reference, ablator=ablator)
    try:
        tm = resolve_task_metric(cfg.task, task_obj, cfg.metric)
    except CapsenseError:  # maybe a name a metric function reports at run time: run the clean model once
        tm = resolve_task_metric(cfg.task, task_obj, cfg.metric, reported=scorer.reported())
    scorer.metric = tm
    cfg.task_metric_higher_is_better = tm.higher_is_better
    return {cfg.task: scorer}

"""Gradient attribution: every head's first-order ablation effect in one forward and backward.

A multiplier ``xi[layer, head]`` scales each head's slice of the output-projection input, the
place :class:`~capsense.core.ablation.HeadAblator` acts (:func:`~capsense.core.ablation.scale_heads`);
``xi = 1`` is the clean model, ``xi[l, h] = 0`` zero-ablates head ``(l, h)`` (with head means,
the slice becomes ``mean + xi * (x - mean)`` and 0 is mean ablation). The score is the probe's
``nll`` (nats/token of the reference continuation; for multiple choice the gold choice's), so

    nll(head ablated) - nll(clean)  ~=  -d nll / d xi[l, h]     (at xi = 1)

for all heads from one backward pass per batch (attribution patching; Michel et al. 2019's
head importance). Each batch's gradient is computed on its own and the batches are summed in
order, so the batches can be split across processes (:func:`attribute_probes`) without
changing a bit of the result. The estimate is linear: saturated attention and cancelling paths make it
miss heads (false negatives, even wrong signs), so capsense uses it to decide where to spend
real knockouts, never as the answer (:mod:`capsense.localize.prior`).

A multiple-choice probe is attributed on the shared context where its scorer's check lets it
(:class:`~capsense.scoring.shared_context.SharedContextScorer`: the same batches of whole
documents, each context once, then every choice on top of the cached keys and values, the
gradient flowing back through the cache): its nll is still the gold choices', and the other
choices cost a few tokens more, so that the forward is the clean shared-context evaluation and
stands in for it (round 12; before, only the gold requests ran and the clean forward ran again).

A multiple-choice target may be scored by ``choice_nll`` instead (round 28): each document's
``logsumexp`` over its choices' summed log-likelihoods minus its gold choice's, averaged over
documents, so the gradient weighs every choice by how much it competes with the gold one (the
gold nll alone rose +90% under a set that left the choice unchanged, RESULTS-locate.md round 27).
Off the shared context its batches are then whole documents, every choice of each.

Each document gets its own multiplier (``scale_heads`` with one row per document), so the same
backward also gives :attr:`Attribution.magnitude`, each document's ``|gradient|`` summed: a head
whose documents pull both ways keeps a large magnitude where the summed estimate cancels
(SmolLM2 induction's #1 head L16H0, +189% knocked out, has estimate +0.01 and |estimate| rank 231
of 270, magnitude rank 16). Measured against the exhaustive sweeps of both models
(``recipes/bench/bench_attribution_estimators.py``, RESULTS-locate.md, round 9): no estimator tried
puts 4 of the true top 5 in its own top 5 on more than one of six tasks, nor reaches Spearman 0.9;
what did not beat this gradient: EAP-IG-style path means (Spearman 0.11-0.56), the per-token
log-odds gradient (non-saturating; worst FE to 4/5 of the search 43 vs 12.7), coarse GradDrop over
4 blocks of layers (AtP*; 12 FE, Spearman 0.14-0.58), and a Hutchinson second-order term from 1-4
random-sign gradients (7-16 FE, noisier, never better in the search). The magnitude as the search's
order (``prior_score`` documents) cut the worst FE to 5/5 from 38.6 to 18.0 and the mean from 21.7
to 13.7, for a worse worst FE to 4/5 (12.7 -> 13.4; Gemma induction's own 12.5 -> 13.4): replayed on the
sweeps and confirmed by real runs of all six (model, task) pairs, each ending with the exact top 5.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from capsense.core.ablation import check_ablation_mode, scale_heads
from capsense.core.distributed import DistContext, split
from capsense.core.replay import BlockReplay
from capsense.errors import CapsenseError
from capsense.scoring import CHOICE_METRICS, GRADIENT_METRICS
from capsense.scoring.logits import float32_head, output_logits, scored_hidden
from capsense.scoring.probe import Probe, ProbeScorer, pad_right, per_request
from capsense.scoring.shared_context import SharedContextScorer, shared_context_groups

if TYPE_CHECKING:
    from torch import nn


#: Takes one batch of the attribution's forward, which is a clean forward (every multiplier is 1):
#: log-likelihood probes ``(requests, recorded block inputs, final hidden states, per-request
#: log-probability of the reference, per-request greedy hit)``; multiple-choice probes on the shared
#: context ``(requests, SharedBatch, the context pass's block inputs, the choices pass's, their KV
#: cache, log-probability, greedy hit)`` for every choice. :meth:`capsense.localize.evaluator.MaskEvaluator.clean_sinks`
#: hands the prefix-reuse scorers' sinks, so the clean evaluation and its prefix cache cost no second forward.
CleanSink = Callable[..., None]
KNOCKOUT_METHODS = ("cs", "exhaustive", "greedy", "thompson")


def check_gradient_metric(metric: str) -> None:
    """Raise :class:`CapsenseError` unless ``metric`` is differentiable in the head multipliers."""
    if metric not in GRADIENT_METRICS:
        raise CapsenseError(
            f"attribution needs a score with a gradient, and metric {metric!r} has none (accuracy, exact "
            f"match and pass@k count discrete outcomes): use metric nll (nats/token of the reference "
            f"continuation), choice_nll (a multiple-choice target: the gold choice among its document's), or a "
            f"knockout method that measures any metric: {', '.join(KNOCKOUT_METHODS)}"
        )


@dataclass
class Attribution:
    """One probe's clean ``nll`` and its gradient with respect to every head's multiplier."""

    nll: float
    gradient: np.ndarray  # [n_layers, n_heads], d nll / d xi at xi = 1
    ablation: str = "zero"
    magnitude: np.ndarray | None = None  # [n_layers, n_heads], sum over documents of |each one's gradient|

    @property
    def estimate(self) -> np.ndarray:
        """First-order estimate of ``nll(head ablated) - nll(clean)`` per head (positive = hurts)."""
        return -self.gradient

    def flat(self) -> np.ndarray:
        """:attr:`estimate` as a flat vector in head-index order (``layer * n_heads + head``)."""
        return self.estimate.reshape(-1)

    def flat_magnitude(self) -> np.ndarray:
        """:attr:`magnitude` (per-document ``|gradient|`` summed, >= ``|estimate|``) as a flat vector."""
        if self.magnitude is None:
            raise CapsenseError("this attribution has no per-document magnitude (computed before it existed)")
        return self.magnitude.reshape(-1)


@dataclass(frozen=True)
class BatchTerm:
    """One batch's share of a probe's attribution: its part of the nll and of the gradient."""

    batch: int
    nll: float
    gradient: np.ndarray  # [n_layers, n_heads], float64
    magnitude: np.ndarray  # [n_layers, n_heads], float64: sum over the batch's documents of |its gradient|


@contextmanager
def _frozen(model: nn.Module):
    """Parameters without grad for the block: the backward computes only the multipliers' gradient."""
    flags = [p.requires_grad for p in model.parameters()]
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        yield
    finally:
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)


class AttributionScorer:
    """The score (``metric``: nll, or a multiple-choice probe's choice_nll) of one probe as a differentiable
    function of the head multipliers, batched."""

    def __init__(self, model: nn.Module, probe: Probe, batch_size: int = 16, ablation: str = "zero",
                 means: dict[int, torch.Tensor] | None = None, metric: str = "nll") -> None:
        check_gradient_metric(metric)
        if metric in CHOICE_METRICS and probe.kind != "multiple_choice":
            raise CapsenseError(f"metric {metric!r} compares a document's choices, and {probe.name!r} is a "
                                f"{probe.kind} task: use nll, or a multiple-choice task")
        self.metric = metric
        self.ablation = check_ablation_mode(ablation)
        if self.ablation == "mean" and means is None:
            raise CapsenseError("mean ablation needs per-head `means` (capsense.core.ablation.compute_head_means)")
        self.means = means if self.ablation == "mean" else None
        self.base = ProbeScorer(model, probe, batch_size=batch_size)  # tokenization, order, padding
        self.model, self.probe, self.layout = model, probe, self.base.layout
        self.batch_size = max(1, int(batch_size))
        counted = probe.counted
        self._counted = counted
        if metric in CHOICE_METRICS:  # every choice, whole documents together (longest first, as the base orders)
            by_doc: dict[int, list[int]] = {}
            for r in self.base._order:
                by_doc.setdefault(int(probe.doc_of[r]), []).append(r)
            self._docs = list(by_doc.values())
            self.requests = [r for reqs in self._docs for r in reqs]
        else:
            self.requests = [r for r in self.base._order if counted[r]]
        self.n_tokens = sum(len(self.base._targets[r]) for r in self.requests if counted[r])
        # multiple choice: the shared-context scorer's passes and batches (whole documents), where valid
        self.shared = SharedContextScorer(model, probe, batch_size=batch_size) if shared_context_groups(probe) else None

    def _batch_nll(self, reqs: Sequence[int], keep: Callable[..., None] | None = None) -> torch.Tensor:
        """This batch's share of the probe's nll (its nats over the probe's token count); ``keep``
        receives the final hidden states and the per-request log-probabilities and greedy hits."""
        seqs = [self.base._inputs[r] for r in reqs]
        ids, att = pad_right(seqs, self.base.pad_id)
        device = self.base.device
        rows, pos, tgt = [], [], []
        for i, (s, r) in enumerate(zip(seqs, reqs)):
            t = self.base._targets[r]
            rows.extend([i] * len(t))
            pos.extend(range(len(s) - len(t), len(s)))
            tgt.extend(t)
        hidden = scored_hidden(self.model, ids.to(device), att.to(device))
        logp, hit = self._token_logp(hidden[torch.tensor(rows, device=device), torch.tensor(pos, device=device)],
                                     torch.tensor(tgt, device=device))
        if keep is not None:
            lengths = [len(self.base._targets[r]) for r in reqs]
            keep(hidden.detach(), *per_request(lengths, logp.detach().cpu().double().numpy(), hit.cpu().numpy()))
        return self._loss(logp, reqs, [len(self.base._targets[r]) for r in reqs])

    def _loss(self, logp: torch.Tensor, reqs: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
        """This batch's share of the probe's score from its tokens' log-probabilities (``lengths``: each
        request's, in order): the counted requests' nats over the probe's tokens, or for ``choice_nll``
        each document's ``logsumexp`` over its choices minus its gold choice, over the probe's documents."""
        if self.metric not in CHOICE_METRICS:
            counted = torch.tensor([bool(self._counted[r]) for r, n in zip(reqs, lengths) for _ in range(n)], device=logp.device)
            return -logp[counted].sum() / self.n_tokens
        owner = torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)], device=logp.device)
        per_req = torch.zeros(len(reqs), dtype=logp.dtype, device=logp.device).index_add(0, owner, logp)
        doc, gold = self.probe.doc_of[list(reqs)], self._counted[list(reqs)]
        loss = logp.new_zeros(())
        for d in dict.fromkeys(doc.tolist()):
            loss = loss + torch.logsumexp(per_req[torch.from_numpy(np.flatnonzero(doc == d)).to(logp.device)], 0)
        return (loss - per_req[torch.from_numpy(np.flatnonzero(gold)).to(logp.device)].sum()) / self.probe.n_docs

    def _token_logp(self, h: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each target token's log-probability from the final hidden state predicting it (differentiable,
        at least float32) and whether it is the greedy choice."""
        logits = output_logits(self.model, h)
        logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1).gather(1, tgt[:, None])
        return logp[:, 0], logits.detach().argmax(-1) == tgt

    @property
    def on_shared_context(self) -> bool:
        """Batches are whole multiple-choice documents on the shared context (the shared-context
        scorer's own batches and passes, after its first-batch check against the plain path)."""
        return self.shared is not None and self.shared.checked()

    @property
    def n_batches(self) -> int:
        """Forward-and-backward passes one attribution takes."""
        return len(self._all_batches())

    def batch_keys(self) -> frozenset[tuple[int, ...]]:
        """The request batches of this attribution's forward, as a prefix scorer keys its own
        (:meth:`~capsense.scoring.prefix.TakesClean.batch_keys`): a clean sink takes them only where they match."""
        return frozenset(tuple(reqs) for reqs in self._all_batches())

    def _all_batches(self) -> list[list[int]]:
        if self.on_shared_context:
            return [reqs for _, _, reqs in self.shared._batches(torch.zeros(1, 1, 1, dtype=torch.bool))]
        return list(self._batches())

    def _batches(self):
        """Batches of the counted requests (each document's reference, or its gold choice); for
        ``choice_nll`` whole documents, as many as fit in ``batch_size`` requests (at least one)."""
        if self.metric not in CHOICE_METRICS:
            for b0 in range(0, len(self.requests), self.batch_size):
                yield self.requests[b0 : b0 + self.batch_size]
            return
        batch: list[int] = []
        for reqs in self._docs:
            if batch and len(batch) + len(reqs) > self.batch_size:
                yield batch
                batch = []
            batch = batch + reqs
        if batch:
            yield batch

    @torch.no_grad()
    def score(self, scale: torch.Tensor) -> float:
        """The probe's nll with every head's slice scaled by ``scale`` [n_layers, n_heads]."""
        return sum(float(self._forward(reqs, scale.detach(), None)) for reqs in self._all_batches())

    def _multipliers(self, scale: torch.Tensor | None) -> torch.Tensor:
        dtype = torch.float64 if next(self.model.parameters()).dtype == torch.float64 else torch.float32
        xi = torch.ones(self.layout.n_layers, self.layout.n_heads, dtype=dtype) if scale is None else scale.detach().to(dtype)
        return xi.clone().requires_grad_(True)

    def terms(self, batches: Sequence[int], scale: torch.Tensor | None = None, sink: CleanSink | None = None) -> list[BatchTerm]:
        """The nll share and gradient of each batch in ``batches`` (indices below :attr:`n_batches`),
        each from its own forward and backward at ``scale`` (default: all ones, the clean model).
        ``sink`` (the clean model only: ``scale`` None) receives each batch's forward as a clean one (under mean
        ablation too: :func:`~capsense.core.ablation.scale_heads` leaves the clean forward exact)."""
        if sink is not None and scale is not None:
            raise CapsenseError("only the clean model's attribution is a clean forward (`sink`)")
        if sink is not None and self.shared is not None and not self.on_shared_context:
            raise CapsenseError(f"{self.probe.name!r}: a multiple-choice clean forward is handed on (`sink`) only on "
                                f"the shared context, which failed its check here")
        every = self._all_batches()
        xi = self._multipliers(scale).detach()
        out = []
        with _frozen(self.model), torch.enable_grad():
            for b in batches:
                rows = xi[None].repeat(self._n_docs(every[b]), 1, 1).requires_grad_(True)  # one multiplier per document
                loss = self._forward(every[b], rows, sink)
                (grad,) = torch.autograd.grad(loss, rows)
                g = grad.detach().cpu().double()
                out.append(BatchTerm(b, float(loss.detach()), g.sum(0).numpy(), g.abs().sum(0).numpy()))
        return out

    def _n_docs(self, reqs: list[int]) -> int:
        whole = self.on_shared_context or self.metric in CHOICE_METRICS  # batches of whole documents
        return len({int(self.probe.doc_of[r]) for r in reqs}) if whole else len(reqs)

    def _rows(self, reqs: list[int], scale: torch.Tensor) -> torch.Tensor:
        """``scale`` (one row per document of the batch, or one for all) as one row per request."""
        if scale.dim() == 2 or self.metric not in CHOICE_METRICS:
            return scale
        docs = list(dict.fromkeys(int(self.probe.doc_of[r]) for r in reqs))
        return scale[torch.tensor([docs.index(int(self.probe.doc_of[r])) for r in reqs])]

    def _forward(self, reqs: list[int], scale: torch.Tensor, sink: CleanSink | None) -> torch.Tensor:
        """This batch's share of the nll under ``scale`` (one row per document, or one for all), its
        clean forward handed to ``sink`` when there is one."""
        if self.on_shared_context:
            return self._shared_nll(reqs, scale, sink)
        with scale_heads(self.model, self._rows(reqs, scale), self.means):
            if sink is None:
                return self._batch_nll(reqs)
            replay, kept = BlockReplay(self.model), []
            loss = replay.record(lambda: self._batch_nll(reqs, lambda *x: kept.extend(x)))
        sink(list(reqs), replay.detach(), *kept)
        return loss

    def _shared_nll(self, reqs: list[int], scale: torch.Tensor, sink: CleanSink | None) -> torch.Tensor:
        """:meth:`_forward` on the shared context: each document's context once (its multiplier row),
        then all its choices on top of the cached keys and values (the same row); scored as in
        :meth:`_batch_nll` (:meth:`_loss`), and the gradient flows back through the cache."""
        sh = self.shared
        b = sh._shared_batch(reqs)
        replays = None if sink is None else (BlockReplay(self.model), BlockReplay(self.model))  # only a sink keeps them

        def run(i: int, fn):
            return fn() if replays is None else replays[i].record(fn)

        with scale_heads(self.model, scale, self.means):
            ctx_hidden, cache = run(0, lambda: sh._context_pass(b))
        with scale_heads(self.model, scale if scale.dim() == 2 else scale[b.doc_idx], self.means):
            hid = run(1, lambda: sh._choices_pass(b, cache))
        logp, hit = self._token_logp(*sh._scored_states(b, ctx_hidden, hid))
        if replays is not None:
            lp, ok = per_request([len(t) for t in b.conts], logp.detach().cpu().double().numpy(), hit.cpu().numpy())
            sink(list(reqs), b, replays[0].detach(), replays[1].detach(), cache, lp, ok)
        return self._loss(logp, reqs, [len(t) for t in b.conts])

    def combine(self, terms: Sequence[BatchTerm]) -> Attribution:
        """The probe's :class:`Attribution` from all of its batch terms, summed in batch order
        (the same sum whichever processes computed them, so the result is the same to the bit)."""
        ordered = sorted(terms, key=lambda t: t.batch)
        if [t.batch for t in ordered] != list(range(self.n_batches)):
            raise CapsenseError(f"attribution of {self.probe.name!r} needs each of its {self.n_batches} batches once, "
                                   f"got {[t.batch for t in ordered]}")
        shape = (self.layout.n_layers, self.layout.n_heads)
        total, grad, mag = 0.0, np.zeros(shape), np.zeros(shape)
        for t in ordered:
            total += t.nll
            grad = grad + t.gradient
            mag = mag + t.magnitude
        return Attribution(total, grad, self.ablation, mag)

    def attribute(self, scale: torch.Tensor | None = None) -> Attribution:
        """The nll and its gradient at ``scale`` (default: all ones, the clean model)."""
        return self.combine(self.terms(range(self.n_batches), scale))


def attribution_scorers(model: nn.Module, probes: dict[str, Probe], batch_size: int = 16, ablation: str = "zero",
                        means: dict[int, torch.Tensor] | None = None,
                        metrics: dict[str, str] | None = None) -> dict[str, AttributionScorer]:
    """One :class:`AttributionScorer` per probe, each in its metric (``metrics``: probe -> one of
    :data:`GRADIENT_METRICS`; nll where none is given)."""
    metrics = metrics or {}
    return {name: AttributionScorer(model, p, batch_size, ablation, means, metrics.get(name, "nll"))
            for name, p in probes.items()}


def attribute_probes(model: nn.Module, probes: dict[str, Probe], batch_size: int = 16, ablation: str = "zero",
                     means: dict[int, torch.Tensor] | None = None, ctx: DistContext | None = None,
                     sinks: dict[str, CleanSink] | None = None,
                     scorers: dict[str, AttributionScorer] | None = None) -> dict[str, Attribution]:
    """:class:`Attribution` of every probe (target and controls), one forward and backward per batch.

    Under several processes (``ctx``) the batches of all probes are cut into one contiguous
    share per process; every process computes its share, the terms are exchanged, and each
    probe's terms are summed in batch order, so every process (and a lone one) gets the same
    result to the bit. ``sinks`` (probe -> :data:`CleanSink`; one process only: each process
    would see only its share) receive the forwards as clean ones. ``scorers``: the caller's
    :func:`attribution_scorers` (a probe in another metric than nll, or sinks matched to their batches); the
    settings above then do not apply.
    """
    ctx = ctx or DistContext()
    sinks = sinks or {}
    if sinks and ctx.distributed:
        raise CapsenseError("`sinks` take every batch of a probe, and under several processes each sees only its share")
    scorers = scorers or attribution_scorers(model, probes, batch_size, ablation, means)
    jobs = [(name, b) for name, sc in scorers.items() for b in range(sc.n_batches)]
    mine: dict[str, list[int]] = {}
    for name, b in split(jobs, ctx)[ctx.rank]:
        mine.setdefault(name, []).append(b)
    with float32_head(model):  # the parameters are frozen in the passes, so the kept float32 head serves them
        local = [(name, t) for name, batches in mine.items() for t in scorers[name].terms(batches, sink=sinks.get(name))]
    terms = [item for share in ctx.gather(local) for item in share]
    return {name: sc.combine([t for n, t in terms if n == name]) for name, sc in scorers.items()}

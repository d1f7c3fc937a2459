"""Capability probes: (context, continuation) requests tokenized once, scored under knockouts.

A :class:`Probe` holds the requests of a task, built from an lm-eval task (its own
requests: log-likelihood, multiple choice, or a perplexity task's windows of running text; for a
generation task, its reference answers: :func:`build_probe`; the tokenization is
:mod:`capsense.scoring.requests`) or from (context, continuation) pairs. :class:`ProbeScorer` scores it under many
knockout masks: per mask, ``nll`` (nats/token of the reference continuation,
token-weighted over documents; for multiple choice the gold choice's) and ``acc`` (greedy exact
match of the continuation, or multiple-choice accuracy; for a perplexity task the share of its windows of
text predicted wholly greedily, which means little: a run refuses ``acc`` as its metric and its report omits it);
a multiple-choice probe adds
``choice_nll`` (nats per document of the gold choice under the softmax over its document's
choices: what ``acc`` decides by, as a smooth loss). Logits are computed only at the scored positions.

Tokenization follows lm-eval's ``HFLM``: trailing context spaces move onto the
continuation, ``context + continuation`` is encoded whole and split at the context length.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from capsense.errors import CapsenseError
from capsense.scoring.logits import scored_hidden, token_scores
from capsense.core.ablation import HeadAblator
from capsense.core.arch import head_layout
from capsense.core.placement import input_device
from capsense.scoring.requests import (ROLLING, ROLLING_WINDOW, encode_pair, gold_index, load_task, quiet_request_building,
                                       rolling_requests, sample_doc_ids)

if TYPE_CHECKING:
    from torch import nn

ProbeKind = Literal["loglikelihood", "multiple_choice"]


@dataclass
class Probe:
    """Tokenized requests of one task. Request ``r`` belongs to document ``doc_of[r]``."""

    name: str
    kind: ProbeKind
    context_ids: list[list[int]]
    continuation_ids: list[list[int]]
    doc_of: np.ndarray  # [n_requests] position of the request's document in doc_ids
    doc_ids: list[int]  # the task's document ids, in probe order
    gold: np.ndarray | None = None  # [n_docs] gold choice index (multiple choice)
    choice_of: np.ndarray | None = None  # [n_requests] choice index (multiple choice)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n_docs(self) -> int:
        return len(self.doc_ids)

    @property
    def n_requests(self) -> int:
        return len(self.context_ids)

    @property
    def counted(self) -> np.ndarray:
        """``[n_requests]`` the requests the nll counts: all, or for multiple choice the gold choices."""
        if self.kind != "multiple_choice":
            return np.ones(self.n_requests, dtype=bool)
        assert self.gold is not None and self.choice_of is not None
        return self.choice_of == self.gold[self.doc_of]

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_pairs(
        cls, name: str, pairs: Sequence[tuple[str, str]], tokenizer, doc_ids: Sequence[int] | None = None
    ) -> Probe:
        """A log-likelihood probe from (context, continuation) strings."""
        ctx, cont = zip(*(encode_pair(tokenizer, c, t) for c, t in pairs)) if pairs else ((), ())
        n = len(pairs)
        return cls(name=name, kind="loglikelihood", context_ids=list(ctx), continuation_ids=list(cont),
                   doc_of=np.arange(n), doc_ids=list(doc_ids) if doc_ids is not None else list(range(n)))

    @classmethod
    def from_task(cls, task: str, tokenizer, limit: int | None = None, seed: int = 0,
                  include_path: Sequence[str | os.PathLike] = (), exclude: Sequence[int] = (),
                  doc_ids: Sequence[int] | None = None, window: int = ROLLING_WINDOW) -> Probe:
        """Build a probe from an lm-eval task's own requests.

        ``limit`` samples that many documents with ``seed`` (deterministic), skipping
        ``exclude``; ``doc_ids`` picks documents explicitly; ``window``: a perplexity task's
        (:func:`~capsense.scoring.requests.rolling_requests`).
        """
        task_obj = load_task(task, include_path, tokenizer)
        n_total = len(task_obj.eval_docs)
        if doc_ids is None:
            doc_ids = sample_doc_ids(task, n_total, limit, seed, exclude)
        return cls.from_loaded_task(task, task_obj, list(doc_ids), tokenizer, window)

    @classmethod
    def from_loaded_task(cls, name: str, task_obj, doc_ids: list[int], tokenizer, window: int = ROLLING_WINDOW) -> Probe:
        """A probe of the documents ``doc_ids`` of an already loaded lm-eval task: its own requests, or for a
        generation task (``output_type: generate_until``) its reference answers (:meth:`from_reference_answers`)."""
        if task_obj.OUTPUT_TYPE == "generate_until":
            return cls.from_reference_answers(name, task_obj, tokenizer, doc_ids)
        with quiet_request_building():
            task_obj.build_all_requests(samples=list(doc_ids), rank=0, world_size=1)
        return cls.from_instances(name, task_obj, list(doc_ids), tokenizer, len(task_obj.eval_docs), window)

    @classmethod
    def from_reference_answers(cls, task: str, task_obj, tokenizer, doc_ids: Sequence[int]) -> Probe:
        """A log-likelihood probe of a generation task's documents ``doc_ids``: each request's prompt paired with the
        document's reference target (``acc`` is then greedy exact match of the reference)."""
        docs = task_obj.eval_docs
        doc_ids = list(doc_ids)
        with quiet_request_building():
            task_obj.build_all_requests(samples=list(doc_ids), rank=0, world_size=1)
        by_rank = sorted(doc_ids)  # lm-eval 0.4.13 numbers sampled docs 0..n-1 in dataset order
        delim = task_obj.config.target_delimiter or ""
        pairs, ids = [], []
        for inst in task_obj.instances:
            d = by_rank[inst.doc_id] if inst.doc_id < len(by_rank) else inst.doc_id
            target = task_obj.doc_to_target(docs[d])
            target = target[0] if isinstance(target, list) else target
            pairs.append((inst.args[0], delim + str(target)))
            ids.append(d)
        probe = cls.from_pairs(task, pairs, tokenizer, doc_ids=ids)
        probe.meta = {"n_task_docs": len(docs), "proxy": "reference answer of a generation task"}
        return probe

    @classmethod
    def from_instances(cls, name: str, task_obj, doc_ids: list[int], tokenizer, n_total: int,
                       window: int = ROLLING_WINDOW) -> Probe:
        """The probe of lm-eval's requests: one per log-likelihood request or choice, and one per window of
        ``window`` tokens of a perplexity task's document (one window for a document that fits)."""
        instances = task_obj.instances
        kinds = {inst.request_type for inst in instances}
        if not instances:
            raise CapsenseError(f"task {name!r} built no requests")
        rolling = kinds == {ROLLING}
        if kinds - {"loglikelihood"} and not rolling:
            raise CapsenseError(
                f"task {name!r} has {sorted(kinds)} requests; probes score log-likelihood, multiple-choice, "
                f"perplexity ({ROLLING}) and, by their reference answers, generation tasks"
            )
        position = {d: i for i, d in enumerate(doc_ids)}
        # lm-eval 0.4.13 numbers docs picked by `samples` 0..n-1 in dataset order, not by id.
        seen = {inst.doc_id for inst in instances}
        if not seen <= position.keys() and seen <= set(range(len(doc_ids))):
            by_rank = sorted(doc_ids)
            position = {r: position[d] for r, d in enumerate(by_rank)}
        multiple = task_obj.OUTPUT_TYPE == "multiple_choice"
        ctx, cont, doc_of, choice_of = [], [], [], []
        for inst in instances:
            for c, t in rolling_requests(tokenizer, inst.args[0], window) if rolling else [encode_pair(tokenizer, *inst.args[:2])]:
                ctx.append(c)
                cont.append(t)
                doc_of.append(position[inst.doc_id])
                choice_of.append(inst.idx)
        if not ctx:  # (a perplexity task whose documents are empty strings: no token to predict)
            raise CapsenseError(f"task {name!r}: its documents have no text to score")
        gold = None
        if multiple:
            docs = task_obj.eval_docs
            gold = np.array([gold_index(task_obj, docs[d]) for d in doc_ids])
        return cls(
            name=name,
            kind="multiple_choice" if multiple else "loglikelihood",
            context_ids=ctx,
            continuation_ids=cont,
            doc_of=np.array(doc_of),
            doc_ids=doc_ids,
            gold=gold,
            choice_of=np.array(choice_of) if multiple else None,
            meta={"n_task_docs": n_total, **({"rolling_window": window} if rolling else {})},
        )


def build_probe(
    task: str, tokenizer, limit: int | None, seed: int, include_path: Sequence[str | os.PathLike] = (),
    exclude: Sequence[int] = (), window: int = ROLLING_WINDOW,
) -> Probe:
    """A probe for any lm-eval task: its own requests, or for a generation task
    (``output_type: generate_until``, GSM8K-style) the reference answer's nats/token, a fast
    proxy for the task's own generated metric (see :meth:`Probe.from_reference_answers`).
    ``window``: a perplexity task's documents are cut into requests of at most this many tokens, as lm-eval cuts
    them at the model's length (:func:`model_max_length`, which a locate run passes)."""
    task_obj = load_task(task, include_path, tokenizer)
    doc_ids = sample_doc_ids(task, len(task_obj.eval_docs), limit, seed, exclude)
    return Probe.from_loaded_task(task, task_obj, doc_ids, tokenizer, window)


def model_max_length(model: nn.Module) -> int:
    """The longest sequence a probe's request may be for ``model`` (its ``max_position_embeddings``, else 4096)."""
    return int(getattr(model.config, "max_position_embeddings", 4096) or 4096)


class ProbeScorer:
    """Scores one probe under knockout masks with one model, without reloading anything.

    ``masks_per_forward`` > 1 packs several masks into one batch (rows = mask x request):
    it pays on a GPU; on a few CPU cores the forward pass is compute-bound and 1 is best.
    """

    def __init__(
        self,
        model: nn.Module,
        probe: Probe,
        ablator: HeadAblator | None = None,
        batch_size: int = 16,
        masks_per_forward: int = 1,
        max_length: int | None = None,
    ) -> None:
        self.model = model
        self.probe = probe
        self.ablator = ablator or HeadAblator(model)
        self.layout = head_layout(model)
        self.batch_size = int(batch_size)
        self.masks_per_forward = max(1, int(masks_per_forward))
        self.device = input_device(model)
        self.max_length = max_length or model_max_length(model)
        self.pad_id = 0
        seqs = [(c + t)[-(self.max_length + 1) :][:-1] for c, t in zip(probe.context_ids, probe.continuation_ids)]
        self._inputs = seqs
        self._targets = [t[-len(s) :] if len(t) > len(s) else t for s, t in zip(seqs, probe.continuation_ids)]
        # Longest first, so the first batch shows the peak memory.
        self._order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))

    check_s = 0.0  # wall time of this scorer's first-batch self-checks (a subclass's), wherever they ran

    @contextmanager
    def _timed_check(self) -> Iterator[None]:
        """Adds the block's wall time to :attr:`check_s`: the checks cost no forward-equivalents, so only timing shows them."""
        t0 = time.perf_counter()
        yield
        self.check_s += time.perf_counter() - t0

    def score(self, knockouts: torch.Tensor | None = None) -> dict[str, np.ndarray]:
        """Per-mask ``nll`` (nats/token) and ``acc`` for ``knockouts`` [m, layers, heads]."""
        if knockouts is None:
            knockouts = self.ablator.knockouts(())  # the clean model
        knockouts = knockouts.bool()
        m = knockouts.shape[0]
        logprob = np.zeros((m, self.probe.n_requests))
        greedy = np.zeros((m, self.probe.n_requests), dtype=bool)
        for m0, ko, reqs in self._batches(knockouts):
            lp, gr = self._score_batch(ko, reqs)
            for j in range(ko.shape[0]):
                logprob[m0 + j, reqs] = lp[j]
                greedy[m0 + j, reqs] = gr[j]
        return self.aggregate(logprob, greedy)

    def _batches(self, knockouts: torch.Tensor):
        """(first mask index, masks, requests) of every forward pass."""
        k = self.masks_per_forward
        per_batch = max(1, self.batch_size // k)
        for m0 in range(0, knockouts.shape[0], k):
            for b0 in range(0, len(self._order), per_batch):
                yield m0, knockouts[m0 : m0 + k], self._order[b0 : b0 + per_batch]

    def _score_batch(self, ko: torch.Tensor, reqs: list[int]) -> tuple[np.ndarray, np.ndarray]:
        return self._run(ko, reqs)

    @torch.no_grad()
    def _run(self, ko: torch.Tensor, reqs: list[int]) -> tuple[np.ndarray, np.ndarray]:
        k = ko.shape[0]
        seqs = [self._inputs[r] for r in reqs]
        ids, att = pad_right(seqs, self.pad_id)
        ids, att = ids.repeat(k, 1).to(self.device), att.repeat(k, 1).to(self.device)
        row_ko = ko.repeat_interleave(len(seqs), dim=0) if k > 1 else ko
        # (row, position, target) of every scored token
        rows, pos, tgt = [], [], []
        for i, (s, r) in enumerate(zip(seqs, reqs)):
            t = self._targets[r]
            start = len(s) - len(t)
            rows.extend([i] * len(t))
            pos.extend(range(start, len(s)))
            tgt.extend(t)
        n_tok = len(tgt)
        rows_t = torch.tensor(rows).repeat(k) + torch.arange(k).repeat_interleave(n_tok) * len(seqs)
        pos_t = torch.tensor(pos).repeat(k)
        tgt_t = torch.tensor(tgt, device=self.device).repeat(k)
        hidden = self._hidden(ids, att, row_ko, reqs)
        tok_lp, tok_ok = token_scores(self.model, hidden[rows_t.to(hidden.device), pos_t.to(hidden.device)], tgt_t)
        tok_lp, tok_ok = tok_lp.reshape(k, n_tok), tok_ok.reshape(k, n_tok)
        lengths = [len(self._targets[r]) for r in reqs]
        lp, gr = zip(*(per_request(lengths, tok_lp[j], tok_ok[j]) for j in range(k)))
        return np.stack(lp), np.stack(gr)

    def _hidden(self, ids: torch.Tensor, att: torch.Tensor, row_ko: torch.Tensor, reqs: list[int]) -> torch.Tensor:
        """Final hidden states of one batch under ``row_ko`` (subclasses may reuse a clean prefix)."""
        with self.ablator.apply(row_ko):
            return scored_hidden(self.model, ids, att)

    def aggregate(self, logprob: np.ndarray, greedy: np.ndarray) -> dict[str, np.ndarray]:
        """Per-mask metrics from per-request log-probabilities and greedy flags."""
        p = self.probe
        n_tokens = np.array([len(t) for t in self._targets])
        if p.kind == "multiple_choice":
            is_gold = p.counted
            nll = -logprob[:, is_gold].sum(1) / n_tokens[is_gold].sum()
            acc, choice = np.zeros(logprob.shape[0]), np.zeros(logprob.shape[0])
            for d in range(p.n_docs):
                sel = np.flatnonzero(p.doc_of == d)
                best = sel[np.argmax(logprob[:, sel], axis=1)]
                acc += p.choice_of[best] == p.gold[d]
                choice += np.logaddexp.reduce(logprob[:, sel], axis=1) - logprob[:, sel[is_gold[sel]]].sum(1)
            return {"nll": nll, "acc": acc / p.n_docs, "choice_nll": choice / p.n_docs}
        nll = -logprob.sum(1) / n_tokens.sum()
        return {"nll": nll, "acc": greedy.mean(1)}


class KeepsRequestScores:
    """Mixin for a :class:`ProbeScorer` (of any kind): keeps the per-request log-probabilities and
    greedy flags its last ``aggregate`` saw (``last``; fresh arrays each call), for per-document splits."""

    last: tuple[np.ndarray, np.ndarray] | None = None

    def aggregate(self, logprob: np.ndarray, greedy: np.ndarray) -> dict[str, np.ndarray]:
        self.last = (logprob, greedy)
        return super().aggregate(logprob, greedy)


def per_request(lengths: Sequence[int], tok_lp: np.ndarray, tok_ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token log-probabilities summed and greedy hits and-ed per request (``lengths``: each
    request's scored tokens, in order)."""
    bounds = np.cumsum([0, *lengths])[:-1]
    return np.add.reduceat(tok_lp, bounds), np.logical_and.reduceat(tok_ok, bounds)


def pad_right(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids and attention mask, ``[len(seqs), longest]``."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        att[i, : len(s)] = 1
    return ids, att

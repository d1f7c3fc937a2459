"""Shared-context scoring: a multiple-choice document's context runs once, not once per choice.

lm-eval scores a 4-choice question as four requests that repeat the same context; HellaSwag,
ARC, BoolQ and MMLU (the paper's controls) spend most of their tokens there. Under a mask,
:class:`SharedContextScorer` runs each document's context once with the KV cache on, then
all its choices in one batch on top of the cached keys and values (each choice at the
positions it has in the full sequence), with the ablation active in both passes.

The result equals scoring every request in full. On the first batch the scorer checks this
against the plain path (clean model); where an architecture's cache or masking makes it
differ (sliding windows, hybrid caches), it falls back to the plain path for good.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from capsense.core.precision import computes_in_float32
from capsense.scoring.logits import token_scores
from capsense.scoring.probe import ProbeScorer, pad_right, per_request


def _cache_argument(base) -> str:
    """The name a base model's forward takes its KV cache under: ``cache`` since transformers 5.2x
    (``past_key_values`` still works there, with a deprecation warning), ``past_key_values`` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


@dataclass
class SharedBatch:
    """One batch of whole documents: each context once (right-padded), each choice once, and
    for each choice the row of its document's context."""

    ctx_ids: torch.Tensor
    ctx_att: torch.Tensor
    doc_idx: torch.Tensor
    conts: list[list[int]]
    cont_ids: torch.Tensor
    cont_att: torch.Tensor
    ctx_len: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.ctx_len = self.ctx_att.sum(1)


def shared_context_groups(probe) -> list[list[int]] | None:
    """Requests grouped per document when every document's requests share one context, else None."""
    if probe.kind != "multiple_choice":
        return None
    groups: dict[int, list[int]] = {}
    for r, d in enumerate(probe.doc_of):
        groups.setdefault(int(d), []).append(r)
    for reqs in groups.values():
        first = probe.context_ids[reqs[0]]
        if len(reqs) < 2 or any(probe.context_ids[r] != first for r in reqs[1:]):
            return None
    return [groups[d] for d in sorted(groups)]


class SharedContextScorer(ProbeScorer):
    """A :class:`~capsense.scoring.probe.ProbeScorer` that runs each multiple-choice context once per mask."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.groups = shared_context_groups(self.probe)
        too_long = any(len(c) + len(t) > self.max_length for c, t in zip(self.probe.context_ids, self.probe.continuation_ids))
        self.enabled = self.groups is not None and self.masks_per_forward == 1 and not too_long
        self._checked = False
        if self.groups is not None:
            # longest documents first, as the plain path orders requests
            self.groups.sort(key=lambda g: -max(len(self._inputs[r]) for r in g))

    def score(self, knockouts: torch.Tensor | None = None) -> dict[str, np.ndarray]:
        self.checked()
        return super().score(knockouts)

    def checked(self) -> bool:
        """Whether the shared context is on, after the first-batch check (run now if it has not run)."""
        if self.enabled and not self._checked:
            self._check()
        return self.enabled

    def _batches(self, knockouts: torch.Tensor):
        if not self.enabled:
            yield from super()._batches(knockouts)
            return
        per_batch = self._docs_per_batch()
        for j in range(knockouts.shape[0]):
            for g0 in range(0, len(self.groups), per_batch):
                yield j, knockouts[j : j + 1], [r for g in self.groups[g0 : g0 + per_batch] for r in g]

    def _score_batch(self, ko: torch.Tensor, reqs: list[int]) -> tuple[np.ndarray, np.ndarray]:
        if not self.enabled:
            return super()._score_batch(ko, reqs)
        lp, gr = self._run_shared(ko, reqs)
        return lp[None], gr[None]

    def _docs_per_batch(self) -> int:
        n_choices = max(len(g) for g in self.groups)
        return max(1, self.batch_size // n_choices)

    def _check(self) -> None:
        """Shared and plain scoring agree on the first batch of the clean model, or sharing is off."""
        self._checked = True
        reqs = [r for g in self.groups[: self._docs_per_batch()] for r in g]
        clean = self.ablator.knockouts(())
        with self._timed_check():
            lp, _ = self._run_shared(clean, reqs)
            plain_lp, _ = self._run(clean, reqs)
        tol = 1e-4 if computes_in_float32(self.model) else 5e-2
        if not np.allclose(lp, plain_lp[0], atol=tol * max(1.0, float(np.abs(plain_lp).max())), rtol=0):
            self.enabled = False

    @torch.no_grad()
    def _run_shared(self, ko: torch.Tensor, reqs: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Per-request log-probability and greedy flag; ``reqs`` are whole documents' requests."""
        b = self._shared_batch(reqs)
        with self.ablator.apply(ko):
            ctx_hidden, cache = self._context_pass(b)
            hid = self._choices_pass(b, cache)
        return self._shared_scores(b, ctx_hidden, hid)

    def _shared_batch(self, reqs: list[int]) -> SharedBatch:
        p = self.probe
        docs = list(dict.fromkeys(int(p.doc_of[r]) for r in reqs))
        first = {d: next(r for r in reqs if int(p.doc_of[r]) == d) for d in docs}
        ctx_ids, ctx_att = pad_right([p.context_ids[first[d]] for d in docs], self.pad_id)
        conts = [p.continuation_ids[r] for r in reqs]
        cont_ids, cont_att = pad_right(conts, self.pad_id)
        doc_idx = torch.tensor([docs.index(int(p.doc_of[r])) for r in reqs])
        return SharedBatch(ctx_ids, ctx_att, doc_idx, conts, cont_ids, cont_att)

    def _context_pass(self, b: SharedBatch):
        """Every document's context once, with the KV cache on: (final hidden states, the cache)."""
        base = getattr(self.model, self.model.base_model_prefix)
        out = base(input_ids=b.ctx_ids.to(self.device), attention_mask=b.ctx_att.to(self.device), use_cache=True)
        cache = getattr(out, "cache", None)  # transformers >= 5.2x names it so; before, ``past_key_values``
        return out[0], cache if cache is not None else out.past_key_values

    def _choices_pass(self, b: SharedBatch, cache) -> torch.Tensor:
        """Every choice on top of its document's cached context (the cache is reordered to one row
        per choice and extended); the final hidden states ``[n_requests, longest choice, d]``."""
        base = getattr(self.model, self.model.base_model_prefix)
        dev = self.device
        cache.reorder_cache(b.doc_idx.to(dev))
        att = torch.cat([b.ctx_att[b.doc_idx], b.cont_att], dim=1).to(dev)
        pos = (b.ctx_len[b.doc_idx][:, None] + torch.arange(b.cont_ids.shape[1])[None, :]).to(dev)
        return base(input_ids=b.cont_ids.to(dev), attention_mask=att, position_ids=pos, use_cache=True,
                    **{_cache_argument(base): cache})[0]

    def _shared_scores(self, b: SharedBatch, ctx_hidden: torch.Tensor, hid: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Per-request log-probability and greedy flag from the two passes' final hidden states."""
        h, tgt = self._scored_states(b, ctx_hidden, hid)
        tok_lp, tok_ok = token_scores(self.model, h, tgt)
        return per_request([len(t) for t in b.conts], tok_lp, tok_ok)

    def _scored_states(self, b: SharedBatch, ctx_hidden: torch.Tensor, hid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The final hidden state that predicts each choice token, in request order (``[n_tokens, d]``),
        and the tokens (the first one is predicted from the context's last position)."""
        odev = ctx_hidden.device  # the last layer's device (another one than the input's under a device_map)
        n_docs = ctx_hidden.shape[0]
        last = ctx_hidden[torch.arange(n_docs, device=odev), (b.ctx_len - 1).to(odev)]  # predicts each choice's first token
        rows, cols, tgt = [], [], []
        for i, t in enumerate(b.conts):
            rows.extend([i] * len(t))
            cols.extend(range(-1, len(t) - 1))  # -1: the context's last position
            tgt.extend(t)
        hdev = hid.device
        rows_t, cols_t = torch.tensor(rows, device=hdev), torch.tensor(cols, device=hdev)
        h = torch.where((cols_t < 0)[:, None], last.to(hdev)[b.doc_idx.to(hdev)[rows_t]], hid[rows_t, cols_t.clamp(min=0)])
        return h, torch.tensor(tgt, device=self.device)

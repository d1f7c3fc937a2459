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

from typing import Any

import numpy as np
import torch

from capsense.scoring.logits import token_scores
from capsense.scoring.probe import ProbeScorer, pad_right


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
        if self.enabled and not self._checked:
            self._check()
        return super().score(knockouts)

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
        clean = torch.zeros(1, self.layout.n_layers, self.layout.n_heads, dtype=torch.bool)
        lp, _ = self._run_shared(clean, reqs)
        plain_lp, _ = self._run(clean, reqs)
        tol = 1e-4 if next(self.model.parameters()).dtype == torch.float32 else 5e-2
        if not np.allclose(lp, plain_lp[0], atol=tol * max(1.0, float(np.abs(plain_lp).max())), rtol=0):
            self.enabled = False

    @torch.no_grad()
    def _run_shared(self, ko: torch.Tensor, reqs: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Per-request log-probability and greedy flag; ``reqs`` are whole documents' requests."""
        p = self.probe
        base = getattr(self.model, self.model.base_model_prefix)
        docs = list(dict.fromkeys(int(p.doc_of[r]) for r in reqs))
        first = {d: next(r for r in reqs if int(p.doc_of[r]) == d) for d in docs}
        ctx_ids, ctx_att = pad_right([p.context_ids[first[d]] for d in docs], self.pad_id)
        doc_idx = torch.tensor([docs.index(int(p.doc_of[r])) for r in reqs])
        conts = [p.continuation_ids[r] for r in reqs]
        cont_ids, cont_att = pad_right(conts, self.pad_id)
        wa = cont_ids.shape[1]
        ctx_len = ctx_att.sum(1)
        dev = self.device
        with self.ablator.apply(ko):
            out = base(input_ids=ctx_ids.to(dev), attention_mask=ctx_att.to(dev), use_cache=True)
            odev = out[0].device  # the last layer's device (another one than the input's under a device_map)
            last = out[0][torch.arange(len(docs), device=odev), (ctx_len - 1).to(odev)]  # predicts each choice's first token
            cache = out.past_key_values
            cache.reorder_cache(doc_idx.to(dev))
            att = torch.cat([ctx_att[doc_idx], cont_att], dim=1).to(dev)
            pos = (ctx_len[doc_idx][:, None] + torch.arange(wa)[None, :]).to(dev)
            hid = base(input_ids=cont_ids.to(dev), attention_mask=att, position_ids=pos, past_key_values=cache,
                       use_cache=True)[0]
        rows, cols, tgt = [], [], []
        for i, t in enumerate(conts):
            rows.extend([i] * len(t))
            cols.extend(range(-1, len(t) - 1))  # -1: the context's last position
            tgt.extend(t)
        hdev = hid.device
        rows_t, cols_t = torch.tensor(rows, device=hdev), torch.tensor(cols, device=hdev)
        h = torch.where((cols_t < 0)[:, None], last[doc_idx.to(hdev)[rows_t]], hid[rows_t, cols_t.clamp(min=0)])
        tok_lp, tok_ok = token_scores(self.model, h, torch.tensor(tgt, device=dev))
        bounds = np.cumsum([0] + [len(t) for t in conts])
        return np.add.reduceat(tok_lp, bounds[:-1]), np.logical_and.reduceat(tok_ok, bounds[:-1])

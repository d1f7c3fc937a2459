"""Prefix reuse for multiple choice: a knockout's shared-context forward starts at its first layer.

:class:`~capsense.scoring.shared_context.SharedContextScorer` runs each document's context once
and then all its choices on top of the cached keys and values. Under a knockout whose earliest
head sits in layer ``l``, the blocks before ``l`` compute what the clean model computes in both
passes, so :class:`SharedPrefixScorer` records every block's inputs of the clean model's two
passes once per batch (:class:`capsense.core.replay.BlockReplay`) and under a knockout runs
only blocks ``l..``: the context from its clean input to block ``l`` into a fresh KV cache
(only layers ``>= l`` are filled: the blocks before ``l`` never run again, so their keys and
values are never read), then the choices from theirs on top of it. A single-head sweep then
costs what it costs on log-likelihood probes (the mean share of layers run, about half), where
every multiple-choice knockout paid a full forward before (round 10: a held-out multiple-choice
task needed 14 FE to 4/5 of its top 5 against 7-8 on the log-likelihood tasks).

Memory: the recorded block inputs of every batch stay for the run (layers x the batch's context
and choice tokens x hidden size, as the log-likelihood prefix cache keeps its own);
``--no-prefix-reuse`` turns both off where that does not fit.

The fresh cache is built the way the models build theirs (``type(cache)(config=model.config)``,
transformers 5's ``DynamicCache``, sliding-window layers included) and handed to each block
where the clean cache was (by keyword or by position: GPT-2's blocks take it positionally). On
the first batch the replay from block 0 must equal the clean shared-context scores; if it does
not (a cache that cannot be rebuilt from the config, or one the blocks do not receive), prefix
reuse is off for good and every knockout runs the whole shared-context forward, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from capsense.core.precision import computes_in_float32
from capsense.core.replay import BlockReplay
from capsense.scoring.prefix import TakesClean, final_norm
from capsense.scoring.shared_context import SharedBatch, SharedContextScorer


_CACHE = object()  # where the recorded blocks received the KV cache (the clean cache itself is let go)


@dataclass
class _CleanBatch:
    """One batch's clean passes: their block inputs, the type of their KV cache (None: the blocks did
    not all receive it), the clean scores."""

    batch: SharedBatch
    context: BlockReplay
    choices: BlockReplay
    cache_type: type | None
    logprob: np.ndarray
    greedy: np.ndarray


class SharedPrefixScorer(TakesClean, SharedContextScorer):
    """A shared-context scorer whose knockouts skip the blocks before their earliest head."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.final_norm = final_norm(self.model)
        self.reuse = self.final_norm is not None
        self._clean: dict[tuple[int, ...], _CleanBatch] = {}
        self._reuse_checked = False

    @property
    def reuses_prefix(self) -> bool:
        """Knockouts start at their first layer (the shared context is on and the replay check passed)."""
        return self.enabled and self.reuse

    def can_take_clean(self) -> bool:
        """Prefix reuse is on and the shared context passed its first-batch check (run now if it has not)."""
        return self.checked() and self.reuses_prefix

    def check_replay(self) -> None:
        """Run the first batch's cache-rebuild check now (in :meth:`_score_batch`), on its clean passes, captured here
        where no clean forward handed them over (see :meth:`capsense.scoring.prefix.PrefixReuseScorer.check_replay`).
        Round 39's version ran a clean shared pass instead (``_run_shared``): it checked nothing, so a run priced
        this probe's knockouts with reuse on until it first scored one."""
        if not self.can_take_clean() or self._reuse_checked:
            return
        _, ko, reqs = next(self._batches(self.ablator.knockouts(())))
        self._score_batch(ko, reqs)

    def _score_batch(self, ko: torch.Tensor, reqs: list[int]) -> tuple[np.ndarray, np.ndarray]:
        if not self.reuses_prefix:
            return super()._score_batch(ko, reqs)
        key = tuple(reqs)
        if key not in self._clean:
            self._clean[key] = self._capture(reqs)
        clean = self._clean[key]
        if not self._reuse_checked:
            self._reuse_checked = True
            with self._timed_check():
                self.reuse = self._replay_matches(clean)
            if not self.reuse:
                self._clean.clear()
                return super()._score_batch(ko, reqs)
        hit = torch.nonzero(ko[0].any(dim=1)).flatten()
        if len(hit) == 0:
            return clean.logprob[None], clean.greedy[None]
        with torch.no_grad(), self.ablator.apply(ko):
            lp, gr = self._shared_scores(clean.batch, *self._replay(clean, int(hit[0])))
        return lp[None], gr[None]

    def take_clean(self, reqs: list[int], batch: SharedBatch, context: BlockReplay, choices: BlockReplay, cache: Any,
                   logprob: np.ndarray, greedy: np.ndarray) -> None:
        """One batch of a clean shared-context forward that ran elsewhere (a multiple-choice
        :data:`capsense.scoring.attribution.CleanSink`): both passes' block inputs and their cache."""
        self._take_scores(reqs, logprob, greedy)
        self._clean[tuple(reqs)] = self._recorded(batch, context, choices, cache, logprob, greedy)

    @torch.no_grad()
    def _capture(self, reqs: list[int]) -> _CleanBatch:
        """The clean model's two passes on one batch, recorded block by block."""
        b = self._shared_batch(reqs)
        context, choices = BlockReplay(self.model), BlockReplay(self.model)
        ctx_hidden, cache = context.record(lambda: self._context_pass(b))
        hid = choices.record(lambda: self._choices_pass(b, cache))
        return self._recorded(b, context, choices, cache, *self._shared_scores(b, ctx_hidden, hid))

    @staticmethod
    def _recorded(b: SharedBatch, context: BlockReplay, choices: BlockReplay, cache: Any, lp: np.ndarray,
                  gr: np.ndarray) -> _CleanBatch:
        """The clean batch of two recorded passes; the cache they received becomes a placeholder (each
        replay builds a fresh one), and the replay is off (no cache type) unless every block received it."""
        from transformers.cache_utils import Cache

        n_blocks = len(context.blocks)
        received = [r.replace(cache, _CACHE) for r in (context, choices)] if isinstance(cache, Cache) else [0, 0]
        every = context.complete and choices.complete and received == [n_blocks, n_blocks]
        return _CleanBatch(b, context, choices, type(cache) if every else None, lp, gr)

    def _replay(self, clean: _CleanBatch, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states of both passes computing blocks ``start..`` only (under the active ablation)."""
        fresh = clean.cache_type(config=self.model.config)
        ctx_hidden = self.final_norm(clean.context.run_from(start, swap=(_CACHE, fresh)))
        fresh.reorder_cache(clean.batch.doc_idx.to(self.device))
        hid = self.final_norm(clean.choices.run_from(start, swap=(_CACHE, fresh)))
        return ctx_hidden, hid

    def _replay_matches(self, clean: _CleanBatch) -> bool:
        """The replay from block 0 gives the clean scores (else this architecture's cache cannot be rebuilt)."""
        if clean.cache_type is None:
            return False
        try:
            with torch.no_grad():
                lp, _ = self._shared_scores(clean.batch, *self._replay(clean, 0))
        except (TypeError, ValueError, RuntimeError, AttributeError, IndexError):
            return False
        tol = 1e-4 if computes_in_float32(self.model) else 5e-2
        return bool(np.allclose(lp, clean.logprob, atol=tol * max(1.0, float(np.abs(clean.logprob).max())), rtol=0))

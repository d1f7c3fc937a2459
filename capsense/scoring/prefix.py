"""Prefix reuse: start the forward pass at the first ablated layer from cached clean inputs.

Layers before the first knocked-out head compute exactly what the clean model computes,
so :class:`PrefixReuseScorer` runs each probe batch once without ablation, records every
decoder layer's input (:class:`capsense.core.replay.BlockReplay`: hidden states plus the
call's other arguments, as the model itself passed them) and later calls ``layers[l:]``
directly, then the final norm. For a single-head sweep this halves the
work; for random masks it saves the layers before the earliest ablated one.

It works for any architecture whose decoder blocks are called as ``block(hidden, ...)``
and whose final norm sits beside the block list (``norm``, ``final_layer_norm``,
``final_layernorm`` or ``ln_f``). On the first batch it checks that the replayed clean forward equals the
model's own output (on two of the batch's rows, the whole batch where they do not decide); if not, or with
several masks per forward, it falls back to the full forward.

The clean forward may come from elsewhere (:meth:`PrefixReuseScorer.take_clean`): the
gradient attribution's forward, with every multiplier at 1, is one, so prior-guided runs
fill the cache and get the clean scores from it instead of a second forward (1
forward-equivalent less per run).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from capsense.core.arch import arch_spec, unwrap
from capsense.core.precision import computes_in_float32
from capsense.core.replay import BlockReplay
from capsense.errors import CapsenseError
from capsense.scoring.logits import scored_hidden
from capsense.scoring.probe import ProbeScorer, pad_right

_NORM_NAMES = ("norm", "final_layer_norm", "final_layernorm", "ln_f")  # final_layernorm: Phi-2


def final_norm(model) -> torch.nn.Module | None:
    """The norm the base model applies after its last block (None where it has none under a known name)."""
    base = unwrap(model)
    parent_path = arch_spec(base).layers.rsplit(".", 1)[0]
    parent = base.get_submodule(parent_path)
    for name in _NORM_NAMES:
        mod = getattr(parent, name, None)
        if isinstance(mod, torch.nn.Module):
            return mod
    return None


class TakesClean:
    """A scorer whose clean evaluation may come from a forward that ran elsewhere: the gradient
    attribution's, every multiplier at 1 (:data:`capsense.scoring.attribution.CleanSink`). Each
    taken batch fills the scorer's clean cache (its ``take_clean``) and its scores become the clean
    model's (:meth:`clean_scores`), so no second clean forward runs."""

    _taken: tuple[np.ndarray, np.ndarray] | None = None  # per-request log-prob, greedy hit of the taken batches
    _keys: tuple[bool, frozenset[tuple[int, ...]]] | None = None  # (enabled when built, batch_keys)

    def batch_keys(self) -> frozenset[tuple[int, ...]]:
        """The request batches this scorer runs a mask in (its cache's keys), built once per state of
        ``enabled`` (a failed shared-context check changes the batches): each taken batch asks, and
        rebuilding every batch each time was quadratic in batches."""
        enabled = bool(getattr(self, "enabled", True))
        if self._keys is None or self._keys[0] != enabled:
            self._keys = (enabled, frozenset(tuple(reqs) for _, _, reqs in self._batches(torch.zeros(1, 1, 1, dtype=torch.bool))))
        return self._keys[1]

    def can_take_clean(self) -> bool:
        """Whether a clean forward that ran elsewhere can stand in for this scorer's (its prefix reuse is on)."""
        return self.reuses_prefix

    def _take_scores(self, reqs: list[int], logprob: np.ndarray, greedy: np.ndarray) -> None:
        if not self.reuses_prefix or tuple(reqs) not in self.batch_keys():
            raise CapsenseError("a clean batch this scorer does not run (or reuses no prefix): "
                                "MaskEvaluator.clean_sinks hands sinks only where the batches are the same")
        if self._taken is None:
            self._taken = (np.full(self.probe.n_requests, np.nan), np.zeros(self.probe.n_requests, dtype=bool))
        self._taken[0][reqs], self._taken[1][reqs] = logprob, greedy

    def clean_scores(self) -> dict[str, np.ndarray] | None:
        """The clean model's scores from taken batches (one mask), once every request has one; else None."""
        if self._taken is None or np.isnan(self._taken[0]).any():
            return None
        return self.aggregate(self._taken[0][None], self._taken[1][None])

    def score(self, knockouts: torch.Tensor | None = None) -> dict[str, np.ndarray]:
        clean = self.clean_scores()
        if clean is not None and (knockouts is None or (knockouts.shape[0] == 1 and not knockouts.any())):
            return clean
        return super().score(knockouts)


class PrefixReuseScorer(TakesClean, ProbeScorer):
    """A :class:`~capsense.scoring.probe.ProbeScorer` that skips the clean prefix of each forward."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.final_norm = final_norm(self.model)
        self.enabled = self.final_norm is not None and self.masks_per_forward == 1
        self._cache: dict[tuple[int, ...], tuple[BlockReplay, torch.Tensor]] = {}
        self._checked = False

    @property
    def reuses_prefix(self) -> bool:
        """Knockouts start at their first layer (off with several masks per forward or after a failed check)."""
        return self.enabled

    def take_clean(self, reqs: list[int], replay: BlockReplay, final: torch.Tensor, logprob: np.ndarray,
                   greedy: np.ndarray) -> None:
        """One batch of a clean forward that ran elsewhere (a log-likelihood
        :data:`capsense.scoring.attribution.CleanSink`): its block inputs fill the cache."""
        self._take_scores(reqs, logprob, greedy)
        self._cache[tuple(reqs)] = (replay, final)

    @torch.no_grad()
    def _capture(self, ids: torch.Tensor, att: torch.Tensor) -> tuple[BlockReplay, torch.Tensor]:
        replay = BlockReplay(self.model)
        return replay, replay.record(lambda: scored_hidden(self.model, ids, att))

    def _replay(self, replay: BlockReplay, start: int) -> torch.Tensor:
        return self.final_norm(replay.run_from(start))

    def check_replay(self) -> None:
        """Run the first batch's replay check now (below, in :meth:`_hidden`), on its clean block inputs, captured
        here where no clean forward handed them over: the outcome decides what a knockout costs, and
        :meth:`capsense.localize.evaluator.MaskEvaluator.check_scorers` wants it before anything is priced."""
        if not self.enabled or self._checked:
            return
        _, ko, reqs = next(self._batches(self.ablator.knockouts(())))
        ids, att = pad_right([self._inputs[r] for r in reqs], self.pad_id)
        self._hidden(ids.to(self.device), att.to(self.device), ko, reqs)

    def _replay_matches(self, calls: BlockReplay, final: torch.Tensor, ids: torch.Tensor, att: torch.Tensor) -> bool:
        """The replay from block 0 gives the clean model's final hidden states (else this architecture's blocks do
        not replay, and knockouts run the whole forward). Checked on two rows, the batch's first and last (the
        longest and the most padded: batches run longest first), at a fraction of the whole batch's forward
        (:meth:`BlockReplay.rows`); where those rows fail or do not slice, the whole batch decides against its
        recorded output, as it always did before round 44.

        The rows' reference: in float32 the recorded output's rows. In reduced precision (bfloat16 weights or
        autocast) two rows' products round unlike the whole batch's (under autocast on the main job every probe's
        rows were 0.3-2.8 off the recorded rows, on hidden states up to 50 in size), so the reference there is the
        model's own forward of the two rows, at the shapes the replay runs. On the SmolLM2 main job the run's
        self-checks (11 probes) took 8.4-12.8 s in float32 over four runs, about one forward-equivalent that no
        budget counts, and 2.4-2.9 s with the rows."""
        exact = computes_in_float32(self.model)
        tol = 1e-4 if exact else 2e-2

        def same(replay: BlockReplay, reference: torch.Tensor) -> bool:
            return torch.allclose(self._replay(replay, 0).float(), reference.float(), atol=tol, rtol=tol)

        n = final.shape[0]
        if n > 2:
            rows = [0, n - 1]
            try:
                reference = final[rows] if exact else scored_hidden(self.model, ids[rows], att[rows])
                if same(calls.rows(rows), reference):
                    return True
            except (TypeError, ValueError, RuntimeError, IndexError):
                pass
        return same(calls, final)

    @torch.no_grad()
    def _hidden(self, ids, att, row_ko, reqs):
        if not self.enabled or row_ko.shape[0] != 1:
            return super()._hidden(ids, att, row_ko, reqs)
        key = tuple(reqs)
        if key not in self._cache:
            self._cache[key] = self._capture(ids, att)
        calls, final = self._cache[key]
        if not calls.complete:
            self.enabled = False
            return super()._hidden(ids, att, row_ko, reqs)
        if not self._checked:
            with self._timed_check():
                passed = self._replay_matches(calls, final, ids, att)
            if not passed:
                self.enabled = False
                return super()._hidden(ids, att, row_ko, reqs)
            self._checked = True
        hit = torch.nonzero(row_ko[0].any(dim=1)).flatten()
        if len(hit) == 0:
            return final
        with self.ablator.apply(row_ko):
            return self._replay(calls, int(hit[0]))

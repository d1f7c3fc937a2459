"""Evaluate masks in order, resuming from the run folder, split across processes.

A method calls the runner with a block of masks (a design, a refine round, one Thompson
draw). Every process computes the same blocks in the same order (the masks follow from the
seed and from earlier scores, which every process holds), so a mask's *index* in the run is
the same everywhere. The runner reuses every index the folder already holds (checking its
heads), cuts the rest into one contiguous share per process, evaluates this process's share
(``masks_per_forward`` at a time, each logged durably as it finishes) and exchanges the new
evaluations, so that every process returns the whole block. With one process it is a plain
resumable loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from capsense.core.distributed import DistContext, split
from capsense.localize.store import Evaluation, RunStore, RunStoreError


class MaskRunner:
    """Evaluates blocks of masks (``[m, heads]`` booleans) into ``store``; see the module doc."""

    def __init__(self, store: RunStore, evaluate: Callable[[np.ndarray], list], masks_per_forward: int, bar=None,
                 ctx: DistContext | None = None) -> None:
        self.store, self.evaluate = store, evaluate
        self.mpf = max(1, masks_per_forward)
        self.ctx = ctx or DistContext()
        self.cursor = 0
        self.bar = bar
        self.new = 0  # evaluations this attempt added (all processes)

    def __call__(self, masks: np.ndarray, round_index: int = 0) -> list[Evaluation]:
        masks = np.atleast_2d(np.asarray(masks, dtype=bool))
        first, self.cursor = self.cursor, self.cursor + len(masks)
        todo = []
        for i, mask in enumerate(masks):
            idx = first + i
            heads = [int(h) for h in np.flatnonzero(mask)]
            ev = self.store.done.get(idx)
            if ev is None:
                todo.append(idx)
            elif ev.heads != heads:
                raise RunStoreError(
                    f"mask {idx} in {self.store.path} knocks out other heads than this run's mask {idx}: "
                    "the settings or capsense changed; choose another --out"
                )
        mine = split(todo, self.ctx)[self.ctx.rank]
        local = self._evaluate([(i, masks[i - first]) for i in mine], round_index)
        if self.ctx.distributed:
            others = [e for r, evs in enumerate(self.ctx.gather(local)) if r != self.ctx.rank for e in evs]
            self.store.record(others)
            if self.bar is not None:
                self.bar.update(len(others))
        self.new += len(todo)
        return [self.store.done[first + i] for i in range(len(masks))]

    def _evaluate(self, items: list[tuple[int, np.ndarray]], round_index: int) -> list[Evaluation]:
        out = []
        for g in range(0, len(items), self.mpf):
            group = items[g : g + self.mpf]
            t0 = time.perf_counter()
            scores = self.evaluate(np.stack([m for _, m in group]))
            dt = (time.perf_counter() - t0) / len(group)
            for (idx, mask), sc in zip(group, scores):
                ev = Evaluation(idx, [int(h) for h in np.flatnonzero(mask)], sc, dt, round_index)
                self.store.append(ev)
                out.append(ev)
                if self.bar is not None:
                    self.bar.update(1)
        return out

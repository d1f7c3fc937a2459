"""Knockout designs: which heads each mask removes.

A design is a boolean matrix ``[n_masks, n_heads]`` over the flattened heads
(``index = layer * n_heads_per_layer + head``), True = knocked out.

* :func:`bernoulli_design`: every head independently with probability ``p``;
* :func:`balanced_design`: exactly ``k`` heads per mask, least-used heads first (random
  tie-breaks), so every head is knocked out ``floor`` or ``ceil`` of ``m k / n`` times;
* :func:`adaptive_round`: later rounds spend half their masks on the heads a fit so far
  ranks high or is unsure about, and half on a balanced design over all heads;
* :func:`head_set_masks`: the masks of given head sets (measure-and-choose's, a search's singles and groups).

Designs are registered by name in :data:`DESIGNS`; :func:`run_design` draws any of them
round by round (a fixed design is one round).

Every design is prefix-stable: the first ``m`` masks of a design of ``m' > m`` masks are the
design of ``m`` masks, so a run can be extended with more masks and resumed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from capsense.core.registry import Registry
from capsense.errors import CapsenseError


#: Masks per adaptive round (fixed, so that extending a run keeps earlier rounds).
ADAPTIVE_ROUND = 25


def heads_per_mask(n_heads: int, sparsity: float | None = None, k: int | None = None) -> int:
    """Heads knocked out per mask from ``k`` or ``sparsity`` (at least 1)."""
    if k is not None:
        if not 1 <= k <= n_heads:
            raise CapsenseError(f"`k` (heads per mask) must be between 1 and {n_heads} (the model's heads), got {k}")
        return int(k)
    if sparsity is None or not 0 < sparsity < 1:
        raise CapsenseError(f"`sparsity` must be in (0, 1), got {sparsity}")
    return max(1, int(round(sparsity * n_heads)))


def bernoulli_design(n_masks: int, n_heads: int, p: float, seed: int) -> np.ndarray:
    """Each head knocked out independently with probability ``p``; no mask is empty."""
    if not 0 < p < 1:
        raise CapsenseError(f"`sparsity` must be in (0, 1), got {p}")
    rng = np.random.default_rng([seed, 1])
    out = np.zeros((n_masks, n_heads), dtype=bool)
    for i in range(n_masks):  # row by row so that the design is prefix-stable
        row = rng.random(n_heads) < p
        if not row.any():
            row[rng.integers(n_heads)] = True
        out[i] = row
    return out


def balanced_design(
    n_masks: int, n_heads: int, k: int, seed: int, counts: np.ndarray | None = None,
    pool: np.ndarray | None = None,
) -> np.ndarray:
    """``k`` heads per mask, least-used first with random tie-breaks.

    ``counts`` (per head) carries usage over from earlier masks; ``pool`` restricts the
    draw to those head indices.
    """
    rng = np.random.default_rng([seed, 2])
    used = np.zeros(n_heads) if counts is None else counts.astype(float).copy()
    candidates = np.arange(n_heads) if pool is None else np.asarray(pool)
    k = min(k, len(candidates))
    out = np.zeros((n_masks, n_heads), dtype=bool)
    for i in range(n_masks):
        key = used[candidates] + rng.random(len(candidates))  # integer part = usage, fraction = tie-break
        pick = candidates[np.argsort(key, kind="stable")[:k]]
        out[i, pick] = True
        used[pick] += 1
    return out


def adaptive_round(
    round_index: int,
    n_masks: int,
    n_heads: int,
    k: int,
    seed: int,
    history: np.ndarray,
    importance: np.ndarray | None,
    confidence: np.ndarray | None,
    n_candidates: int | None = None,
) -> np.ndarray:
    """Masks of one adaptive round.

    Round 0 (or no fit yet) is balanced over all heads. Later rounds draw half their masks
    (balanced, least-used first) from the candidates: the ``n_candidates`` heads ranked
    highest by ``importance``, plus heads whose ``confidence`` is between 0.1 and 0.9; the
    other half stays balanced over all heads so that no head is never tested.
    """
    counts = history.sum(axis=0) if len(history) else np.zeros(n_heads)
    seed_r = seed * 1000 + round_index
    if round_index == 0 or importance is None:
        return balanced_design(n_masks, n_heads, k, seed_r, counts)
    n_candidates = n_candidates or max(4 * k, 20)
    top = np.argsort(-importance, kind="stable")[:n_candidates]
    unsure = np.flatnonzero((confidence > 0.1) & (confidence < 0.9)) if confidence is not None else []
    pool = np.unique(np.concatenate([top, np.asarray(unsure, dtype=int)]))
    n_focus = n_masks // 2
    # Inside the pool, fewer heads per mask: candidates are few and each mask should tell them apart.
    focus = balanced_design(n_focus, n_heads, max(1, min(k, len(pool) // 4)), seed_r, counts, pool)
    rest = balanced_design(n_masks - n_focus, n_heads, k, seed_r + 1, counts + focus.sum(0))
    return np.concatenate([focus, rest])


#: ``(round, n_masks, n_heads, k, seed, history, importance, confidence) -> masks``:
#: ``history`` holds the masks drawn so far; ``importance``/``confidence`` a fit of them (or None).
DrawRound = Callable[[int, int, int, int, int, np.ndarray, "np.ndarray | None", "np.ndarray | None"], np.ndarray]
#: ``(masks, round)``: score one round of masks.
Evaluate = Callable[[np.ndarray, int], object]
#: ``() -> (importance, confidence)`` from every mask scored so far.
Fit = Callable[[], "tuple[np.ndarray, np.ndarray]"]


@dataclass(frozen=True)
class Design:
    """A knockout design: how each round's masks are drawn, and how many masks a round holds."""

    name: str
    draw: DrawRound
    round_size: int | None = None  # None: every mask in one round (a fixed design)

    @property
    def adaptive(self) -> bool:
        """Whether later rounds depend on a fit of the earlier ones."""
        return self.round_size is not None


def _balanced(r, m, n, k, seed, history, importance, confidence) -> np.ndarray:
    return balanced_design(m, n, k, seed)


def _bernoulli(r, m, n, k, seed, history, importance, confidence) -> np.ndarray:
    return bernoulli_design(m, n, k / n, seed)


#: Name -> design. To add one, register a :class:`Design` here (``--design`` lists these names).
DESIGNS: Registry[Design] = Registry("design", "designs", CapsenseError)
for _d in (Design("balanced", _balanced), Design("bernoulli", _bernoulli), Design("adaptive", adaptive_round, ADAPTIVE_ROUND)):
    DESIGNS.register(_d.name, _d)


def run_design(name: str, n_masks: int, n_heads: int, k: int, seed: int, evaluate: Evaluate, fit: Fit | None = None) -> np.ndarray:
    """Draw ``n_masks`` masks of the design ``name`` and ``evaluate`` them round by round.

    An adaptive design calls ``fit`` between rounds. Returns every mask drawn, in order.
    """
    design = DESIGNS[name]
    size = design.round_size or n_masks
    history = np.zeros((0, n_heads), dtype=bool)
    importance = confidence = None
    r = 0
    while len(history) < n_masks:
        masks = design.draw(r, min(size, n_masks - len(history)), n_heads, k, seed, history, importance, confidence)
        evaluate(masks, r)
        history = np.concatenate([history, masks])
        r += 1
        if design.adaptive and fit is not None and len(history) < n_masks:
            importance, confidence = fit()
    return history


def head_set_masks(sets: Sequence[Sequence[int]], n: int) -> np.ndarray:
    """0/1 knockout masks ``[len(sets), n]`` for head sets."""
    masks = np.zeros((len(sets), n), dtype=bool)
    for i, s in enumerate(sets):
        masks[i, list(s)] = True
    return masks

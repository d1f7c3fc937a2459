"""Non-uniform allocation: one setting per matrix, least estimated cost at a total size.

Each matrix has candidates (its method's levels: densities, bit widths or ratios, plus
dense), each with an exact size in bits (:meth:`Setting.size`, protection included) and an
estimated cost ``sum F (W - W')^2`` where ``W'`` is the candidate actually applied and ``F``
a per-weight sensitivity (:mod:`.sensitivity`). :func:`allocate` picks one candidate per
matrix minimising total cost with total bits at most the target: a Lagrangian sweep
(``min cost + lambda * bits`` per matrix, bisection on ``lambda``) and then a greedy fill of
the remaining bits with the best cost-per-bit upgrades.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from capsense.compress.methods import Setting
from capsense.errors import BudgetError
from capsense.compress.protect import Protection


@dataclass(frozen=True)
class Candidate:
    """One way to store one matrix: its setting (None = dense), exact bits and estimated cost."""

    setting: Setting | None
    bits: int
    cost: float


def matrix_candidates(
    name: str, w: torch.Tensor, sensitivity: torch.Tensor, levels: Sequence[Setting], stats,
    prot: Protection | None, base_bits: int, cache: dict | None = None, dense: bool = True, price=None,
) -> list[Candidate]:
    """Every level of one matrix (and dense, if ``dense``) with its bits and ``sum F (W - W')^2``
    (``price``: another function with :meth:`Setting.level_costs`'s arguments)."""
    w = w.detach()
    out = [Candidate(None, w.shape[0] * w.shape[1] * base_bits, 0.0)] if dense else []
    if not levels:
        return out
    priced = (price or levels[0].level_costs)(list(levels), name, w, sensitivity.to(w.device), stats, prot, base_bits, cache)
    out += [Candidate(s, bits, cost) for s, bits, cost in priced]
    if not out:
        raise BudgetError(f"{name}: no level of {levels[0].method} fits this matrix")
    return out


def _pick(cands: Sequence[Candidate], lam: float) -> int:
    return min(range(len(cands)), key=lambda i: (cands[i].cost + lam * cands[i].bits, cands[i].bits))


def _total(cands: Mapping[str, Sequence[Candidate]], choice: Mapping[str, int]) -> int:
    return sum(cands[k][i].bits for k, i in choice.items())


def _greedy_fill(cands: Mapping[str, Sequence[Candidate]], choice: dict[str, int], target_bits: int) -> None:
    """Spend the slack on the upgrades saving the most cost per bit, while they fit."""
    slack = target_bits - _total(cands, choice)
    while True:
        best, best_gain = None, 0.0
        for k, i in choice.items():
            cur = cands[k][i]
            for j, c in enumerate(cands[k]):
                extra = c.bits - cur.bits
                if 0 < extra <= slack and cur.cost - c.cost > 0:
                    gain = (cur.cost - c.cost) / extra
                    if gain > best_gain:
                        best, best_gain = (k, j), gain
        if best is None:
            return
        k, j = best
        slack -= cands[k][j].bits - cands[k][choice[k]].bits
        choice[k] = j


def allocate(cands: Mapping[str, Sequence[Candidate]], target_bits: int) -> dict[str, Candidate]:
    """One candidate per matrix: least total cost with total bits <= ``target_bits``."""
    least = sum(min(c.bits for c in cs) for cs in cands.values())
    if least > target_bits:
        raise BudgetError(
            f"the size budget ({target_bits} bits for the compressed matrices) is below what the protected weights "
            f"alone need at the smallest setting ({least} bits): protect fewer heads or allow a larger size"
        )
    lo, hi = 0.0, 1.0
    while _total(cands, {k: _pick(cs, hi) for k, cs in cands.items()}) > target_bits:
        hi *= 4.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if _total(cands, {k: _pick(cs, mid) for k, cs in cands.items()}) > target_bits:
            lo = mid
        else:
            hi = mid
    choice = {k: _pick(cs, hi) for k, cs in cands.items()}
    _greedy_fill(cands, choice, target_bits)
    return {k: cands[k][i] for k, i in choice.items()}

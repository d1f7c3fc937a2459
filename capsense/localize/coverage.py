"""What a run did not measure: the heads never knocked out alone and how much effect could hide there.

Only the exhaustive sweep measures every head alone; prior-guided measures the heads its
estimate flags and covers the rest with group knockouts, cs measures random sets. A ranking
built from those measurements can still miss a head, and a user publishing "these five heads"
needs to know how large a missed head could be. Per head not measured alone:

* ``bound``: the smallest measured damage of any knockout mask containing it. If head effects
  add up and none is negative, a head cannot hurt more than a mask it belongs to, so no hidden
  head beats the K-th measured single head when every bound is below it. Cancellation (a head
  in the mask that *helps* the target) breaks the bound; the report says so instead of hiding it.
* ``estimate``: attribution's first-order estimate, where the run has one (it misses saturated
  and cancelling heads, which is why it is not the bound).

A head no evaluated mask contains has no bound at all ("uncovered"): the search stopped before
reaching it (its budget ran out). Costs nothing: it reads the evaluations the run already made.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Coverage:
    """Heads measured alone, and per other head the tightest bound and the estimate."""

    n_heads: int
    measured: list[int]
    kth_single: float | None  # the K-th largest damage among heads measured alone
    bound: dict[int, float] = field(default_factory=dict)  # head -> smallest damage of a mask containing it
    uncovered: list[int] = field(default_factory=list)  # in no evaluated mask
    estimate: dict[int, float] = field(default_factory=dict)

    @property
    def not_measured(self) -> int:
        return self.n_heads - len(self.measured)

    def possible_misses(self) -> list[int]:
        """Heads whose bound does not rule them out of the top K (bound >= the K-th single)."""
        if self.kth_single is None:
            return sorted(self.bound, key=lambda h: -self.bound[h])
        return sorted((h for h, b in self.bound.items() if b >= self.kth_single), key=lambda h: -self.bound[h])

    def largest_bound(self) -> tuple[int, float] | None:
        return max(self.bound.items(), key=lambda kv: kv[1]) if self.bound else None

    def as_dict(self, name: Callable[[int], str], top: int = 10) -> dict:
        largest = self.largest_bound()
        est = sorted(self.estimate.items(), key=lambda kv: -kv[1])[:top]
        return {
            "rule": "bound = the smallest measured damage of a knockout mask containing the head; with additive, "
                    "non-negative effects no head hurts more than its bound (a head that helps the target inside "
                    "the same mask can hide more)",
            "measured_alone": len(self.measured),
            "not_measured_alone": self.not_measured,
            "kth_single_damage": _r(self.kth_single),
            "largest_bound": None if largest is None else {"head": name(largest[0]), "bound": _r(largest[1])},
            "possible_misses": [{"head": name(h), "bound": _r(self.bound[h]), "estimate": _r(self.estimate.get(h))}
                                for h in self.possible_misses()[:top]],
            "n_possible_misses": len(self.possible_misses()),
            "uncovered": [name(h) for h in self.uncovered],
            "largest_estimates_not_measured": [{"head": name(h), "estimate": _r(v)} for h, v in est],
        }

    def summary(self, name: Callable[[int], str]) -> str:
        """One sentence for logs and reports."""
        if not self.not_measured:
            return "every head was measured alone"
        misses = self.possible_misses()
        largest = self.largest_bound()
        text = f"{self.not_measured} of {self.n_heads} heads not measured alone"
        if largest is not None:
            text += f"; the largest bound on a hidden effect is {100 * largest[1]:+.1f}% ({name(largest[0])})"
        if self.kth_single is not None:
            text += (f", {len(misses)} head(s) not ruled out of the top K (bound >= the K-th single head's "
                     f"{100 * self.kth_single:+.1f}%)")
        if self.uncovered:
            text += f"; {len(self.uncovered)} head(s) in no measured mask (no bound)"
        return text


def _r(x: float | None) -> float | None:
    return None if x is None or not np.isfinite(x) else round(float(x), 6)


def coverage(masks: Sequence[Sequence[int]], damage: Sequence[float], n: int, k: int,
             estimate: np.ndarray | None = None) -> Coverage:
    """Coverage of ``n`` heads by the evaluated knockout ``masks`` (head lists; the clean model's empty
    mask is ignored) with their measured target ``damage`` (relative, positive = hurts); ``k``: the
    set size the run hands on."""
    singles: dict[int, float] = {}
    bound = np.full(n, np.inf)
    for heads, d in zip(masks, damage):
        if len(heads) == 1:
            singles[int(heads[0])] = float(d)
        for h in heads:
            bound[int(h)] = min(bound[int(h)], float(d))
    vals = sorted(singles.values(), reverse=True)
    kth = vals[k - 1] if len(vals) >= k else None
    hidden = [h for h in range(n) if h not in singles]
    return Coverage(
        n_heads=n,
        measured=sorted(singles),
        kth_single=kth,
        bound={h: float(bound[h]) for h in hidden if np.isfinite(bound[h])},
        uncovered=[h for h in hidden if not np.isfinite(bound[h])],
        estimate={h: float(estimate[h]) for h in hidden} if estimate is not None else {},
    )

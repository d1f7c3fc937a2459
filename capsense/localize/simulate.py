"""A simulated knockout experiment with planted heads, for testing designs and solvers.

The score of a mask is ``-sum(effect of each planted head it knocks out) + noise``, with
small background effects on every other head: what a capability localized to a few
heads looks like to the solver, at no model cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from capsense.localize.designs import heads_per_mask, run_design
from capsense.localize.solvers import make_solver

PLANTED_EFFECTS = (1.0, 0.7, 0.5, 0.35, 0.25)


@dataclass
class Simulation:
    """``n_heads`` heads, ``planted`` ones with ``effects``; Gaussian noise of sd ``noise``."""

    n_heads: int = 512
    effects: tuple[float, ...] = PLANTED_EFFECTS
    noise: float = 0.1
    background: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        rng = np.random.default_rng([self.seed, 99])
        self.planted = rng.choice(self.n_heads, size=len(self.effects), replace=False)
        self.beta = rng.normal(0, self.background, self.n_heads)
        self.beta[self.planted] = self.effects
        self._rng = np.random.default_rng([self.seed, 100])

    def score(self, X: np.ndarray) -> np.ndarray:
        """Score of each mask (rows of ``X``), higher = better."""
        return -(X.astype(float) @ self.beta) + self._rng.normal(0, self.noise, len(X))


def recovered(sim: Simulation, design: str, solver: str, n_masks: int, sparsity: float = 0.02, top: int | None = None) -> int:
    """How many planted heads the solver's top ``len(planted)`` contains after ``n_masks`` masks."""
    top = top or len(sim.planted)
    k = heads_per_mask(sim.n_heads, sparsity)
    X = np.zeros((0, sim.n_heads), dtype=bool)
    y = np.zeros(0)

    def evaluate(masks: np.ndarray, r: int) -> None:
        nonlocal X, y
        X, y = np.concatenate([X, masks]), np.concatenate([y, sim.score(masks)])

    def fit() -> tuple[np.ndarray, np.ndarray]:
        s = make_solver(solver, seed=sim.seed, confidence=True).fit(X, y).scores_
        return s.importance, s.confidence

    run_design(design, n_masks, sim.n_heads, k, sim.seed, evaluate, fit)
    scores = make_solver(solver, seed=sim.seed, confidence=True).fit(X, y).scores_
    return len(set(scores.top(top)) & set(int(i) for i in sim.planted))

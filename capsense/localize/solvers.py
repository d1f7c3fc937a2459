"""Sparse recovery of head importance from knockout scores.

Every solver follows scikit-learn's estimator style: ``solver.fit(X, y)`` with ``X`` the
0/1 knockout matrix ``[n_masks, n_heads]`` and ``y`` the score of each mask (higher =
better), then read ``solver.scores_`` (a :class:`HeadScores`).

The score is standardized (zero mean, unit variance over the masks) and regressed on the
unstandardized 0/1 matrix, as in the paper this follows (Lasso, alpha 0.01). Knocking out
a head the capability needs lowers the score, so **importance = minus the coefficient**:
larger is more important. Heads the sparse fit leaves at zero are ordered by their
marginal effect (mean score without the head minus mean score with it knocked out).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from capsense.core.registry import Registry
from capsense.errors import CapsenseError


DEFAULT_ALPHA = 0.01  # the paper's Lasso penalty on the standardized score


@dataclass
class HeadScores:
    """Per-head ``importance`` (larger = more important), ``confidence`` in [0, 1] and ``rank``.

    ``rank`` lists head indices best first; ``marginal`` is the tie-breaking marginal effect.
    """

    importance: np.ndarray
    confidence: np.ndarray
    marginal: np.ndarray

    @property
    def rank(self) -> np.ndarray:
        return np.lexsort((-self.marginal, -self.confidence, -self.importance))

    def top(self, k: int) -> list[int]:
        return [int(i) for i in self.rank[:k]]


def standardize(y: np.ndarray) -> np.ndarray:
    """Zero mean, unit variance; a constant vector becomes all zeros."""
    y = np.asarray(y, dtype=float)
    sd = y.std()
    return (y - y.mean()) / sd if sd > 0 else np.zeros_like(y)


def marginal_effect(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Mean score of masks keeping each head minus mean score of masks knocking it out."""
    X = X.astype(bool)
    n_out = X.sum(0)
    n_in = len(X) - n_out
    s_out = y @ X
    s_in = y.sum() - s_out
    with np.errstate(invalid="ignore", divide="ignore"):
        eff = np.where(n_in > 0, s_in / np.maximum(n_in, 1), 0) - np.where(n_out > 0, s_out / np.maximum(n_out, 1), 0)
    return np.where(n_out > 0, eff, 0.0)


def _lasso_coef(X: np.ndarray, y: np.ndarray, alpha: float) -> np.ndarray:
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import Lasso

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return Lasso(alpha=alpha, max_iter=20000, tol=1e-6).fit(X, y).coef_


class Solver:
    """Base of every solver: ``fit`` standardizes, calls :meth:`_fit`, attaches marginal effects."""

    scores_: HeadScores

    def fit(self, X: np.ndarray, y: np.ndarray) -> "Solver":
        X = np.asarray(X, dtype=float)
        z = standardize(y)
        if len(X) < 2:
            raise CapsenseError(f"need at least 2 evaluated masks to fit, got {len(X)}: raise `n_masks`")
        importance, confidence = self._fit(X, z)
        self.scores_ = HeadScores(importance, confidence, marginal_effect(X, z))
        return self

    def _fit(self, X: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def _bootstrap_confidence(self, X: np.ndarray, z: np.ndarray, alpha: float, n_boot: int) -> np.ndarray:
        """Fraction of bootstrap refits (resampled masks) that give the head importance > 0."""
        rng = np.random.default_rng(self.seed)
        hits = np.zeros(X.shape[1])
        for _ in range(n_boot):
            idx = rng.integers(0, len(X), len(X))
            hits += -_lasso_coef(X[idx], standardize(z[idx]), alpha) > 0
        return hits / n_boot


class LassoSolver(Solver):
    """Lasso at a fixed ``alpha``; confidence = bootstrap selection frequency."""

    def __init__(self, alpha: float = DEFAULT_ALPHA, n_boot: int = 20, seed: int = 0) -> None:
        self.alpha, self.n_boot, self.seed = alpha, n_boot, seed

    def _fit(self, X, z):
        imp = -_lasso_coef(X, z, self.alpha)
        conf = self._bootstrap_confidence(X, z, self.alpha, self.n_boot) if self.n_boot else (imp > 0).astype(float)
        return imp, conf


class LassoCVSolver(Solver):
    """Lasso with alpha chosen by 5-fold cross-validation; ``alpha_`` holds the choice."""

    def __init__(self, n_boot: int = 20, seed: int = 0, cv: int = 5) -> None:
        self.n_boot, self.seed, self.cv = n_boot, seed, cv

    def _fit(self, X, z):
        from sklearn.exceptions import ConvergenceWarning
        from sklearn.linear_model import LassoCV

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            model = LassoCV(cv=min(self.cv, len(X)), max_iter=20000, random_state=self.seed).fit(X, z)
        self.alpha_ = float(model.alpha_)
        imp = -model.coef_
        conf = self._bootstrap_confidence(X, z, self.alpha_, self.n_boot) if self.n_boot else (imp > 0).astype(float)
        return imp, conf


class OMPSolver(Solver):
    """Orthogonal matching pursuit with ``n_nonzero`` heads (default: masks / 4, at most 30).

    Confidence = fraction of bootstrap refits that select the head with a negative coefficient.
    """

    def __init__(self, n_nonzero: int | None = None, n_boot: int = 20, seed: int = 0) -> None:
        self.n_nonzero, self.n_boot, self.seed = n_nonzero, n_boot, seed

    def _omp(self, X, z):
        from sklearn.linear_model import OrthogonalMatchingPursuit

        k = self.n_nonzero or max(1, min(30, len(X) // 4))
        k = min(k, X.shape[1], max(1, len(X) - 1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return -OrthogonalMatchingPursuit(n_nonzero_coefs=k).fit(X, z).coef_

    def _fit(self, X, z):
        imp = self._omp(X, z)
        rng = np.random.default_rng(self.seed)
        hits = np.zeros(X.shape[1])
        for _ in range(self.n_boot):
            idx = rng.integers(0, len(X), len(X))
            hits += self._omp(X[idx], standardize(z[idx])) > 0
        return imp, hits / max(self.n_boot, 1)


class StabilitySolver(Solver):
    """Stability selection: randomized Lasso on random halves of the masks.

    Each of ``n_resamples`` fits uses half the masks and rescales every head's column by a
    random weight in [``weakness``, 1]; confidence = selection frequency (importance > 0),
    importance = mean importance over the fits. Ranked by confidence, then importance.
    """

    def __init__(self, alpha: float = DEFAULT_ALPHA, n_resamples: int = 100, weakness: float = 0.5, seed: int = 0) -> None:
        self.alpha, self.n_resamples, self.weakness, self.seed = alpha, n_resamples, weakness, seed

    def _fit(self, X, z):
        rng = np.random.default_rng(self.seed)
        m, n = X.shape
        hits, total = np.zeros(n), np.zeros(n)
        for _ in range(self.n_resamples):
            idx = rng.choice(m, size=max(2, m // 2), replace=False)
            w = rng.uniform(self.weakness, 1.0, size=n)
            imp = -_lasso_coef(X[idx] * w, standardize(z[idx]), self.alpha) * w
            hits += imp > 0
            total += imp
        return total / self.n_resamples, hits / self.n_resamples

    def fit(self, X, y):
        super().fit(X, y)
        s = self.scores_
        # Stability ranks by selection frequency first: swap the roles in the lexsort.
        self.scores_ = _FrequencyFirst(s.importance, s.confidence, s.marginal)
        return self


class _FrequencyFirst(HeadScores):
    @property
    def rank(self) -> np.ndarray:
        return np.lexsort((-self.marginal, -self.importance, -self.confidence))


#: ``(alpha, seed, n_boot) -> solver``: ``n_boot`` = 0 skips the bootstrap confidence refits.
SolverFactory = Callable[[float, int, int], "Solver"]

#: Name -> solver factory. To add a solver, subclass :class:`Solver` and register it here.
SOLVERS: Registry[SolverFactory] = Registry("solver", "solvers", CapsenseError)
SOLVERS.register("lasso", lambda alpha, seed, n_boot: LassoSolver(alpha, n_boot=n_boot, seed=seed))
SOLVERS.register("lasso-cv", lambda alpha, seed, n_boot: LassoCVSolver(n_boot=n_boot, seed=seed))
SOLVERS.register("omp", lambda alpha, seed, n_boot: OMPSolver(n_boot=n_boot, seed=seed))
SOLVERS.register("stability", lambda alpha, seed, n_boot: StabilitySolver(alpha, seed=seed))


def make_solver(name: str, alpha: float | None = None, seed: int = 0, confidence: bool = True) -> Solver:
    """A solver by name; ``alpha`` for lasso and stability (default 0.01).

    ``confidence=False`` skips the bootstrap refits (lasso, lasso-cv, omp) when only the
    ranking is needed.
    """
    return SOLVERS[name](DEFAULT_ALPHA if alpha is None else float(alpha), seed, 20 if confidence else 0)


def residualize(target: np.ndarray, controls: np.ndarray) -> np.ndarray:
    """The part of ``target`` that the ``controls`` ([masks, c]) do not explain linearly.

    Both are standardized first; the residual of an OLS fit with intercept is returned
    (standardized again by the solver). Masks that hurt target and controls alike get
    residual ~0; masks that hurt the target only keep a large negative residual.
    """
    t = standardize(target)
    C = np.column_stack([standardize(c) for c in np.asarray(controls, dtype=float).reshape(len(t), -1).T])
    A = np.column_stack([np.ones(len(t)), C])
    beta, *_ = np.linalg.lstsq(A, t, rcond=None)
    return t - A @ beta


def ridge_effects(X: np.ndarray, y: np.ndarray, alpha: float = 1.0) -> np.ndarray:
    """Per-head additive effect of a knockout on ``y`` (ridge on the 0/1 matrix, intercept free)."""
    X = np.asarray(X, dtype=float)
    Xc = X - X.mean(0)
    yc = np.asarray(y, dtype=float) - np.mean(y)
    n = X.shape[1]
    if len(X) < n:  # dual form: cheaper with fewer masks than heads
        K = Xc @ Xc.T
        a = np.linalg.solve(K + alpha * np.eye(len(X)), yc)
        return Xc.T @ a
    return np.linalg.solve(Xc.T @ Xc + alpha * np.eye(n), Xc.T @ yc)

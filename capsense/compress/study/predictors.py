"""Predicting capability loss from few measurements.

**Compact pruning relation** (per capability ``c``, one compression method and family)::

    dL_c(x, d) = A_c(x) * ((1 - d) / 0.3) ** gamma_c,    A_c(x) = a_0 + a . z(x)

``d`` is the retained density and ``z(x)`` the standardized model-state features (log
parameters, reference loss ``L0_c``, log training tokens) that vary across the measured
model states; with one model state ``A_c`` is a constant. The density response is shared
across densities, so half the densities suffice to fit it. For a fixed ``gamma`` the
coefficients are linear least squares, so ``gamma`` is a one-dimensional search.
Coefficients do not transfer across methods or model families: refit per setting. The
relation is only trusted inside the measured density range.

**Per-density regression** (the baseline): at each measured density its own linear
regression of ``dL`` on ``z(x)`` (with one model state, the mean). It needs every density
measured and cannot predict between them.

**Stable-rank predictor** (low-rank methods): ``rho_s = ||W||_F^2 / ||W||_2^2`` per matrix;
``gamma * mean(rho_s)`` (compression ratio times the mean stable rank of the compressed
matrices) predicts the degradation linearly; quality is the leave-one-out Pearson ``r``.

**Bits** (RTN): quantization noise power scales as ``4^-B``; ``dL = c * 4^-B`` per capability.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from capsense.errors import CapsenseError, FitError

D_REF = 0.3
FEATURES = ("log_params", "L0", "log_train_tokens")
GAMMA_RANGE = (0.05, 8.0)


def density_term(d: np.ndarray | float, gamma: float) -> np.ndarray:
    return (np.clip(1.0 - np.asarray(d, dtype=float), 0.0, None) / D_REF) ** gamma


@dataclass
class CompactFit:
    """A fitted compact pruning relation for one capability and method."""

    capability: str
    method: str
    gamma: float
    coef: list[float]  # a_0 then one coefficient per used feature
    features: list[str]
    feature_mean: list[float]
    feature_std: list[float]
    density_range: tuple[float, float]
    n_points: int
    train_mae: float = float("nan")

    def design(self, X: np.ndarray | None, n: int) -> np.ndarray:
        cols = [np.ones(n)]
        if self.features:
            if X is None:
                raise FitError(f"this fit uses model-state features {self.features}: pass them to predict")
            Z = (np.asarray(X, dtype=float) - np.array(self.feature_mean)) / np.array(self.feature_std)
            cols.extend(Z.T)
        return np.column_stack(cols)

    def amplitude(self, X: np.ndarray | None = None, n: int = 1) -> np.ndarray:
        return self.design(X, n) @ np.array(self.coef)

    def predict(self, density, X: np.ndarray | None = None, allow_extrapolation: bool = False) -> np.ndarray:
        """Predicted dL at ``density`` (scalar or array); refuses densities outside the fitted range."""
        d = np.atleast_1d(np.asarray(density, dtype=float))
        lo, hi = self.density_range
        outside = d[(d < lo - 1e-9) | (d > hi + 1e-9)]
        if outside.size and not allow_extrapolation:
            raise CapsenseError(
                f"density {outside[0]:g} is outside the measured range [{lo:g}, {hi:g}] of the {self.method} fit for "
                f"{self.capability}: the relation holds only inside it. Measure that density, or allow extrapolation "
                "to get a flagged guess"
            )
        return self.amplitude(X, len(d)) * density_term(d, self.gamma)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def standardized_features(
    X: np.ndarray | None, feature_names: Sequence[str], n: int
) -> tuple[np.ndarray, list[str], list[float], list[float]]:
    """Standardize the usable (finite, non-constant) model-state feature columns.

    Returns ``(Z [n, k], names, means, stds)``; ``k`` is 0 without usable features.
    """
    if X is None or not np.asarray(X).size:
        return np.zeros((n, 0)), [], [], []
    Xa = np.asarray(X, dtype=float)
    keep = [j for j in range(Xa.shape[1]) if np.isfinite(Xa[:, j]).all() and Xa[:, j].std() > 1e-12]
    if not keep:
        return np.zeros((n, 0)), [], [], []
    mean = [float(Xa[:, j].mean()) for j in keep]
    std = [float(Xa[:, j].std()) for j in keep]
    Z = (Xa[:, keep] - np.array(mean)) / np.array(std)
    return Z, [feature_names[j] for j in keep], mean, std


def fit_compact(
    density: Sequence[float],
    dL: Sequence[float],
    X: np.ndarray | None = None,
    feature_names: Sequence[str] = FEATURES,
    capability: str = "",
    method: str = "",
) -> CompactFit:
    """Least-squares fit of the compact relation to measured ``dL`` at densities (and features ``X``)."""
    from scipy.optimize import minimize_scalar

    d = np.asarray(density, dtype=float)
    y = np.asarray(dL, dtype=float)
    if len(np.unique(d)) < 2:
        raise FitError(f"{capability or 'fit'}: the compact relation needs at least two distinct densities, got {sorted(set(d.tolist()))}")
    Z, used, mean, std = standardized_features(X, feature_names, len(d))
    if len(d) < 2 + Z.shape[1]:
        raise FitError(f"{capability or 'fit'}: {len(d)} points cannot fit {2 + Z.shape[1]} parameters")
    D = np.column_stack([np.ones(len(d)), Z])

    def profile(g: float) -> tuple[float, np.ndarray]:
        F = D * density_term(d, g)[:, None]
        coef, *_ = np.linalg.lstsq(F, y, rcond=None)
        return float(((F @ coef - y) ** 2).sum()), coef

    grid = np.linspace(*GAMMA_RANGE, 160)
    losses = [profile(g)[0] for g in grid]
    i = int(np.argmin(losses))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    res = minimize_scalar(lambda g: profile(g)[0], bounds=(lo, hi), method="bounded", options={"xatol": 1e-5})
    gamma = float(res.x) if res.fun <= losses[i] else float(grid[i])
    _, coef = profile(gamma)
    fit = CompactFit(
        capability, method, gamma, coef.tolist(), used, mean, std, (float(d.min()), float(d.max())), len(d)
    )
    fit.train_mae = float(np.abs(fit.predict(d, np.asarray(X, dtype=float)[:, [list(feature_names).index(f) for f in used]] if used else None) - y).mean())
    return fit


@dataclass
class PerDensityFit:
    """The baseline: one linear regression on the model-state features per measured density."""

    capability: str
    method: str
    coefs: dict[float, list[float]]
    features: list[str]
    feature_mean: list[float]
    feature_std: list[float]

    def predict(self, density, X: np.ndarray | None = None) -> np.ndarray:
        d = np.atleast_1d(np.asarray(density, dtype=float))
        out = np.empty(len(d))
        for i, di in enumerate(d):
            key = next((k for k in self.coefs if abs(k - di) < 1e-9), None)
            if key is None:
                raise CapsenseError(
                    f"the per-density regression has no fit at density {di:g} (measured: "
                    f"{', '.join(f'{k:g}' for k in sorted(self.coefs))}): it cannot predict between densities"
                )
            row = [1.0]
            if self.features:
                z = (np.asarray(X, dtype=float)[i] - np.array(self.feature_mean)) / np.array(self.feature_std)
                row.extend(z)
            out[i] = float(np.dot(row, self.coefs[key]))
        return out


def fit_per_density(
    density: Sequence[float], dL: Sequence[float], X: np.ndarray | None = None,
    feature_names: Sequence[str] = FEATURES, capability: str = "", method: str = "",
) -> PerDensityFit:
    d = np.asarray(density, dtype=float)
    y = np.asarray(dL, dtype=float)
    Z, used, mean, std = standardized_features(X, feature_names, len(d))
    coefs = {}
    for dv in np.unique(d):
        sel = np.isclose(d, dv)
        A = np.column_stack([np.ones(sel.sum()), Z[sel]])
        c, *_ = np.linalg.lstsq(A, y[sel], rcond=None)  # minimum-norm if under-determined
        coefs[float(dv)] = c.tolist()
    return PerDensityFit(capability, method, coefs, used, mean, std)


def pearson(a: Sequence[float], b: Sequence[float]) -> float:
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if len(a) < 2 or a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


@dataclass
class LinearFit:
    """``y = intercept + slope * x`` with its leave-one-out predictions and Pearson r."""

    name: str
    intercept: float
    slope: float
    n: int
    loo_pred: list[float] = field(default_factory=list)
    loo_pearson: float = float("nan")
    loo_mae: float = float("nan")
    x_range: tuple[float, float] = (float("nan"), float("nan"))

    def predict(self, x, allow_extrapolation: bool = True) -> np.ndarray:
        x = np.atleast_1d(np.asarray(x, dtype=float))
        lo, hi = self.x_range
        bad = x[(x < lo - 1e-9) | (x > hi + 1e-9)]
        if bad.size and not allow_extrapolation:
            raise CapsenseError(f"{self.name}: {bad[0]:g} is outside the measured range [{lo:g}, {hi:g}]")
        return self.intercept + self.slope * x

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fit_linear_loo(x: Sequence[float], y: Sequence[float], name: str = "", through_origin: bool = False) -> LinearFit:
    """Least-squares line and its leave-one-out predictions (Pearson r between them and ``y``)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < 3:
        raise FitError(f"{name or 'fit'}: leave-one-out needs at least 3 points, got {len(x)}")

    def solve(xs, ys):
        if through_origin:
            return 0.0, float((xs * ys).sum() / max((xs * xs).sum(), 1e-300))
        A = np.column_stack([np.ones(len(xs)), xs])
        c, *_ = np.linalg.lstsq(A, ys, rcond=None)
        return float(c[0]), float(c[1])

    b0, b1 = solve(x, y)
    loo = []
    for i in range(len(x)):
        m = np.arange(len(x)) != i
        c0, c1 = solve(x[m], y[m])
        loo.append(c0 + c1 * x[i])
    loo_a = np.array(loo)
    return LinearFit(
        name, b0, b1, len(x), loo_a.tolist(), pearson(loo_a, y), float(np.abs(loo_a - y).mean()),
        (float(x.min()), float(x.max())),
    )


def stable_rank_feature(record: Mapping[str, Any]) -> float:
    """``gamma * mean(rho_s)`` of a low-rank grid record (compression ratio times mean stable rank)."""
    sr = record["stable_rank"]
    targets = [k for k in record["targets"].split(",") if k in sr]
    rho = sr["all"] if len(targets) != 1 else sr[targets[0]]
    return float(record["summary"]["compression_ratio"]) * float(rho)


def quant_feature(record: Mapping[str, Any]) -> float:
    """``4^-B`` of an RTN grid record: the relative quantization noise power."""
    return 4.0 ** -float(record["setting"]["bits"])


def model_state_features(record: Mapping[str, Any]) -> list[float]:
    """(log parameters, reference loss L0, log training tokens) of a grid record's model state."""
    st = record.get("model_state", {})
    tokens = st.get("train_tokens")
    return [
        float(st.get("log_params", math.nan)),
        float(record.get("nll0", math.nan)),
        math.log(float(tokens)) if tokens else math.nan,
    ]

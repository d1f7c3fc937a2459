"""What a distillation's epoch records support: the fit ``dL(E) = d0 + a log(1 + E)`` per capability, and what a
repeated epoch is worth against an epoch of new text (:func:`fit_reuse_penalty`, the two arms of
:class:`~capsense.compress.distill.DistillConfig` ``fresh``). Fits of measurements, as the grid's are; the training
run that writes the records is :mod:`capsense.compress.distill`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from capsense.errors import CapsenseError


def fit_log_epochs(epochs: Sequence[float], dls: Sequence[float]) -> dict[str, float]:
    """Least squares ``dL(E) = d0 + a log(1 + E)``: a, d0 and the RMS residual."""
    x = torch.tensor([math.log1p(e) for e in epochs], dtype=torch.float64)
    y = torch.tensor(list(dls), dtype=torch.float64)
    X = torch.stack([torch.ones_like(x), x], 1)
    coef = torch.linalg.lstsq(X, y[:, None]).solution[:, 0]
    rms = float(((X @ coef - y) ** 2).mean().sqrt())
    return {"a": float(coef[1]), "d0": float(coef[0]), "rms": rms, "n": len(dls)}


def epoch_fits(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per capability, the fit ``dL(E) = d0 + a log(1 + E)`` over the epoch records."""
    caps = list(records[0]["dL"]) if records else []
    return {c: fit_log_epochs([r["epoch"] for r in records], [r["dL"][c] for r in records]) for c in caps}


def effective_epochs(epochs: float, r_star: float) -> float:
    """Epochs of fresh text that ``epochs`` passes over one text set are worth, by the
    data-constrained scaling law of Muennighoff et al. (2023): ``1 + R (1 - exp(-(E - 1) / R))``.
    ``R`` -> infinity: a repeat is worth a fresh epoch; ``R`` -> 0: repeats are worth nothing."""
    if epochs <= 1:
        return float(epochs)
    if math.isinf(r_star):
        return float(epochs)
    return 1.0 + r_star * (1.0 - math.exp(-(epochs - 1.0) / r_star))


def fit_reuse_penalty(reused: Sequence[dict[str, Any]], fresh: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per capability, what a repeated epoch is worth against an epoch of new text.

    ``reused``: epoch records of ``E`` passes over ``N`` texts; ``fresh``: records of one pass over
    ``E x N`` texts, recorded every ``N`` (:class:`DistillConfig` ``fresh``). The fresh arm is fitted
    by ``dL = d0 + a log(1 + E)``; each reused epoch's measured worth is the fresh amount with its
    dL (``measured_effective_epochs``, undefined when fresh text did not lower dL, ``a >= 0``);
    ``r_star`` is the decay constant of :func:`effective_epochs` that fits the reused arm's dL best
    (least squares over a log grid 0.01-1000 plus infinity), with its rms and that of "repeats are
    worth fresh text" (``rms_no_penalty``) for comparison. The penalty is fitted, never assumed.
    """
    if not any(r["epoch"] >= 1 for r in reused) or not fresh:
        raise CapsenseError("the reuse fit needs the records of both arms (reused and fresh), the reused arm past epoch 0")
    grid = [10 ** (k / 50) for k in range(-100, 151)] + [math.inf]
    out = {}
    for cap in reused[0]["dL"]:
        f = fit_log_epochs([r["epoch"] for r in fresh], [r["dL"][cap] for r in fresh])
        pts = [(r["epoch"], r["dL"][cap]) for r in reused if r["epoch"] >= 1]

        def rms(r_star: float) -> float:
            err = [f["d0"] + f["a"] * math.log1p(effective_epochs(e, r_star)) - y for e, y in pts]
            return math.sqrt(sum(x * x for x in err) / len(err))

        best = min(grid, key=rms) if f["a"] < -1e-12 else None
        measured = {e: (math.expm1((y - f["d0"]) / f["a"]) if best is not None else None) for e, y in pts}
        r_star = None if best is None else ("inf" if math.isinf(best) else best)  # JSON has no infinity
        out[cap] = {"fresh_fit": f, "measured_effective_epochs": measured, "r_star": r_star,
                    "rms": rms(best) if best is not None else None, "rms_no_penalty": rms(math.inf),
                    "final": {"reused": pts[-1][1], "fresh": fresh[-1]["dL"][cap]}}
    return out

"""Low-rank factorization: truncated SVD, activation-aware SVD and SVD-LLM.

All three replace an ``[m, n]`` weight ``W`` by a rank-``r`` product ``A @ B`` (``A``: ``[m, r]``,
``B``: ``[r, n]``, ``r (m + n)`` parameters). ``r`` comes from a parameter ratio ``R``:
``r = floor(R * m n / (m + n))``, so the factors hold at most ``R`` times the dense count.

* ``svd``: Eckart-Young truncation of ``W``.
* ``asvd`` (Yuan et al., 2023): scale input columns by ``S = diag(mean|x_j|^alpha)``, truncate
  ``W S``, undo: ``W' = trunc(W S) S^-1``.
* ``svd-llm`` (Wang et al., 2024): whiten with the Cholesky factor ``L`` of ``X^T X`` and
  truncate ``W L``: ``W' = trunc(W L) L^-1``, the rank-``r`` minimiser of ``||(W - W') X^T||_F``.

Checkpoints store the reconstructed dense ``W'``; the factor count is what accounting records.
"""

from __future__ import annotations

import torch

from capsense.core.registry import Registry
from capsense.errors import CapsenseError
from capsense.compress.checks import unit_fraction

Factors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (U, S, Vh') with W' = U_r diag(S_r) Vh'_r


def check_ratio(ratio: float) -> float:
    """Parameter ratios are the factors' share of the dense parameters, in (0, 1]."""
    return unit_fraction(ratio, "parameter ratio", "it is the factors' share of the dense parameters")


def rank_for_ratio(shape: tuple[int, int], ratio: float) -> int:
    """Largest rank whose factors hold at most ``ratio`` of the dense parameters (capped at full rank)."""
    m, n = shape
    ratio = check_ratio(ratio)
    r = min(int(ratio * m * n / (m + n) + 1e-9), min(m, n))
    if r < 1:
        raise CapsenseError(
            f"parameter ratio {ratio} leaves no rank for a {m}x{n} matrix: rank 1 needs a ratio of at least "
            f"{(m + n) / (m * n):.4g}"
        )
    return r


def _svd(w: torch.Tensor, input_abs_mean, gram, alpha) -> Factors:
    return torch.linalg.svd(w, full_matrices=False)


def _asvd(w: torch.Tensor, input_abs_mean, gram, alpha) -> Factors:
    if input_abs_mean is None:
        raise ValueError("asvd needs the calibration mean |x| per input feature")
    scale = input_abs_mean.double().clamp_min(1e-6) ** alpha
    u, s, vh = torch.linalg.svd(w * scale[None, :], full_matrices=False)
    return u, s, vh / scale[None, :]


def _svd_llm(w: torch.Tensor, input_abs_mean, gram, alpha) -> Factors:
    if gram is None:
        raise ValueError("svd-llm needs the calibration Gram matrix X^T X")
    L = whitening_factor(gram)
    u, s, vh = torch.linalg.svd(w @ L, full_matrices=False)
    # Vh L^-1 via a triangular solve: (Vh L^-1)^T = L^-T Vh^T
    return u, s, torch.linalg.solve_triangular(L.T, vh.T, upper=True).T


FACTORIZERS: Registry = Registry("method", "low-rank methods")
for _name, _fn in (("svd", _svd), ("asvd", _asvd), ("svd-llm", _svd_llm)):
    FACTORIZERS.register(_name, _fn)


def factorize(weight: torch.Tensor, method: str = "svd", input_abs_mean: torch.Tensor | None = None,
              gram: torch.Tensor | None = None, alpha: float = 0.5) -> Factors:
    """Full factorization of ``weight`` for ``method``; :func:`reconstruct` truncates it to any rank.

    The transform back from the scaled/whitened space is folded into ``Vh'``, so one
    factorization serves every ratio (the grid caches it).
    """
    return FACTORIZERS[method](weight.detach().double(), input_abs_mean, gram, alpha)


def reconstruct(factors: Factors, rank: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``U_r diag(S_r) Vh'_r``: the rank-``rank`` weight from a :func:`factorize` result."""
    u, s, vh = factors
    out = (u[:, :rank] * s[:rank]) @ vh[:rank]
    return out.to(dtype) if dtype is not None else out


def svd_truncate(weight: torch.Tensor, rank: int) -> torch.Tensor:
    """Best rank-``rank`` approximation of ``weight`` in Frobenius norm (Eckart-Young)."""
    return reconstruct(factorize(weight, "svd"), rank, weight.dtype)


def asvd(weight: torch.Tensor, rank: int, input_abs_mean: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """Activation-aware SVD: columns scaled by ``mean|x|^alpha`` before truncation, unscaled after."""
    return reconstruct(factorize(weight, "asvd", input_abs_mean=input_abs_mean, alpha=alpha), rank, weight.dtype)


def whitening_factor(gram: torch.Tensor, jitter: float = 1e-6) -> torch.Tensor:
    """Lower Cholesky factor ``L`` of ``X^T X``, with growing diagonal jitter until it is positive definite."""
    g = gram.double()
    g = (g + g.T) / 2
    eye = torch.eye(g.shape[0], dtype=g.dtype)
    base = float(g.diagonal().mean().clamp_min(1e-12))
    eps = jitter
    for _ in range(12):
        L, info = torch.linalg.cholesky_ex(g + eps * base * eye)
        if int(info) == 0:
            return L
        eps *= 10
    raise CapsenseError("calibration Gram matrix is not positive definite even with jitter: use more calibration data")


def svd_llm(weight: torch.Tensor, rank: int, gram: torch.Tensor) -> torch.Tensor:
    """SVD-LLM: truncation in the whitened space of the calibration inputs."""
    return reconstruct(factorize(weight, "svd-llm", gram=gram), rank, weight.dtype)


def stable_rank(weight: torch.Tensor) -> float:
    """``||W||_F^2 / ||W||_2^2``: how many directions carry the matrix's energy."""
    w = weight.detach().float()
    top = torch.linalg.matrix_norm(w, ord=2)
    if float(top) == 0.0:
        return 0.0
    return float((w.pow(2).sum() / top**2).item())

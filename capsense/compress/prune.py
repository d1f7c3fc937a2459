"""Unstructured pruning: magnitude and Wanda (Sun et al., 2023), with protected columns.

A mask keeps the ``k`` highest-scoring weights of each comparison group:

* ``row``: each output row keeps ``round(density * in_features)`` weights;
* ``matrix``: the matrix keeps ``round(density * numel)``;
* ``global``: all targeted matrices together keep ``round(density * total)``
  (see :func:`global_masks`).

Magnitude scores are ``|W|``; Wanda scores are ``|W_ij| * ||X_j||_2``, the weight times
the L2 norm of input feature ``j`` over the calibration tokens, compared per output row.
Protected rows and columns (:class:`~capsense.compress.protect.Protection`) are kept dense
**on top of** the density: they score ``+inf`` and the unprotected weights of each comparison
group keep ``round(density * unprotected)`` among themselves, so a matrix holding protected
weights stores more than ``density`` of it, and its size says so
(:meth:`~capsense.compress.settings.PruneSetting.size`). Until round 12 protected columns
counted toward each row's ``round(density * in_features)``, which on a model with few wide heads
crowded the others out (Gemma 3 270M, 4 heads of 256, density 0.5: one protected head left the
other three 33% of their columns, two left them none). With nothing protected the masks are
unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from capsense.compress.checks import unit_fraction

SCOPES = ("row", "matrix", "global")


def check_density(density: float) -> float:
    """Densities are the fraction of weights kept, in (0, 1]."""
    return unit_fraction(density, "density", "it is the fraction of weights kept, e.g. 0.5")


def check_scope(scope: str) -> str:
    if scope not in SCOPES:
        raise ValueError(f"unknown pruning scope {scope!r}: valid scopes are {', '.join(SCOPES)}")
    return scope


def magnitude_scores(weight: torch.Tensor) -> torch.Tensor:
    return weight.detach().abs().float()


def wanda_scores(weight: torch.Tensor, input_norm: torch.Tensor) -> torch.Tensor:
    """``|W_ij| * ||X_j||``; ``input_norm`` is the per-input-feature L2 norm, shape ``[in]``."""
    if input_norm.shape != (weight.shape[1],):
        raise ValueError(f"input norm has shape {tuple(input_norm.shape)}, expected ({weight.shape[1]},)")
    return weight.detach().abs().float() * input_norm.float()[None, :]


def _protect(scores: torch.Tensor, protected_cols: torch.Tensor | None, protected_rows: torch.Tensor | None = None) -> torch.Tensor:
    cols = protected_cols is not None and bool(protected_cols.any())
    rows = protected_rows is not None and bool(protected_rows.any())
    if not (cols or rows):
        return scores
    scores = scores.clone()
    if cols:
        scores[:, protected_cols] = float("inf")
    if rows:
        scores[protected_rows] = float("inf")
    return scores


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the ``k`` largest entries of a flat score tensor (ties: lowest index)."""
    flat = scores.reshape(-1)
    mask = torch.zeros(flat.numel(), dtype=torch.bool)
    if k > 0:
        mask[torch.topk(flat, k, sorted=False).indices] = True
    return mask.view(scores.shape)


def mask_from_scores(
    scores: torch.Tensor, density: float, scope: str = "row", protected_cols: torch.Tensor | None = None,
    protected_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Keep-mask of one matrix at ``density`` for scope ``row`` or ``matrix``: protected rows and
    columns kept whole, the unprotected weights of each row (or of the matrix) at ``density``."""
    density = check_density(density)
    check_scope(scope)
    if scope == "global":
        raise ValueError("global scope spans several matrices: use global_masks()")
    n_out, n_in = scores.shape
    n_cols = int(protected_cols.sum()) if protected_cols is not None else 0
    n_rows = int(protected_rows.sum()) if protected_rows is not None else 0
    scores = _protect(scores, protected_cols, protected_rows)
    if scope == "matrix":
        n_free = (n_out - n_rows) * (n_in - n_cols)
        return topk_mask(scores, round(density * n_free) + n_out * n_in - n_free)
    k = round(density * (n_in - n_cols)) + n_cols
    mask = torch.zeros_like(scores, dtype=torch.bool)
    if k > 0:
        mask.scatter_(1, torch.topk(scores, k, dim=1, sorted=False).indices, True)
    if n_rows:
        mask[protected_rows] = True
    return mask


def global_masks(
    scores: Sequence[torch.Tensor], density: float, protected_cols: Sequence[torch.Tensor | None] | None = None,
    protected_rows: Sequence[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """Keep-masks for several matrices ranked together (one threshold for all): every protected
    weight and ``round(density * unprotected)`` of the others."""
    density = check_density(density)
    cols = list(protected_cols) if protected_cols is not None else [None] * len(scores)
    rows = list(protected_rows) if protected_rows is not None else [None] * len(scores)
    scored = [_protect(s, c, r) for s, c, r in zip(scores, cols, rows)]
    n_prot = sum(int(torch.isinf(p).sum()) for p, s in zip(scored, scores) if p is not s)
    n_free = sum(s.numel() for s in scores) - n_prot
    flat = torch.cat([s.reshape(-1) for s in scored])
    mask = topk_mask(flat, round(density * n_free) + n_prot)
    out, start = [], 0
    for s in scores:
        out.append(mask[start : start + s.numel()].view(s.shape))
        start += s.numel()
    return out


def apply_mask(weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``weight`` with the pruned entries set to exactly zero."""
    return torch.where(mask.to(weight.device), weight, torch.zeros((), dtype=weight.dtype, device=weight.device))

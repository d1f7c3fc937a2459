"""Unstructured pruning: magnitude and Wanda (Sun et al., 2023), with protected columns.

A mask keeps the ``k`` highest-scoring weights of each comparison group:

* ``row``: each output row keeps ``round(density * in_features)`` weights;
* ``matrix``: the matrix keeps ``round(density * numel)``;
* ``global``: all targeted matrices together keep ``round(density * total)``
  (see :func:`global_masks`).

Magnitude scores are ``|W|``; Wanda scores are ``|W_ij| * ||X_j||_2``, the weight times
the L2 norm of input feature ``j`` over the calibration tokens, compared per output row.
Protected columns score ``+inf``: they are kept first and count toward the budget, so the
requested density is still the achieved density (unless the protected weights alone
exceed it; then they are all kept and the achieved density is higher).
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
    """Keep-mask of one matrix at ``density`` for scope ``row`` or ``matrix``; protected rows are kept whole."""
    density = check_density(density)
    check_scope(scope)
    if scope == "global":
        raise ValueError("global scope spans several matrices: use global_masks()")
    n_out, n_in = scores.shape
    n_prot = int(protected_cols.sum()) if protected_cols is not None else 0
    n_rows = int(protected_rows.sum()) if protected_rows is not None else 0
    scores = _protect(scores, protected_cols, protected_rows)
    if scope == "matrix":
        k = max(round(density * scores.numel()), n_prot * (n_out - n_rows) + n_rows * n_in)
        return topk_mask(scores, k)
    k = max(round(density * n_in), n_prot)
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
    """Keep-masks for several matrices ranked together (one threshold for all)."""
    density = check_density(density)
    cols = list(protected_cols) if protected_cols is not None else [None] * len(scores)
    rows = list(protected_rows) if protected_rows is not None else [None] * len(scores)
    scored = [_protect(s, c, r) for s, c, r in zip(scores, cols, rows)]
    n_prot = sum(int(torch.isinf(p).sum()) for p, s in zip(scored, scores) if p is not s)
    total = sum(s.numel() for s in scores)
    flat = torch.cat([s.reshape(-1) for s in scored])
    mask = topk_mask(flat, max(round(density * total), n_prot))
    out, start = [], 0
    for s in scores:
        out.append(mask[start : start + s.numel()].view(s.shape))
        start += s.numel()
    return out


def apply_mask(weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``weight`` with the pruned entries set to exactly zero."""
    return torch.where(mask.to(weight.device), weight, torch.zeros((), dtype=weight.dtype, device=weight.device))

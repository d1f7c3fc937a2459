"""GPTQ and SparseGPT: quantize or prune one matrix, compensating each error on the columns not yet done.

Both minimise the layer's output error ``||W X - W' X||^2`` over the calibration inputs ``X``, whose
Hessian is proportional to the Gram matrix ``G = X^T X`` that calibration already collects
(:class:`~capsense.compress.calibration.InputStats` with ``gram=True``). Columns are processed left
to right; after column ``j`` is rounded (GPTQ) or zeroed (SparseGPT), its error, divided by the
``j``-th diagonal entry of the upper Cholesky factor ``U`` of ``G^-1``, is subtracted from the
remaining columns along row ``j`` of ``U`` (the optimal-brain-surgeon update, done lazily in blocks
of 128 columns). Frantar et al., "GPTQ" (2022) and "SparseGPT" (2023); written from the papers.

* ``damp``: ``damp * mean(diag G)`` is added to the diagonal so ``G`` is invertible (1% as in the
  papers). Columns whose input was always zero get weight 0: no calibration token can tell.
* GPTQ ``act_order``: columns are processed by decreasing ``diag G`` (the most active inputs
  first, while most columns remain to absorb their error). The group scales are then fixed up front
  from the original weights, in the original column order, so groups stay contiguous and a packed
  checkpoint needs no column index; without it each group's scale is taken from the updated weights
  when the group starts. Scales follow :mod:`~capsense.compress.quantize` (bfloat16-exact).
* SparseGPT picks its mask block by block (128 columns), pruning the weights of least
  ``w^2 / U_jj^2`` (the OBS saliency) after the previous blocks' updates: per row, cumulatively
  exact (a row keeps ``round(density * in)`` weights, like Wanda's row scope), or ``2:4`` (two of
  every four consecutive weights, density 0.5). Protection is the caller's
  (:class:`~capsense.compress.compensated.SparseGPTSetting`, as for GPTQ): it solves the free block
  alone, the free columns with the Gram matrix's free block ``G[free][:, free]`` (the exact
  OBS/least-squares problem with the protected weights held fixed: their error is zero, so the free
  columns' Hessian is that block), and puts it back, so protected rows and columns stay bit-identical
  and come on top of the density. Under ``2:4`` protected columns must be whole groups of four (head
  spans are, :func:`check_pattern`): the free columns left are then whole groups too, 2:4 in their
  own groups, the protected ones dense (what a 2:4 kernel needs holds for the free block, not for the
  whole matrix). Until round 13 the protected columns were guarded inside the solve instead and still
  took the compensation of the others' pruning (their values changed, unlike under GPTQ).
* Pricing a guided allocation (:mod:`~capsense.compress.compensated`): :func:`gptq_output_errors`
  and :func:`sparsegpt_output_errors` solve every level of one matrix as one stacked weight
  (levels share ``U``; bit width or density per row). SparseGPT's column loop updates a transposed
  copy of each block (contiguous rows, one ``addr_`` per column) and ranks saliency with one sort:
  bit-identical to the straightforward loop, half its CPU time (8 densities of a 1536x576 matrix:
  1.87 -> 0.92 CPU-s); stacking levels itself saves little (33 densities ~ 33 separate solves).
"""

from __future__ import annotations

import torch

from capsense.errors import BudgetError
from capsense.compress.quantize import check_bits, check_group_size, group_scales, group_width, storable_scale

BLOCK = 128
PATTERNS = ("row", "2:4")


def _inverse_factor(gram: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(upper Cholesky factor of the damped ``G^-1``, mask of dead input columns)."""
    h = gram.detach().double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    h += damp * torch.diag(h).mean() * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    inv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inv, upper=True), dead


def _check(w: torch.Tensor, gram: torch.Tensor, damp: float) -> torch.Tensor:
    """The Gram matrix on the weight's device, once its shape and ``damp`` are checked: every solve runs where the
    weight is (a CPU copy, or the layer's device under ``solve_on: layer``), the results stay there."""
    if gram.shape != (w.shape[1], w.shape[1]):
        raise BudgetError(f"the Gram matrix has shape {tuple(gram.shape)}, expected {(w.shape[1],) * 2}")
    if not 0 < damp < 1:
        raise BudgetError(f"damp {damp} is outside (0, 1): it is the fraction of the mean Hessian diagonal added")
    return gram.to(w.device)


def _propagate(w: torch.Tensor, err: torch.Tensor, u: torch.Tensor, start: int, end: int) -> None:
    """Lazy block update: the block's scaled errors moved onto the columns after it."""
    if end < w.shape[1]:
        w[:, end:] -= err @ u[start:end, end:]


def _solve(w: torch.Tensor, u: torch.Tensor, q_max: torch.Tensor, scale_of) -> torch.Tensor:
    """GPTQ's column loop over ``w`` (columns already in processing order, updated in place):
    the rounded weights. ``scale_of(j, w)`` gives column ``j``'s ``[rows]`` scale; ``q_max`` is
    per row (rows of different bit widths can be solved together: they share ``u``)."""
    n_in = w.shape[1]
    q = torch.zeros_like(w)
    for start in range(0, n_in, BLOCK):
        end = min(start + BLOCK, n_in)
        err = torch.zeros(w.shape[0], end - start, dtype=w.dtype, device=w.device)
        for j in range(start, end):
            s = scale_of(j, w)
            q[:, j] = torch.clamp(torch.round(w[:, j] / s), -q_max, q_max) * s
            e = (w[:, j] - q[:, j]) / u[j, j]
            w[:, j + 1 : end] -= e[:, None] * u[j, j + 1 : end][None, :]
            err[:, j - start] = e
        _propagate(w, err, u, start, end)
    return q


def _static_scale_of(groups: list[tuple[torch.Tensor, torch.Tensor]]):
    """``scale_of`` for :func:`_solve` from static group scales: ``groups`` is one ``([rows, groups] scales, each
    processed column's group)`` per stack of rows. A block of columns' scales is gathered at once: not every
    column's (memory), and not one column's by a device index (a host sync per column on a GPU)."""
    block: dict = {}

    def scale_of(j, _w):
        start = j - j % BLOCK
        if block.get("start") != start:
            block["start"], block["scales"] = start, torch.cat([s[:, of[start : start + BLOCK]] for s, of in groups])
        return block["scales"][:, j - start]
    return scale_of


def _permuted(weight: torch.Tensor, gram: torch.Tensor, damp: float, act_order: bool, dtype=torch.float64):
    """(permutation, upper factor of the damped inverse, weight in that column order with dead columns zeroed)."""
    n_in = weight.shape[1]
    diag = torch.diag(gram).double()
    perm = torch.argsort(diag, descending=True) if act_order else torch.arange(n_in, device=diag.device)
    u, dead = _inverse_factor(gram.double()[perm][:, perm], damp)
    w = weight.detach().to(dtype)[:, perm].clone()
    w[:, dead] = 0.0
    return perm, u.to(dtype), w


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, gram: torch.Tensor, bits: int, group_size: int = 128,
                  damp: float = 0.01, act_order: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ of an ``[out, in]`` weight: (dequantized weight in float32, ``[out, groups]`` scales)."""
    bits, group_size = check_bits(bits), check_group_size(group_size)
    gram = _check(weight, gram, damp)
    n_in = weight.shape[1]
    perm, u, w = _permuted(weight, gram, damp, act_order)
    g = group_width(n_in, group_size)
    q_max = torch.full((w.shape[0],), float(2 ** (bits - 1) - 1), dtype=w.dtype, device=w.device)
    if act_order:  # static scales, from the original weights in the original column order
        unperm = torch.empty_like(w)
        unperm[:, perm] = w
        scales = group_scales(unperm, bits, group_size).double()
        scale_of = _static_scale_of([(scales, perm // g)])
    else:
        scales = torch.zeros(w.shape[0], -(-n_in // g), dtype=w.dtype, device=w.device)

        def scale_of(j, cur):  # a group starts: its scale from the updated weights
            if j % g == 0:
                scales[:, j // g] = storable_scale(cur[:, j : j + g].abs().amax(1) / q_max[0], bits).double()
            return scales[:, j // g]
    q = _solve(w, u, q_max, scale_of)
    out = torch.empty_like(q)
    out[:, perm] = q
    return out.float(), scales.float()


@torch.no_grad()
def gptq_output_errors(weight: torch.Tensor, gram: torch.Tensor, levels: list[tuple[int, int]], damp: float = 0.01,
                       dtype=torch.float32) -> torch.Tensor:
    """``[levels, out]``: each row's calibration output error ``dW G dW^T`` after GPTQ (activation
    order, static group scales) at each ``(bits, group_size)`` level, ``dW`` the weight minus its
    GPTQ result. All levels share the Gram matrix's factor, so they are solved together as one
    stacked weight (one column loop instead of one per level); ``float32`` by default (pricing
    needs no more; ``float64`` reproduces :func:`gptq_quantize` exactly)."""
    gram = _check(weight, gram, damp)
    n_out, n_in = weight.shape
    perm, u, w = _permuted(weight, gram, damp, True, dtype)
    unperm = torch.empty_like(w)
    unperm[:, perm] = w
    groups, q_max = [], []  # per level: ([out, groups] scales, each processed column's group)
    for bits, group_size in levels:
        g = group_width(n_in, check_group_size(group_size))
        groups.append((group_scales(unperm, check_bits(bits), group_size).to(dtype), perm // g))
        q_max.append(torch.full((n_out,), float(2 ** (bits - 1) - 1), dtype=dtype, device=w.device))
    del unperm
    q = _solve(w.repeat(len(levels), 1), u, torch.cat(q_max), _static_scale_of(groups))
    dw = q.view(len(levels), n_out, n_in).neg_().add_(weight.detach().to(dtype)[:, perm])  # in place: W - q per level
    return row_output_errors(dw.view(-1, n_in), gram[perm][:, perm]).view(len(levels), n_out)


def output_errors_memory(n_levels: int, rows: int, cols: int, itemsize: int = 4) -> int:
    """The most bytes :func:`gptq_output_errors` or :func:`sparsegpt_output_errors` hold at once, at most, for
    ``n_levels`` levels of a ``[rows, cols]`` weight solved together in a dtype of ``itemsize`` bytes (float32 by
    default): the stacked weight being solved and its result (``S = n_levels * rows * cols * itemsize`` each), the
    block update's temporary (up to ``S``), a block's scales, errors and column update (``S * min(BLOCK, cols) / cols``
    each; SparseGPT: its saliency, sorted order, mask and errors), one unstacked copy of the weight and three float64
    copies of the Gram matrix; or, when the Gram dominates, factorizing it (five copies). Measured with
    :class:`~capsense.core.memory.TensorPeak` (round 20): 0.74-0.86 (GPTQ, 18 levels) and 0.70-0.79 (SparseGPT, 12
    densities) of this on SmolLM2's shapes (3.1-3.4 ``S``), 0.6-0.9 on tiny ones; until round 20 the solve held 6.2-6.6
    ``S`` (every column's scale and the stacked ``W - Q`` beside the stacked weight, the product not in place)."""
    stacked, gram, weight = n_levels * rows * cols * itemsize, 8 * cols * cols, rows * cols * itemsize
    solving = 3 * stacked + 3 * stacked * min(BLOCK, cols) // cols + weight + 3 * gram
    return max(solving, 5 * gram + weight)  # or factorizing the damped Gram (its copies, the factor, the inverse)


def row_output_errors(dw: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """Per row of a weight change ``dw`` ``[rows, in]``, its output error on the calibration inputs,
    ``dW_i G dW_i^T`` (``G`` cast to ``dw``'s dtype): what GPTQ and SparseGPT minimise, and what prices
    their levels (:mod:`capsense.compress.compensated`)."""
    return (dw @ gram.to(dw.device, dw.dtype)).mul_(dw).sum(1)  # the product in place: one copy of ``dw``'s size, not two


def _row_prune_counts(density: torch.Tensor, start: int, end: int, n_in: int, done: torch.Tensor,
                      total: torch.Tensor) -> torch.Tensor:
    """Weights each row prunes in columns ``start:end``: the cumulative share ``c - round(density * c)``
    of the ``c = end`` columns through column ``end`` (``density`` per row), at least what the later
    columns can no longer absorb, so each row prunes exactly ``total`` in all."""
    share = torch.minimum(end - torch.round(density * end).long(), total)
    return torch.maximum(share - done, total - done - (n_in - end)).clamp(min=0, max=end - start)


def _block_mask(saliency: torch.Tensor, pattern: str, k: torch.Tensor | None) -> torch.Tensor:
    """Pruned-mask of one block (True = pruned): the ``k[row]`` least salient entries of each row, or
    for ``2:4`` the two least salient of every four."""
    n_out, width = saliency.shape
    if pattern == "2:4":
        low = torch.topk(saliency.view(n_out, width // 4, 4), 2, dim=2, largest=False).indices
        pruned = torch.zeros(n_out, width // 4, 4, dtype=torch.bool, device=saliency.device).scatter_(2, low, True)
        return pruned.view(n_out, width)
    order = torch.argsort(saliency, dim=1)
    low = torch.arange(width, device=saliency.device)[None, :] < k[:, None]  # the first k[row] of each row's order
    return torch.zeros(n_out, width, dtype=torch.bool, device=saliency.device).scatter_(1, order, low)


def _prune_solve(w: torch.Tensor, u: torch.Tensor, density: torch.Tensor, pattern: str) -> torch.Tensor:
    """SparseGPT's column loop over ``w`` (updated in place, pruned entries zeroed): the keep-mask.
    ``density`` is per row (float64), so rows of different densities can be solved together: they
    share ``u``."""
    n_out, n_in = w.shape
    total = n_in - torch.round(density * n_in).long()  # pruned per row
    done = torch.zeros(n_out, dtype=torch.long, device=w.device)
    keep = torch.ones(n_out, n_in, dtype=torch.bool, device=w.device)
    for start in range(0, n_in, BLOCK):
        end = min(start + BLOCK, n_in)
        sal = w[:, start:end].pow(2) / torch.diag(u)[start:end].pow(2)[None, :]
        k = None if pattern == "2:4" else _row_prune_counts(density, start, end, n_in, done, total)
        keep[:, start:end] = ~_block_mask(sal, pattern, k)
        done += (~keep[:, start:end]).sum(1)
        blk = w[:, start:end].t().contiguous()  # [columns, rows]: each column's update is contiguous
        kept = keep[:, start:end].t().to(w.dtype)
        err = torch.empty_like(blk)
        for j in range(end - start):
            err[j] = blk[j] * (1.0 - kept[j]) / u[start + j, start + j]
            blk[j] *= kept[j]
            blk[j + 1 :].addr_(u[start + j, start + j + 1 : end], err[j], alpha=-1.0)
        w[:, start:end] = blk.t()
        _propagate(w, err.t(), u, start, end)
    w.masked_fill_(~keep, 0.0)  # not w[~keep] = 0: indexing by a mask lists its indices, 16 bytes per pruned weight
    return keep


def check_pattern(pattern: str, density: float, n_in: int, protected_cols: torch.Tensor | None = None) -> None:
    """A pattern SparseGPT can prune ``n_in`` columns with: ``2:4`` needs density 0.5, columns in groups
    of four and protected columns in whole groups (so the free ones stay 2:4 in their own groups)."""
    if pattern not in PATTERNS:
        raise BudgetError(f"unknown sparsity pattern {pattern!r}: valid patterns are {', '.join(PATTERNS)}")
    if pattern != "2:4":
        return
    if density != 0.5 or n_in % 4:
        raise BudgetError(f"the 2:4 pattern keeps two of every four weights: it needs density 0.5 (got {density}) "
                          f"and input columns divisible by 4 (got {n_in})")
    groups = protected_cols.view(-1, 4) if protected_cols is not None else None
    if groups is not None and bool((groups.any(1) != groups.all(1)).any()):
        raise BudgetError("the 2:4 pattern prunes two of every four consecutive weights: protected columns must be "
                          "whole groups of four (a head's columns are, when its dimension is a multiple of 4)")


@torch.no_grad()
def sparsegpt_prune(weight: torch.Tensor, gram: torch.Tensor, density: float, pattern: str = "row",
                    damp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT of an ``[out, in]`` weight: (pruned, compensated weight in float32, keep-mask). With
    protected weights, call it on the free block (module docstring)."""
    gram = _check(weight, gram, damp)
    n_out, n_in = weight.shape
    check_pattern(pattern, density, n_in)
    u, dead = _inverse_factor(gram, damp)
    w = weight.detach().double().clone()
    w[:, dead] = 0.0
    keep = _prune_solve(w, u, torch.full((n_out,), float(density), dtype=torch.float64, device=w.device), pattern)
    return w.float(), keep


@torch.no_grad()
def sparsegpt_output_errors(weight: torch.Tensor, gram: torch.Tensor, densities: list[float], damp: float = 0.01,
                            dtype=torch.float32) -> torch.Tensor:
    """``[levels, out]``: each row's calibration output error ``dW G dW^T`` after SparseGPT (row
    pattern) at each density, ``dW`` the weight minus its SparseGPT result. Like
    :func:`gptq_output_errors`, the levels share the Gram matrix's factor and are solved together as
    one stacked weight; ``float64`` reproduces :func:`sparsegpt_prune` exactly."""
    gram = _check(weight, gram, damp)
    n_out, n_in = weight.shape
    u, dead = _inverse_factor(gram, damp)
    w = weight.detach().to(dtype).clone()
    w[:, dead] = 0.0
    n = len(densities)
    big = w.repeat(n, 1)
    density = torch.tensor([float(d) for d in densities], dtype=torch.float64, device=w.device).repeat_interleave(n_out)
    _prune_solve(big, u.to(dtype), density, "row")
    dw = big.view(n, n_out, n_in).neg_().add_(weight.detach().to(dtype))  # in place: W - W' per density
    return row_output_errors(dw.view(-1, n_in), gram).view(n, n_out)

"""Protected weights: rows and columns of a matrix kept dense and at full precision.

Two kinds of protection, both from a set of heads:

* ``columns`` (the ``protect:`` of budget files): the heads' input columns of the attention
  output projection;
* ``whole`` heads: also the heads' query rows, and the key/value rows of their KV group
  (under grouped-query attention one key/value head serves ``n_heads / n_kv_heads`` query
  heads, so protecting any of them protects the group's key/value rows).

Fused projections are handled by their row layout: ``qkv_proj`` (Phi-3: all queries, then
keys, then values), ``c_attn`` (GPT-2: q, k, v blocks) and ``query_key_value`` (GPT-NeoX:
per head ``[q, k, v]`` interleaved).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from capsense.errors import BudgetError
from capsense.compress.targets import Target, out_projection_name


ProtectionError = BudgetError  # heads that cannot be protected in this model


@dataclass
class Protection:
    """Protected rows and columns of one ``[out, in]`` matrix (None: none of that kind)."""

    rows: torch.Tensor | None = None  # bool [out]
    cols: torch.Tensor | None = None  # bool [in]

    def free_rows(self, n_out: int) -> torch.Tensor:
        return ~self.rows if self.rows is not None else torch.ones(n_out, dtype=torch.bool)

    def free_cols(self, n_in: int) -> torch.Tensor:
        return ~self.cols if self.cols is not None else torch.ones(n_in, dtype=torch.bool)

    def entries(self, shape: tuple[int, int]) -> torch.Tensor:
        """Bool ``[out, in]``: the protected entries."""
        return ~(self.free_rows(shape[0])[:, None] & self.free_cols(shape[1])[None, :])

    def free_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        return int(self.free_rows(shape[0]).sum()), int(self.free_cols(shape[1]).sum())

    def n_protected(self, shape: tuple[int, int]) -> int:
        fr, fc = self.free_shape(shape)
        return shape[0] * shape[1] - fr * fc

    def merge(self, other: Protection) -> Protection:
        def _or(a, b):
            return b if a is None else a if b is None else a | b

        return Protection(_or(self.rows, other.rows), _or(self.cols, other.cols))


def kv_heads(model: nn.Module, n_heads: int) -> int:
    """Number of key/value heads (equal to ``n_heads`` without grouped-query attention)."""
    from capsense.core.arch import unwrap

    cfg = unwrap(model).config
    cfg = getattr(cfg, "text_config", None) or cfg
    return int(getattr(cfg, "num_key_value_heads", None) or n_heads)


def _span(mask: torch.Tensor, start: int, width: int) -> None:
    mask[start : start + width] = True


def query_row_start(short: str, head: int, head_dim: int) -> int | None:
    """First of the ``head_dim`` rows of projection ``short`` that compute ``head``'s query
    (None for a projection without queries). ``q_proj``, and the fused ``qkv_proj`` (Phi-3) and
    ``c_attn`` (GPT-2), start with all queries; ``query_key_value`` (GPT-NeoX) is per head [q, k, v]."""
    if short in ("q_proj", "qkv_proj", "c_attn"):
        return head * head_dim
    if short == "query_key_value":
        return 3 * head * head_dim
    return None


def _head_rows(short: str, n_out: int, heads: Iterable[int], n_heads: int, n_kv: int, hd: int) -> torch.Tensor | None:
    """Rows of projection ``short`` that compute the given heads' queries, keys or values."""
    heads = sorted(set(heads))
    groups = sorted({h // (n_heads // n_kv) for h in heads})
    rows = torch.zeros(n_out, dtype=torch.bool)
    if short == "q_proj":
        for h in heads:
            _span(rows, h * hd, hd)
    elif short in ("k_proj", "v_proj"):
        for g in groups:
            _span(rows, g * hd, hd)
    elif short in ("qkv_proj", "c_attn"):  # [all q | all k | all v]
        for h in heads:
            _span(rows, h * hd, hd)
        for g in groups:
            _span(rows, n_heads * hd + g * hd, hd)
            _span(rows, n_heads * hd + n_kv * hd + g * hd, hd)
    elif short == "query_key_value":  # per head [q, k, v]
        for h in heads:
            _span(rows, 3 * h * hd, 3 * hd)
    else:
        return None
    return rows


def head_protection(model: nn.Module, heads, targets: Sequence[Target], whole: bool = False) -> dict[str, Protection]:
    """Protection of each target matrix for a :class:`~capsense.core.heads.HeadSet`."""
    from capsense.core.arch import head_layout
    from capsense.errors import HeadSpecError

    if heads is None or not len(heads):
        return {}
    layout = head_layout(model)
    try:
        heads.check_fits(layout)
    except HeadSpecError as e:
        raise ProtectionError(f"protect: {e}") from None
    by_layer = heads.by_layer()
    n_kv = kv_heads(model, layout.n_heads)
    out: dict[str, Protection] = {}
    for t in targets:
        if t.layer not in by_layer or t.kind != "attn":
            continue
        if t.name == out_projection_name(model, t.layer):
            cols = torch.zeros(t.shape[1], dtype=torch.bool)
            for h in by_layer[t.layer]:
                _span(cols, h * layout.head_dim, layout.head_dim)
            out[t.name] = Protection(cols=cols)
        elif whole:
            rows = _head_rows(t.short, t.shape[0], by_layer[t.layer], layout.n_heads, n_kv, layout.head_dim)
            if rows is not None:
                out[t.name] = Protection(rows=rows)
    return out

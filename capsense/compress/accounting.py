"""Exact size accounting: density, bits per parameter, parameter ratio.

Reference: every parameter stored at ``base_bits`` (16: fp16/bf16). Per targeted matrix:

* pruned: ``stored = nonzero`` weights at ``base_bits`` (index overhead not counted): the protected
  weights, all kept, plus the setting's density of the others (protection comes on top);
* RTN: ``bits = B * quantized + 16 * groups + base_bits * protected``; ``stored = numel``;
* low-rank: ``stored = r (m + n_free) + m * n_protected`` at ``base_bits``;
* untouched: ``stored = numel`` at ``base_bits``.

Model totals add every other parameter (embeddings, norms; tied weights counted once) at
``base_bits``. ``size_ratio`` is total bits over the dense ``base_bits`` model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

BASE_BITS = 16


@dataclass
class MatrixAccount:
    """What one matrix costs after compression."""

    name: str
    kind: str
    shape: tuple[int, int]
    method: str
    setting: dict[str, Any] = field(default_factory=dict)
    n_params: int = 0
    stored_params: int = 0
    nonzero: int = 0
    bits: int = 0
    protected_cols: int = 0
    protected_rows: int = 0

    @property
    def density(self) -> float:
        return self.nonzero / self.n_params if self.n_params else 1.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        if not self.protected_rows:
            del d["protected_rows"]  # only whole-head protection has any
        return d


def dense_account(name: str, kind: str, shape: tuple[int, int], nonzero: int, base_bits: int = BASE_BITS) -> MatrixAccount:
    n = shape[0] * shape[1]
    return MatrixAccount(name, kind, shape, "none", {}, n, n, nonzero, n * base_bits)


def model_param_count(model: nn.Module) -> int:
    """Distinct parameters of a model (tied weights counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def summarize(accounts: Iterable[MatrixAccount], model_params: int, base_bits: int = BASE_BITS) -> dict[str, Any]:
    """Totals over the targeted matrices and over the whole model."""
    accounts = list(accounts)
    n_t = sum(a.n_params for a in accounts)
    stored_t = sum(a.stored_params for a in accounts)
    nz_t = sum(a.nonzero for a in accounts)
    bits_t = sum(a.bits for a in accounts)
    rest = model_params - n_t
    total_bits = bits_t + rest * base_bits
    return {
        "base_bits": base_bits,
        "target_params": n_t,
        "model_params": model_params,
        "target_density": nz_t / n_t if n_t else 1.0,
        "target_param_ratio": stored_t / n_t if n_t else 1.0,
        "target_bits_per_param": bits_t / n_t if n_t else float(base_bits),
        "model_density": (nz_t + rest) / model_params,
        "model_param_ratio": (stored_t + rest) / model_params,
        "model_bits_per_param": total_bits / model_params,
        "size_ratio": total_bits / (model_params * base_bits),
        "target_size_ratio": bits_t / (n_t * base_bits) if n_t else 1.0,
        "compression_ratio": 1.0 - stored_t / n_t if n_t else 0.0,
    }

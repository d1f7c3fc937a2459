"""The matrices compression acts on: linear layers inside decoder blocks, classified attn/mlp.

Embeddings, the LM head and norms are never targets (SmolLM2 and Gemma tie the LM head to
the embedding). GPT-2's ``Conv1D`` stores its weight as ``[in, out]``; :meth:`Target.get`
and :meth:`Target.set` always speak ``[out, in]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from capsense.errors import BudgetError
from capsense.core.arch import arch_spec, check_compress_kinds, unwrap

KINDS = ("attn", "mlp")
_ATTN_WORDS = ("attn", "attention")
_MLP_WORDS = ("mlp", "ffn", "feed_forward")


TargetError = BudgetError  # a target selection that names no matrix or an unknown kind


@dataclass(frozen=True)
class Target:
    """One compressible matrix: full module name, layer index, kind and short name."""

    name: str
    layer: int
    kind: str  # "attn" or "mlp"
    short: str  # e.g. "q_proj", "down_proj", "c_attn"
    module: nn.Module
    transposed: bool

    @property
    def shape(self) -> tuple[int, int]:
        w = self.module.weight
        return (w.shape[1], w.shape[0]) if self.transposed else (w.shape[0], w.shape[1])

    @property
    def n_params(self) -> int:
        return int(self.module.weight.numel())

    def get(self, on_layer: bool = False) -> torch.Tensor:
        """The weight as ``[out, in]`` on CPU: a view of it there (transposed for Conv1D), a copy
        where a device map put the layer on another device. Compression computes on CPU one
        matrix at a time, so its result does not depend on where the layers live; ``on_layer``:
        a view on the layer's own device instead (GPTQ/SparseGPT's ``solve_on: layer``)."""
        w = self.module.weight.data if on_layer else self.module.weight.data.cpu()
        return w.t() if self.transposed else w

    def set(self, w: torch.Tensor) -> None:
        """Write an ``[out, in]`` weight back in place (on the weight's own device), in the module's dtype."""
        dst = self.module.weight.data
        dst.copy_((w.t() if self.transposed else w).to(dst.dtype))


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _classify(path: str) -> str | None:
    head = path.split(".")[0].lower()
    if any(w in head for w in _ATTN_WORDS):
        return "attn"
    if any(w in head for w in _MLP_WORDS):
        return "mlp"
    return None


def parse_kinds(targets: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"attn,mlp"`` or a list -> validated tuple of kinds (default: both)."""
    if targets is None:
        return KINDS
    items = [t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets) if t.strip()]
    bad = [t for t in items if t not in KINDS]
    if bad or not items:
        raise TargetError(f"unknown target kind {', '.join(bad) or '(none)'}: valid targets are attn, mlp")
    return tuple(dict.fromkeys(items))


def _block_modules(model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """(layer, path inside its decoder block, module) of every module of every decoder block, in layer order: the
    one walk :func:`find_targets` reads both the experts and the targets from."""
    blocks = unwrap(model).get_submodule(arch_spec(model).layers)
    return [(i, path, module) for i, block in enumerate(blocks) for path, module in block.named_modules()]


def _holds_experts(modules: Iterable[tuple[int, str, nn.Module]]) -> bool:
    return any(path.rsplit(".", 1)[-1] == "experts" for _, path, _ in modules)


def has_experts(model: nn.Module) -> bool:
    """Whether a decoder block holds an ``experts`` module (a mixture-of-experts MLP)."""
    return _holds_experts(_block_modules(model))


def find_targets(model: nn.Module, kinds: str | Iterable[str] | None = None) -> list[Target]:
    """Every linear layer of every decoder block whose kind is in ``kinds``, in layer order.

    A mixture-of-experts model's MLP is refused (:func:`~capsense.core.arch.check_compress_kinds`). The blocks'
    modules are walked once (round 19 walked them for the experts, then for the targets)."""
    wanted = parse_kinds(kinds if kinds is None or isinstance(kinds, str) else list(kinds))
    layers = arch_spec(model).layers
    modules = _block_modules(model)
    check_compress_kinds(getattr(unwrap(model).config, "model_type", None), wanted, _holds_experts(modules))
    out: list[Target] = []
    for i, path, module in modules:
        if not path or not _is_linear(module):
            continue
        kind = _classify(path)
        if kind in wanted:
            out.append(Target(f"{layers}.{i}.{path}", i, kind, path.split(".")[-1], module,
                              type(module).__name__ == "Conv1D"))
    if not out:
        raise TargetError(f"no {'/'.join(wanted)} linear layers found in the decoder blocks of this model")
    return out


def check_moe_config(model_name: str, kinds: Sequence[str], revision: str | None = None) -> None:
    """Refuse MLP targets on a mixture-of-experts model from its local ``config.json`` (at ``revision``, of a Hub
    model), before the weights load; where that config is not on this machine yet, :func:`find_targets` refuses after
    loading."""
    from capsense.core.model_config import local_text_config

    check_compress_kinds((local_text_config(model_name, revision) or {}).get("model_type"), kinds)


def snapshot(targets: Iterable[Target]) -> dict[str, torch.Tensor]:
    """A copy of every target's weight, by name, in CPU memory wherever the layer lives (:meth:`Target.get`): what
    :func:`restore` puts back. A grid on a GPU so keeps its originals beside the model, not on the device."""
    return {t.name: t.get().detach().clone() for t in targets}


def restore(targets: Iterable[Target], weights: dict[str, torch.Tensor]) -> None:
    """Set every target's weight to its copy in ``weights`` (from :func:`snapshot`)."""
    with torch.no_grad():
        for t in targets:
            t.set(weights[t.name])


def out_projection_name(model: nn.Module, layer: int) -> str:
    """Full module name of layer ``layer``'s attention output projection."""
    spec = arch_spec(model)
    return f"{spec.layers}.{layer}.{spec.out_proj}"

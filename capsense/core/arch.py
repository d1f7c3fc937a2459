"""Where each supported architecture keeps its layers and attention output projection.

Every supported model feeds the concatenated per-head attention outputs into one
projection (``o_proj``, ``dense`` or ``c_proj``); head ``h`` owns the input slice
``[h * head_dim, (h + 1) * head_dim)`` of that projection. Under grouped-query
attention the unit is the query head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from capsense.errors import CapsenseError

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class ArchSpec:
    """How to reach the attention output projection of one architecture family."""

    name: str
    layers: str  # dotted path from the causal-LM module to the ModuleList of blocks
    out_proj: str  # dotted path from a block to the attention output projection
    transposed: bool = False  # GPT-2's Conv1D stores its weight as [in, out]


_LLAMA_LIKE = ArchSpec("llama-like", "model.layers", "self_attn.o_proj")

ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gemma2": _LLAMA_LIKE,
    "gemma3_text": _LLAMA_LIKE,
    "gemma3": ArchSpec("gemma3", "model.language_model.layers", "self_attn.o_proj"),
    "phi3": _LLAMA_LIKE,
    "olmo2": _LLAMA_LIKE,
    "gpt_neox": ArchSpec("gpt_neox", "gpt_neox.layers", "attention.dense"),
    "gpt2": ArchSpec("gpt2", "transformer.h", "attn.c_proj", transposed=True),
}


def unwrap(model: nn.Module) -> nn.Module:
    """Return the underlying transformers model of a PEFT or otherwise wrapped model."""
    while hasattr(model, "get_base_model") and model.get_base_model() is not model:
        model = model.get_base_model()
    return model


def arch_spec(model: nn.Module) -> ArchSpec:
    """The :class:`ArchSpec` for ``model``; a clear error for an unknown architecture."""
    model_type = getattr(getattr(unwrap(model), "config", None), "model_type", None)
    if model_type not in ARCHITECTURES:
        raise CapsenseError(
            f"unsupported architecture {model_type!r}: capsense supports "
            f"{', '.join(sorted(ARCHITECTURES))}. To add one, map its config.model_type to "
            "the path of its decoder blocks and of the attention output projection in "
            "capsense/core/arch.py:ARCHITECTURES."
        )
    return ARCHITECTURES[model_type]


@dataclass(frozen=True)
class HeadLayout:
    """Shape of a model's attention heads: ``n_layers`` x ``n_heads``, each ``head_dim`` wide."""

    n_layers: int
    n_heads: int
    head_dim: int

    @property
    def n_total(self) -> int:
        return self.n_layers * self.n_heads


def out_projections(model: nn.Module) -> list[nn.Module]:
    """The attention output projection of every layer, in layer order."""
    spec = arch_spec(model)
    base = unwrap(model)
    layers = base.get_submodule(spec.layers)
    return [layer.get_submodule(spec.out_proj) for layer in layers]


def base_layer(module: nn.Module) -> nn.Module:
    """The plain layer under PEFT wrappers (``base_layer``), or ``module`` itself."""
    while hasattr(module, "base_layer"):
        module = module.base_layer
    return module


def projection_weight(module: nn.Module) -> "nn.Parameter":
    """The weight of an output projection, unwrapping PEFT layers (``base_layer``)."""
    return base_layer(module).weight


def head_layout(model: nn.Module) -> HeadLayout:
    """Read the head layout from the model's config and its output projection's width."""
    base = unwrap(model)
    config = base.config
    config = getattr(config, "text_config", None) or config
    n_heads = int(config.num_attention_heads)
    projections = out_projections(base)
    weight = projection_weight(projections[0])
    in_features = weight.shape[0] if arch_spec(base).transposed else weight.shape[1]
    if in_features % n_heads:
        raise CapsenseError(
            f"output projection input width {in_features} is not divisible by "
            f"{n_heads} attention heads"
        )
    return HeadLayout(len(projections), n_heads, in_features // n_heads)

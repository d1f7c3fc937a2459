"""Where each supported architecture keeps its layers and attention output projection.

Every supported model feeds the concatenated per-head attention outputs into one
projection (``o_proj``, ``dense`` or ``c_proj``); head ``h`` owns the input slice
``[h * head_dim, (h + 1) * head_dim)`` of that projection. Under grouped-query
attention the unit is the query head.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import TYPE_CHECKING
from capsense.errors import BudgetError, CapsenseError

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

#: Dense families laid out as Llama: ``model.layers[i].self_attn.o_proj``.
_DENSE_LLAMA_LIKE = (
    "llama", "mistral", "ministral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo", "olmo2",
    "olmo3", "granite", "starcoder2", "cohere", "cohere2", "glm", "glm4", "smollm3", "helium", "exaone4",
    "seed_oss", "arcee", "ernie4_5", "internlm3", "stablelm", "nemotron", "hunyuan_v1_dense", "apertus",
)
#: Mixture-of-experts families laid out as Llama (attention as above, experts in the MLP).
MOE_FAMILIES = (
    "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared", "glm4_moe", "phimoe",
    "ernie4_5_moe", "hunyuan_v1_moe", "gpt_oss",
)

ARCHITECTURES: dict[str, ArchSpec] = {
    **dict.fromkeys(_DENSE_LLAMA_LIKE + MOE_FAMILIES, _LLAMA_LIKE),
    "gemma3": ArchSpec("gemma3", "model.language_model.layers", "self_attn.o_proj"),
    "phi": ArchSpec("phi", "model.layers", "self_attn.dense"),
    "gpt_neox": ArchSpec("gpt_neox", "gpt_neox.layers", "attention.dense"),
    "gpt2": ArchSpec("gpt2", "transformer.h", "attn.c_proj", transposed=True),
}

_MLA = (
    "multi-head latent attention: queries, keys and values come from low-rank latent projections "
    "shared by all heads (q_a_proj/q_b_proj, kv_a_proj_with_mqa/kv_b_proj), with a value width "
    "different from the query/key width, so there is no per-head q/k/v layout for capsense to edit"
)
_HYBRID = (
    "a hybrid model: some decoder layers have no softmax attention (state-space or linear-attention "
    "layers), so not every layer has heads"
)
#: Families known not to fit, with the reason (the error says it instead of the generic one).
UNSUPPORTED: dict[str, str] = {
    **dict.fromkeys(("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "minicpm3", "sarvam_mla"), _MLA),
    **dict.fromkeys(
        ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "granitemoehybrid", "jamba",
         "bamba", "falcon_h1", "zamba", "zamba2", "nemotron_h", "lfm2", "lfm2_moe", "kimi_linear", "olmo_hybrid"),
        _HYBRID,
    ),
    "falcon": (
        "Falcon fuses q, k and v into one query_key_value projection whose row layout depends on "
        "multi_query / new_decoder_architecture, and runs attention and MLP in parallel; not verified"
    ),
    "dbrx": "DBRX fuses q, k and v into one Wqkv projection and keeps its blocks under transformer.blocks; not verified",
}


def check_compress_kinds(model_type: str | None, kinds: Sequence[str], has_experts: bool = False) -> None:
    """Refuse compressing the MLP of a mixture-of-experts model (``model_type`` in
    :data:`MOE_FAMILIES`, or ``has_experts``: a decoder block holds an ``experts`` module).

    transformers 5 stores the experts' weights as fused 3-D tensors (``experts.gate_up_proj``,
    ``experts.down_proj``), not the linear layers compression acts on: an MLP target set would hold
    only the router and the shared experts, a silent and misleading compression. Attention
    projections are plain linear layers there, compressed as in a dense model.
    """
    if "mlp" in kinds and (has_experts or model_type in MOE_FAMILIES):
        raise BudgetError(
            f"compressing the MLP of a mixture-of-experts model ({model_type}) is not supported: its experts' "
            "weights are fused 3-D tensors (experts.gate_up_proj, experts.down_proj), not the linear layers "
            "compression acts on. Valid: `targets` attn (the attention projections; the experts stay as they are)"
        )


def unwrap(model: nn.Module) -> nn.Module:
    """Return the underlying transformers model of a PEFT or otherwise wrapped model."""
    while hasattr(model, "get_base_model") and model.get_base_model() is not model:
        model = model.get_base_model()
    return model


def arch_spec(model: nn.Module) -> ArchSpec:
    """The :class:`ArchSpec` for ``model``; a clear error for an unknown architecture."""
    model_type = getattr(getattr(unwrap(model), "config", None), "model_type", None)
    if model_type in UNSUPPORTED:
        raise CapsenseError(
            f"unsupported architecture {model_type!r}: {UNSUPPORTED[model_type]}. Head ablation needs an "
            "attention output projection whose input is the concatenation of per-query-head outputs; "
            f"capsense supports {', '.join(sorted(ARCHITECTURES))}."
        )
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

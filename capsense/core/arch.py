"""Where each supported architecture keeps its layers and attention output projection.

Every supported model feeds the concatenated per-head attention outputs into one
projection (``o_proj``, ``dense`` or ``c_proj``); head ``h`` owns the input slice
``[h * head_dim, (h + 1) * head_dim)`` of that projection. Under grouped-query
attention the unit is the query head.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
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
    """Shape of a model's attention heads: ``n_layers`` x ``n_heads``, each ``head_dim`` wide (0: not known, a layout
    read from a config before the load). ``n_kv_heads`` and ``family`` (the config's ``model_type``) tell apart models
    of one shape, where known (None: not known); they are not part of equality."""

    n_layers: int
    n_heads: int
    head_dim: int
    n_kv_heads: int | None = field(default=None, compare=False)
    family: str | None = field(default=None, compare=False)

    @property
    def n_total(self) -> int:
        return self.n_layers * self.n_heads

    def differences(self, other: HeadLayout) -> list[str]:
        """What tells ``other`` apart from this layout, among what both know: ``[]`` where nothing does.

        Why more than layers x heads: models of one family and size share it (Llama 2 7B, Llama 3 8B and Mistral 7B
        are all 32 x 32 heads, 128 wide); their key/value heads (32, 8, 8) and ``model_type`` (llama, llama,
        mistral) tell them apart, and a fine-tuned variant keeps all of it. The vocabulary is left out: fine-tunes
        add tokens."""
        pairs = (("layers x heads", (self.n_layers, self.n_heads), (other.n_layers, other.n_heads)),
                 ("head width", self.head_dim or None, other.head_dim or None),
                 ("key/value heads", self.n_kv_heads, other.n_kv_heads), ("model type", self.family, other.family))
        return [name for name, a, b in pairs if a is not None and b is not None and a != b]

    def describe(self) -> str:
        """``a llama model of 30 layers x 9 heads (3 key/value heads, 64 wide)``, with what is known."""
        extra = [f"{self.n_kv_heads} key/value heads" if self.n_kv_heads else "", f"{self.head_dim} wide" if self.head_dim else ""]
        extra_text = ", ".join(e for e in extra if e)
        return (f"a {self.family + ' ' if self.family else ''}model of {self.n_layers} layers x {self.n_heads} heads"
                + (f" ({extra_text})" if extra_text else ""))

    def to_dict(self) -> dict[str, Any]:
        """The layout a run records (``manifest.json``, ``heads.json``); :meth:`from_dict` reads it back."""
        return {"n_layers": self.n_layers, "n_heads": self.n_heads, "head_dim": self.head_dim,
                "n_kv_heads": self.n_kv_heads, "model_type": self.family}

    @staticmethod
    def from_dict(layout: Any) -> HeadLayout | None:
        """The layout a file records, or None where it records no valid layers x heads (older files lack the rest)."""
        if not isinstance(layout, dict):
            return None
        def number(key: str) -> int | None:
            x = layout.get(key)
            return x if isinstance(x, int) and not isinstance(x, bool) and x > 0 else None
        if number("n_layers") is None or number("n_heads") is None:
            return None
        family = layout.get("model_type")
        return HeadLayout(number("n_layers"), number("n_heads"), number("head_dim") or 0, number("n_kv_heads"),
                          family if isinstance(family, str) and family else None)


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
    kv = getattr(config, "num_key_value_heads", None)
    family = getattr(config, "model_type", None)
    return HeadLayout(len(projections), n_heads, in_features // n_heads, int(kv) if isinstance(kv, int) else n_heads,
                      family if isinstance(family, str) and family else None)

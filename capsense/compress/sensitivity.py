"""Gradient sensitivity of a capability: the diagonal empirical Fisher of its loss per weight.

One backward pass per calibration text of the capability (its *last* documents, disjoint
from the probe documents that measure it) gives ``g = d loss / d W``; summing ``g^2`` over
texts estimates the Fisher diagonal ``F``. A change ``dW`` then costs about
``1/2 sum F dW^2`` nats (second order; the first-order term vanishes on average at a
trained optimum). :func:`head_scores` reads the same estimate per attention head: the cost
of zeroing the head's query rows (in ``q_proj`` or a fused qkv projection: GPT-2, GPT-NeoX,
Phi-3; scoring ``q_proj`` alone left those models scored by their output columns) and its
output-projection columns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from capsense.compress.protect import query_row_start
from capsense.compress.targets import Target, out_projection_name
from capsense.core.memory import return_freed_memory
from capsense.core.placement import input_device

#: Tokens of each text the Fisher is summed over (its calibration texts are cut there; one text per backward pass).
FISHER_MAX_TOKENS = 256


def fisher_diagonal(
    model: nn.Module,
    targets: Sequence[Target],
    samples: Sequence[Sequence[int]],
    progress: Callable[[int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Sum over ``samples`` (token id lists) of the squared gradient of each target weight, ``[out, in]``.

    Each weight's gradient is squared into its sum as soon as the backward pass has accumulated it and
    then dropped (a post-accumulate-grad hook), so the gradients of all targets are never held at once
    beside the sums (they were: 4 more bytes per target weight at float32, e.g. 26 GiB on Llama-3.1-8B);
    the same operations on the same gradients, so the same sums bit for bit."""
    params = list(model.parameters())
    was = [p.requires_grad for p in params]
    fisher = {t.name: torch.zeros(t.shape, dtype=torch.float32) for t in targets}
    device = input_device(model)
    hooks = []

    def fold(t: Target) -> Callable[[torch.Tensor], None]:
        def hook(w: torch.Tensor) -> None:
            g = w.grad.t() if t.transposed else w.grad
            fisher[t.name] += g.detach().float().pow(2).cpu()
            w.grad = None
        return hook

    try:
        for p in params:
            p.requires_grad_(False)
        for t in targets:
            t.module.weight.requires_grad_(True)
            hooks.append(t.module.weight.register_post_accumulate_grad_hook(fold(t)))
        for ids in samples:
            x = torch.tensor([list(ids)], device=device)
            model.zero_grad(set_to_none=True)
            model(input_ids=x, labels=x, use_cache=False).loss.backward()
            return_freed_memory()  # the pass's activations and logits: freed, handed back (capsense.core.memory)
            if progress:
                progress(1)
    finally:
        for h in hooks:
            h.remove()
        model.zero_grad(set_to_none=True)
        for p, w in zip(params, was):
            p.requires_grad_(w)
    return fisher


def backward_memory(model: nn.Module, tokens: int = FISHER_MAX_TOKENS, layers: Sequence[int] | None = None) -> dict[str, int]:
    """The bytes one of :func:`fisher_diagonal`'s passes (one text of ``tokens`` tokens, batch 1, only target
    weights needing gradients; ``layers``: the decoder layers whose target weights do, default all, one of
    ``fisher_groups``' runs) holds at its most beside the weights and the Fisher sums, by what they are.

    Counted from the model's shapes (hidden ``H``, MLP ``I``, ``n`` query and ``k`` key/value heads of width ``d``,
    vocabulary ``V``, ``L`` decoder layers; ``e`` bytes per value in the model's dtype), what autograd saves for the
    backward pass of a Llama- or Gemma-like pre-norm block, per token and decoder layer:

    * each norm of the block (2: Llama; 4: Gemma 2/3): its float32 input and reciprocal RMS, ``4 (H + 1)``
      (the first counted layer's input norm saves nothing, its input needs no gradient, but the final norm
      does: the norms per block x the layers counted, in all);
    * the inputs of the matrices whose weight gradients are taken: the attention's and the MLP's (``2 H e``)
      and the down projection's (``I e``), in ``layers`` only (every target of them counted; with
      ``--targets`` attn or mlp an upper bound). Layers before the first of ``layers`` save nothing (no
      gradient flows there); those after it save the rest, which the gradient passes through;
    * the attention kernel's: SDPA (the default; flash-style kernels) saves the rotated queries and keys, the
      values, its output (the output projection's input, the same tensor) and a float32 log-sum-exp per head,
      ``(2 n d + 2 k d) e + 4 n``; eager attention the queries, the keys and values repeated to every query
      head and the softmax, ``3 n d e + n T (4 + e)`` (``4 n T`` in float32: one copy), plus the soft-capped
      scores (``n T e``) where scores are soft-capped, and in ``layers`` the output projection's input (a copy,
      ``n d e``);
    * query/key norms (Gemma 3, Qwen3, OLMo 2): ``4 (n + k) (d + 1)``;
    * a gated MLP's gate and up outputs and the activation (``3 I e``; ungated: the activation's input, ``I e``).

    Once per pass: the rotary tables, ``2 T d e`` each; the float32 log-softmax over the vocabulary the loss
    reads (``4 T V``; a soft-capped head's ``tanh`` output too, ``T V e``) and the labels. At its most, where
    the backward starts, the gradients of the log-probabilities and of the logits (float32, ``2 x 4 T V``)
    are live beside all that; later backward steps hold one layer's gradients, less (the weight gradients are
    counted by the caller). Checked against the saved tensors' bytes (``torch.autograd.graph.saved_tensors_hooks``,
    deduplicated by storage) on tiny Llama and Gemma 3, SDPA and eager, float32 and bfloat16
    (tests/unit/compress/test_compress_backward_memory.py); per-layer vectors (Gemma's ``1 + weight``) are
    not counted. Fewer ``tokens`` lowers every part in proportion (eager attention's scores quadratically)."""
    b = _block(model)
    h, inter, n, k, d, vocab, e, t = b.hidden, b.inter, b.heads, b.kv_heads, b.head_dim, b.vocab, b.element, tokens
    if b.eager:
        attention = 3 * n * d * e + n * t * (4 + (e if e != 4 else 0)) + (n * t * e if b.capped_scores else 0)
    else:
        attention = (2 * n * d + 2 * k * d) * e + 4 * n
    per_layer = t * (b.norms * 4 * (h + 1) + attention + (4 * (n + k) * (d + 1) if b.qk_norm else 0)
                     + (3 if b.gated else 1) * inter * e)
    grads = sorted(set(range(b.layers) if layers is None else layers))
    counted = b.layers - grads[0]
    inputs = (2 * h + inter + (n * d if b.eager else 0)) * e  # eager: the output projection's input is a copy of its own
    saved = counted * per_layer + len(grads) * t * inputs + b.rotary * 2 * t * d * e
    return {f"backward pass: saved activations ({counted} layers x {t} tokens)": saved,
            f"backward pass: log-softmax ({t} tokens x {vocab} vocabulary)": t * vocab * (4 + (e if b.capped_logits else 0))
            + 8 * (t + 1), "backward pass: logit gradients": 2 * 4 * t * vocab}


@dataclass(frozen=True)
class _Block:
    """What :func:`backward_memory` reads of a model: its shapes, its dtype's bytes and its block's parts."""

    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    element: int
    norms: int  # norm modules per decoder layer (2: Llama; 4: Gemma 2/3)
    gated: bool  # a gated MLP (gate and up projections)
    qk_norm: bool  # query/key norms
    eager: bool  # eager attention (the softmax saved), else SDPA or flash
    capped_scores: bool
    capped_logits: bool
    rotary: int  # rotary tables (Gemma 3: local and global)


def _block(model: nn.Module) -> _Block:
    """``model``'s :class:`_Block`: its text config, first decoder layer and output head (a meta-device model
    will do: nothing runs)."""
    from capsense.core.arch import arch_spec, head_layout, unwrap

    base = unwrap(model)
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    decoder = base.get_submodule(arch_spec(base).layers)
    layout = head_layout(base)
    h = int(config.hidden_size)
    names = [name.rsplit(".", 1)[-1] for name, _ in decoder[0].named_modules()]
    return _Block(
        hidden=h, inter=int(getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h),
        heads=layout.n_heads, kv_heads=int(getattr(config, "num_key_value_heads", None) or layout.n_heads),
        head_dim=layout.head_dim, vocab=int(base.get_output_embeddings().weight.shape[0]), layers=len(decoder),
        element=next(base.parameters()).element_size(),
        norms=sum("norm" in type(m).__name__.lower() for _, m in decoder[0].named_children()),
        gated=any(name in ("gate_proj", "gate_up_proj") for name in names), qk_norm="q_norm" in names,
        eager=getattr(config, "_attn_implementation", None) == "eager",
        capped_scores=bool(getattr(config, "attn_logit_softcapping", None)),
        capped_logits=bool(getattr(config, "final_logit_softcapping", None)),
        rotary=sum("rotary" in type(m).__name__.lower() for m in base.modules()))


def head_scores(model: nn.Module, targets: Sequence[Target], fisher: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[layers, heads]``: ``sum F W^2`` over each head's query rows and output-projection columns."""
    from capsense.core.arch import head_layout

    layout = head_layout(model)
    scores = torch.zeros(layout.n_layers, layout.n_heads, dtype=torch.float64)
    hd = layout.head_dim
    for t in targets:
        if t.name not in fisher:
            continue
        imp = (fisher[t.name] * t.get().detach().float().cpu().pow(2)).double()
        if t.name == out_projection_name(model, t.layer):
            scores[t.layer] += imp.sum(0).view(layout.n_heads, hd).sum(1)
        elif query_row_start(t.short, 0, hd) is not None:  # q_proj, or a fused qkv projection's query rows
            rows = imp.sum(1)
            for h in range(layout.n_heads):
                start = query_row_start(t.short, h, hd)
                scores[t.layer, h] += rows[start : start + hd].sum()
    return scores


def top_heads(scores: torch.Tensor, k: int):
    """The ``k`` highest-scoring heads as a :class:`~capsense.core.heads.HeadSet`, best first."""
    from capsense.core.heads import Head, HeadSet

    order = torch.argsort(scores.reshape(-1), descending=True)[:k]
    return HeadSet(tuple(Head.from_index(int(i), scores.shape[1]) for i in order))

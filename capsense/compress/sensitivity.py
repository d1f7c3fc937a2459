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

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from capsense.compress.protect import query_row_start
from capsense.compress.targets import Target, out_projection_name
from capsense.core.memory import return_freed_memory
from capsense.core.placement import input_device, text_config
from capsense.errors import CapsenseError

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

    What autograd saves for the backward pass is traced, not modelled from shapes: a twin of ``model`` is built
    on the meta device from its config (no weights, no memory: a meta-device model will do) with the model's
    dtypes, attention (flash-attention and flex kernels as SDPA: they save the same) and experts
    implementations, its target weights in ``layers`` set to need gradients as the Fisher sets them (every
    target: with ``--targets`` attn or mlp an upper bound; on a mixture of experts the attention's, the only
    ones compressed there), and one forward pass of ``tokens`` tokens with its labels runs
    under ``torch.autograd.graph.saved_tensors_hooks``: every tensor it saves counts once per storage, weights
    left out, if the storage is still held when the forward ends. So each family's block counts as it runs, with
    no rule per family: RMS norms (float32 input and reciprocal RMS; Gemma's ``1 + weight``) or layer norms
    (input, mean, rstd), fused or separate q/k/v (a fused output is kept whole by the value view SDPA saves),
    partial rotary, q/k norms per head or over all heads, parallel attention and MLP (GPT-NeoX, Phi, Cohere),
    gated or GELU MLPs (GPT-2's ``gelu_new`` saves four tensors of the MLP's width), soft-capping, a mixture of
    experts' router and its experts' activations for the ``tokens x top_k`` routed pairs. Layers before the first
    of ``layers`` save nothing (no gradient flows there). What cannot run on the meta device as it runs on the
    model's is stood in for by what it saves (:func:`_meta_stand_ins`): SDPA (the meta device would take its
    math path, which keeps the score matrix) by the fused kernel CPU runs (queries, keys, values, output and a
    float32 log-sum-exp per head and query; CUDA's flash and memory-efficient kernels save the same and two
    scalar seeds), the experts' grouped product by its offsets and, where the weights need gradients, its input;
    transformers' two steps that read values (packed-sequence detection, the padding warning) are skipped, and
    experts run one by one (``eager``, which reads the routing) are traced grouped, plus at most what the loop
    saves more (:func:`_looped_experts_margin`). A forward that still reads values (remote code) is refused with
    a :class:`~capsense.errors.CapsenseError`, not counted.

    Checked against the bytes the real pass saves on CPU (tests/unit/compress/test_compress_backward_memory.py:
    every supported dense and mixture-of-experts family, SDPA and eager, float32 and bfloat16, tiny configs):
    equal to the byte in float32; over by up to 0.5% in bfloat16 where layer norms run on CPU (it keeps their
    mean and rstd in bfloat16, the trace in float32 as CUDA does); experts run one by one over by 0.2-0.5%.

    The count's parts: what the decoder saves, and what the output head and the loss save (the float32
    log-softmax over the vocabulary the loss reads, a soft-capped head's ``tanh`` output, the labels). At its
    most, where the backward starts, the gradients of the log-probabilities and of the logits (float32,
    ``2 x 4 T V``) are live beside all that; later backward steps hold one layer's gradients, less (the weight
    gradients are counted by the caller). Fewer ``tokens`` lowers every part in proportion (eager attention's
    scores quadratically)."""
    from capsense.core.arch import arch_spec, unwrap

    base = unwrap(model)
    counted = len(base.get_submodule(arch_spec(base).layers)) - (min(layers) if layers else 0)
    # no text (a run that sums no Fisher: fisher_tokens 0) runs no pass to trace, and saves nothing
    decoder, head = _traced_pass(base, tokens, layers) if tokens > 0 else (0, 0)
    decoder += _looped_experts_margin(base, tokens, layers)
    vocab = int(base.get_output_embeddings().weight.shape[0])
    return {f"backward pass: saved activations ({counted} layers x {tokens} tokens)": decoder,
            f"backward pass: log-softmax ({tokens} tokens x {vocab} vocabulary)": head,
            "backward pass: logit gradients": 2 * 4 * tokens * vocab}


#: transformers' experts implementations traced as they run (the grouped product by :class:`_GroupedMm`); any
#: other (the per-expert loop, ``eager``; kernels) is traced as ``grouped_mm`` plus :func:`_looped_experts_margin`.
_TRACED_EXPERTS = ("grouped_mm", "batched_mm")


def _mixture_of_experts(base: nn.Module) -> bool:
    """Whether ``base`` is a mixture of experts (a block holds an ``experts`` module, or its family is one): its
    Fisher reads the attention's targets only, its experts run as ``config._experts_implementation`` says."""
    from capsense.compress.targets import has_experts
    from capsense.core.arch import MOE_FAMILIES

    return has_experts(base) or getattr(base.config, "model_type", None) in MOE_FAMILIES


def _looped_experts_margin(base: nn.Module, tokens: int, layers: Sequence[int] | None) -> int:
    """What a mixture of experts run expert by expert (transformers' ``eager`` experts: gather each expert's tokens,
    its MLP, weight, ``index_add_``) saves beyond the grouped product it is traced as: at most one more hidden
    vector per routed (token, expert) pair and decoder layer from the first of ``layers`` on (measured on every
    supported mixture-of-experts family, tiny configs, float32 and bfloat16: the count over what torch saves
    1.002-1.005). Zero for models run another way."""
    from capsense.core.arch import arch_spec

    if not _mixture_of_experts(base) or getattr(base.config, "_experts_implementation", None) in _TRACED_EXPERTS:
        return 0
    config = text_config(base)
    blocks = base.get_submodule(arch_spec(base).layers)
    first = min(layers) if layers else 0
    routed = sum(any(name.rsplit(".", 1)[-1] == "experts" for name, _ in block.named_modules()) for block in blocks[first:])
    return routed * tokens * int(config.num_experts_per_tok) * int(config.hidden_size) * next(base.parameters()).element_size()


def _traced_pass(base: nn.Module, tokens: int, layers: Sequence[int] | None) -> tuple[int, int]:
    """The bytes a Fisher pass of ``tokens`` tokens over ``base`` saves (see :func:`backward_memory`), traced on
    a meta-device twin: (saved before the output head, saved from it on)."""
    import copy

    from torch.multiprocessing.reductions import StorageWeakRef

    from capsense.compress.targets import find_targets

    config = copy.deepcopy(base.config)
    config.pad_token_id = None  # transformers' padding warning reads the ids' values
    moe = _mixture_of_experts(base)
    # the experts as the model runs them, but the per-expert loop as one grouped product (it reads the routing's
    # values; :func:`_looped_experts_margin` adds what the loop saves more)
    traced = getattr(config, "_experts_implementation", None) if moe else None
    experts = {"experts_implementation": traced if traced in _TRACED_EXPERTS else "grouped_mm"} if moe else {}
    attention = getattr(base.config, "_attn_implementation", None)
    if attention not in ("eager", "sdpa"):  # flash-attention and flex kernels save what SDPA's fused kernel saves
        attention = "sdpa" if getattr(type(base), "_supports_sdpa", False) else "eager"
    with torch.device("meta"):
        twin = type(base)._from_config(config, dtype=next(base.parameters()).dtype, attn_implementation=attention, **experts)
    dtypes = {name: t.dtype for name, t in [*base.named_parameters(), *base.named_buffers()]}
    with torch.no_grad():  # each tensor in its own dtype (a float32 router kept or cast is saved differently)
        for name, t in [*twin.named_parameters(), *twin.named_buffers()]:
            if dtypes.get(name, t.dtype) != t.dtype and dtypes[name].is_floating_point and t.is_floating_point():
                t.data = t.data.to(dtypes[name])
    twin.eval().requires_grad_(False)
    for t in find_targets(twin, "attn" if moe else None):
        if layers is None or t.layer in layers:
            t.module.weight.requires_grad_(True)
    weights = {StorageWeakRef(p.untyped_storage()).cdata for p in twin.parameters()}
    saved: dict[int, tuple[StorageWeakRef, int, bool]] = {}
    in_head = [False]

    def pack(x: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(x.untyped_storage())
        if ref.cdata not in weights and ref.cdata not in saved:
            saved[ref.cdata] = (ref, x.untyped_storage().nbytes(), in_head[0])
        return x

    hook = twin.get_output_embeddings().register_forward_pre_hook(lambda module, args: in_head.__setitem__(0, True))
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    try:
        with _meta_stand_ins(), torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            loss = twin(input_ids=ids, labels=ids, use_cache=False).loss
        held = [(n, h) for ref, n, h in saved.values() if not ref.expired()]
    except (RuntimeError, NotImplementedError) as e:  # a forward that reads values a meta tensor does not hold
        raise CapsenseError(
            f"cannot count the memory of a Fisher pass over this {type(base).__name__}: its forward does not run on "
            f"the meta device ({type(e).__name__}: {str(e).splitlines()[0]}). Please report it with the model's name."
        ) from e
    finally:
        hook.remove()
    del loss
    return sum(n for n, h in held if not h), sum(n for n, h in held if h)


class _GroupedMm(torch.autograd.Function):
    """Stands in for a mixture of experts' grouped matrix product on the meta device (torch's meta kernel takes
    bfloat16 only): the output's shape, and what torch's backward of it saves: the offsets, and the input where
    the weight needs a gradient (the weight itself is a weight, not counted)."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(offs, input if weight.requires_grad else None)
        return input.new_empty(input.shape[0], weight.shape[-1])


def _flash(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA as its fused CPU kernel runs it (grouped keys and values as they come; a boolean mask as the additive
    float mask SDPA makes of it), on any device: the meta device would take the math path."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(~attn_mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


@contextlib.contextmanager
def _meta_stand_ins():
    """While a meta-device twin's forward is traced: SDPA as its fused kernel (:func:`_flash`), the experts'
    grouped product as :class:`_GroupedMm`, transformers' packed-sequence detection (it reads the position ids'
    values) skipped; put back after."""
    import transformers.integrations.moe as moe
    import transformers.masking_utils as masking

    swaps = [(torch.nn.functional, "scaled_dot_product_attention", _flash),
             (moe, "_grouped_mm", lambda input, weight, offs: _GroupedMm.apply(input.to(weight.dtype), weight, offs)),
             (masking, "find_packed_sequence_indices", lambda position_ids: None)]
    before = [getattr(owner, name) for owner, name, _ in swaps]
    try:
        for owner, name, new in swaps:
            setattr(owner, name, new)
        yield
    finally:
        for (owner, name, _), old in zip(swaps, before):
            setattr(owner, name, old)


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

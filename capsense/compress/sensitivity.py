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

import torch
from torch import nn

from capsense.compress.protect import query_row_start
from capsense.compress.targets import Target, out_projection_name
from capsense.core.placement import input_device


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
            if progress:
                progress(1)
    finally:
        for h in hooks:
            h.remove()
        model.zero_grad(set_to_none=True)
        for p, w in zip(params, was):
            p.requires_grad_(w)
    return fisher


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

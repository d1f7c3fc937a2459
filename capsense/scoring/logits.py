"""From a causal LM's final hidden states to per-token scores: the last step every scorer shares.

``scored_hidden`` runs the decoder without the LM head (the head is applied only at the
positions a probe scores, which for a 49k-262k vocabulary is most of the cost of a full
logits tensor); ``output_logits`` applies the head there, in float32; ``token_scores`` turns
the logits into log-probabilities of the reference tokens and greedy hits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from capsense.core.precision import without_autocast

if TYPE_CHECKING:
    from torch import nn


def token_scores(model: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Log-probability of each target token and whether it is the greedy choice, from the
    final hidden states that predict it (``[n, d]``, ``[n]``)."""
    logits = output_logits(model, hidden)
    targets = targets.to(logits.device)  # under a device_map the LM head may sit on another device
    logp = torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None])[:, 0]
    return logp.cpu().double().numpy(), (logits.argmax(-1) == targets).cpu().numpy()


def scored_hidden(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Final hidden states of a causal LM, without computing logits for every position."""
    base = getattr(model, model.base_model_prefix)
    out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return out[0]


VOCAB_CHUNK = 16_384  # rows of the LM head cast to float32 at a time (bounds the copy on 100k+ vocabularies)

#: Float32 copies of CPU LM heads while a :func:`float32_head` block is open: id(head) -> (weight, bias).
_FLOAT32_HEADS: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}


@contextlib.contextmanager
def float32_head(model: nn.Module) -> Iterator[None]:
    """Within the block, :func:`output_logits` reuses one float32 copy of a CPU bfloat16/float16 LM
    head instead of casting it on every batch. Casting SmolLM2's 49k x 576 head per batch took 1.4 s
    of a 6.4 s single-head knockout (25 batches, one thread, ``cProfile``); with the copy made once
    per mask that knockout took 4.9 s. The block must not change the head's weights (a mask's
    evaluation does not). On a GPU the cast is a memory-bound copy of a few milliseconds and device
    memory is dearer, so nothing is kept there."""
    head = model.get_output_embeddings()
    w = getattr(head, "weight", None)
    if (not isinstance(head, torch.nn.Linear) or w.device.type != "cpu" or w.dtype not in (torch.bfloat16, torch.float16)
            or id(head) in _FLOAT32_HEADS):
        yield
        return
    _FLOAT32_HEADS[id(head)] = (w.detach().float(), None if head.bias is None else head.bias.detach().float())
    try:
        yield
    finally:
        del _FLOAT32_HEADS[id(head)]


#: Families whose causal-LM forward multiplies the head's logits by ``config.logit_scale``, or divides
#: them by ``config.logits_scaling`` (transformers 5 modelling code; keyed by family, as the attribute
#: names mean nothing elsewhere).
_SCALES_LOGITS = ("cohere", "cohere2")
_DIVIDES_LOGITS = ("granite", "granitemoe", "granitemoeshared")


def output_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head on selected hidden states, in float32, with what the model's own forward does
    after its head: Cohere's ``logit_scale`` (times), Granite's ``logits_scaling`` (divided by),
    Gemma's final logit soft-capping. Without them a Cohere model's scores were those of logits 16x
    too large (``logit_scale`` 0.0625).

    A bfloat16 model's logits come out rounded to 8 bits of mantissa: a logit of 20 moves in
    steps of 0.125 nats, far coarser than the 1% nll differences that separate heads. Only the
    scored positions reach the head, so computing it in float32 costs little beside the blocks,
    which stay in the model's dtype: the head's weight is cast a chunk of rows at a time, or taken
    from the copy a :func:`float32_head` block keeps. Under autocast (:mod:`capsense.core.precision`) the
    head runs outside it, in float32, for the same reason.
    """
    with without_autocast(hidden.device.type):
        return _output_logits(model, hidden)


def _output_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    head = model.get_output_embeddings()
    if hidden.dtype in (torch.bfloat16, torch.float16) and isinstance(head, torch.nn.Linear):
        w, b = head.weight, head.bias
        x = hidden.to(device=w.device, dtype=torch.float32)
        kept = _FLOAT32_HEADS.get(id(head))
        if kept is not None and not (torch.is_grad_enabled() and w.requires_grad):
            logits = torch.nn.functional.linear(x, *kept)
        else:
            logits = torch.cat([
                torch.nn.functional.linear(x, w[i : i + VOCAB_CHUNK].float(), None if b is None else b[i : i + VOCAB_CHUNK].float())
                for i in range(0, w.shape[0], VOCAB_CHUNK)
            ], dim=-1)
    else:
        logits = head(hidden)
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind in _SCALES_LOGITS:
        logits = logits * config.logit_scale
    elif kind in _DIVIDES_LOGITS:
        logits = logits / config.logits_scaling
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits

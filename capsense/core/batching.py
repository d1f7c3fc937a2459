"""How many requests go in one forward pass: a number, or ``auto`` sized from the device's free memory.

``batch_size`` (``--batch-size``) is a positive integer or ``auto`` (:func:`check_batch_size`, the one check of the
value, run before any model loads). ``auto`` resolves once the model is placed:

* **on a CPU: 16** (:data:`CPU_BATCH_SIZE`, the long-standing default). A CPU is compute-bound at 16 requests of
  a few hundred tokens: round 26's profile of the main job spent 85 of 137 s inside ``linear`` at this CPU's
  bf16 rate (RESULTS-locate.md), so a larger batch has nothing idle to fill and pads more;
* **on a GPU:** the most requests whose activations fit in a share of the device's free memory
  (:func:`rows_that_fit`, arithmetic from the config, never a trial forward that may run out of memory), at
  most :data:`MAX_AUTO_BATCH_SIZE` and at most the requests there are. Round 24 measured, on one H200, the
  1B-shaped main job at 0.26-0.54 s per mask in batches of 16 (latency-bound: 10 tasks of 24 short documents),
  against 62% of the GPU's bf16 rate for 16 requests of 512 tokens at 8B: small models and short requests are
  where a larger batch pays. The gain is not measured yet (``recipes/bench/bench_gpu.py --batch-sizes``).

A gradient pass (attribution) keeps every layer's activations for the backward pass, so it resolves its own,
smaller, batch (:func:`~capsense.core.placement.auto_batch_size` with ``backward=True``). lm-eval's own
``batch_size=auto`` (a forward at 64 requests, halved on each out-of-memory error) is what validation hands
lm-eval on a GPU (:func:`lm_eval_batch_size`); on a CPU that trial would not fail but swap, so validation uses 16
there too.

Scores do not depend on the batch beyond float rounding (padding is masked); a run records the batch it
resolved (``batch_size_resolved`` in locate's manifest), and a resumed run may resolve another.
"""

from __future__ import annotations

from typing import Any

from capsense.errors import CapsenseError

AUTO = "auto"
CPU_BATCH_SIZE = 16
MAX_AUTO_BATCH_SIZE = 256
#: Share of a GPU's free memory ``auto`` fills with one batch's activations (the rest: the prefix cache, which
#: may take half, and the allocator's slack).
AUTO_MEMORY_FRACTION = 0.25


def check_batch_size(value: Any, name: str = "`batch_size`") -> int | str:
    """``value`` as a batch size: a positive int, or :data:`AUTO`; anything else is refused naming what is valid.
    Strings of digits (a recipe, a ``--model_args`` value) become ints."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CapsenseError(f"{name} must be a positive number of requests per forward pass or `auto` (sized from "
                            f"the GPU's free memory; {CPU_BATCH_SIZE} on a CPU), got {value!r}")
    return value


def config_int(config, *names: str) -> int:
    """The first of ``names`` that ``config`` sets (families spell sizes differently), else 0."""
    return next((int(getattr(config, n)) for n in names if getattr(config, n, None)), 0)


def row_bytes(config, longest: int, dtype_bytes: int = 2, scored: int = 0, backward: bool = False) -> int:
    """Estimated peak bytes one request of ``longest`` tokens adds to a forward pass (``backward``: a gradient
    pass, which keeps every layer's activations), ``scored`` of its tokens scored by the LM head in float32.

    The peak layer holds the residual stream, q/k/v/o, the MLP's activations and (eager attention) the score
    matrix, twice over for temporaries; a backward pass keeps about one such set per layer, and the scored
    positions' float32 logits, their log-softmax and (backward) its gradient. An estimate for planning, with
    room in :data:`AUTO_MEMORY_FRACTION`, not a measurement."""
    hidden = config_int(config, "hidden_size", "n_embd")
    inter = config_int(config, "intermediate_size", "n_inner") or 4 * hidden
    heads = config_int(config, "num_attention_heads", "n_head")
    vocab = config_int(config, "vocab_size")
    layer = longest * dtype_bytes * (6 * hidden + 3 * inter + heads * longest)
    kept = layer * config_int(config, "num_hidden_layers", "n_layer") if backward else 0
    logits = scored * vocab * 4 * (3 if backward else 2)
    return 2 * layer + kept + logits


def rows_that_fit(config, longest: int, budget_bytes: float, dtype_bytes: int = 2, scored: int = 0,
                  backward: bool = False) -> int:
    """How many requests of ``longest`` tokens fit in ``budget_bytes`` by :func:`row_bytes` (at least 1)."""
    return max(1, int(budget_bytes // max(1, row_bytes(config, longest, dtype_bytes, scored, backward))))


def lm_eval_batch_size(batch_size: int | str, device: str, device_map: str | None = None) -> int | str:
    """What to hand lm-eval's ``HFLM`` for ``batch_size``: a number as it is; ``auto`` as lm-eval's own ``auto``
    where the model goes to GPUs (``cuda`` devices or a device map on a machine with them), else
    :data:`CPU_BATCH_SIZE` (see the module docstring)."""
    batch_size = check_batch_size(batch_size)
    if batch_size != AUTO:
        return batch_size
    import torch

    on_gpu = str(device).startswith("cuda") or (device_map is not None and torch.cuda.is_available())
    return AUTO if on_gpu else CPU_BATCH_SIZE

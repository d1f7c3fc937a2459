"""Mixed precision: a float32 model whose matrix products run in bfloat16 (``torch.autocast``).

A model loaded in bfloat16 rounds everything to 8 bits of mantissa: its weights, and the residual
stream after every block, so rounding errors compound over the layers. Under autocast the weights and
the residual stream stay float32 and only the inputs of the matrix products (linear layers, attention)
are rounded; norms, softmax and the sums between blocks run in float32. On a CPU with AMX-BF16 the
products are what bfloat16 speeds up, so autocast runs about as fast as a bfloat16 model.

Measured on the three CPU recipes' locate steps (RESULTS-locate.md, round 39: an idle 2-core Intel Xeon with
AMX-BF16, each run alone; `bench_bf16_rankings.py RUN --against RUN`):

* single-head effects move less from float32's than a bfloat16 model's do: on SmolLM2's ten controls
  0.06-0.95 percentage points on average (largest 3.7), against 0.19-2.36 (largest 10.0) in bfloat16;
* the search's singles ran 1.2-1.65x faster than in float32, but measure-and-choose then evaluates the
  clean model again in float32 (13.5-16.9 s, a full forward that also fills the prefix caches), so a
  whole locate step gained 1.5x on SmolLM2's main job (83 s against 123 s and 126 s back to back; 1.22x
  in a slower hour, the same set), nothing on Gemma 3 sequence (182 s against 183 s, the same set; its
  262k-word LM head and 14 extra singles run in float32 either way) nor on Gemma 3 induction, whose 24 sets
  in float32 took most of its time (and whose saturated target, clean nll 0.048, moved singles by up to 94 points: the set handed
  on changed, within tolerance neither way);
* so the CPU recipes stay float32: on a CPU without native bf16 the products are emulated (a bfloat16
  model ran 7.5x slower per mask than float32 on an AVX2 host, round 29), and a recipe's result should
  not depend on the CPU.

On a CPU the attention kernel runs in float32 under autocast (:func:`autocast_attention`), because
PyTorch's CPU flash-attention backward ran about 4x slower in bfloat16 than in float32 (an ad-hoc
``torch.profiler`` run, round 40). With bfloat16 attention the gradient attribution gained nothing from
autocast: 18.4 s against float32's 19.2 s in the main job, and slower on multiple choice. With the kernel
in float32, SmolLM2's attribution took 0.72-0.86x the time and its clean forward 0.80-0.99x
(``recipes/bench/bench_attribution_cost.py --precision autocast-bf16-attention --precision autocast``,
two runs, round 41). Gemma 3 (4 heads of width 256, a 262k-word LM head) neither gained nor lost
beyond the repeats' spread. In the main job the attribution went from 17.9 s to 14.1 s (medians of 4
and 5 runs). The knockouts did not gain, since the products take most of their time, so the whole step
stayed within the host's noise.
The attribution and the knockouts compute alike, as they must: the attribution's forward is the
knockouts' clean baseline. Float32 attention did not bring the singles closer to float32's, because
the products' rounding dominates. On a GPU autocast keeps its bfloat16 kernels, which are the fast
ones there.

The LM head runs outside autocast (:func:`capsense.scoring.logits.output_logits`), in float32, as it does
for a bfloat16 model: a bfloat16 logit of 20 moves in steps of 0.125 nats.

The weights stay float32, so autocast needs the memory of a float32 model: a CPU option for speed, not
a way to fit a larger model on a GPU (there, load it in bfloat16).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

#: The dtypes autocast can run a float32 model's products in (``LocateConfig.autocast``).
AUTOCAST_DTYPES = ("bfloat16",)


def search_precision(dtype: str, autocast: str | None, device: str, device_map: object = None,
                     recorded: tuple[str | None, str | None] | None = None) -> tuple[str, str | None]:
    """The model's dtype and the search's autocast dtype of a locate run asked for ``dtype`` and ``autocast``.

    ``auto`` on one CPU with native bf16 (AVX-512 BF16, AMX-BF16) is a float32 model whose search runs its
    products in bfloat16 (since round 47; before, a bfloat16 model). Autocast rounds a subset of what a bfloat16
    model rounds (the products' inputs, not the residual stream, norms or sums), and on the main job it was as fast
    or faster on both CPU types measured: on AMX (rounds 38-39) a bfloat16 model's singles moved the main job's control
    damages from float32's by 0.19-2.36 points on average (largest 10.0), changed its start and cost 32.6 FE and
    243 s against float32's 17.25 FE and 183 s, where autocast's moved them 0.06-0.95 (largest 3.7) and kept the
    set at 1.5x float32's speed; on AVX-512 BF16 (round 47) the main job with ``auto`` took 68.8 and 74.2 s at 9.09
    FE as a bfloat16 model, 70.6 and 65.8 s at 8.39 FE under autocast (the last pair back to back), each the
    float32 run's set; on SmolLM2 arithmetic autocast kept float32's start, 94 s and 19.6 FE against 165 s and 30.6.
    Not always the better outcome: on Gemma 3 induction, a saturated target with no set within tolerance in any
    precision, the bfloat16 model's search happened to hand on the less damaging set, faster, although autocast's
    singles were the closer to float32's on 9 of 11 probes. Measure-and-choose runs in float32 either way on one
    CPU, so the float32 model's memory was already the run's peak. Elsewhere ``auto`` is unchanged
    (:func:`capsense.core.models.resolve_dtype`): bfloat16 on accelerators and under a ``device_map`` (memory
    first), float32 on CPUs without native bf16 (emulated bfloat16 ran 7.5x slower per mask there).

    ``recorded``: the ``(dtype, autocast)`` a run folder being resumed recorded; an ``auto`` run keeps an earlier
    release's bfloat16 model there, so its folder resumes as it ran.
    """
    from capsense.core.models import resolve_dtype

    resolved = resolve_dtype(dtype, device)
    if dtype != "auto" or autocast is not None or device_map or not device.startswith("cpu") or resolved != "bfloat16":
        return resolved, autocast
    if recorded == ("bfloat16", None):
        return "bfloat16", None
    return "float32", "bfloat16"


#: Transformers' attention implementations whose kernel :func:`autocast` runs in float32 on a CPU. Eager
#: attention (each model's own function, not in transformers' registry) computes as autocast says.
FLOAT32_ATTENTION = ("sdpa",)


def autocast_attention(model, dtype: str | None) -> str | None:
    """The dtype ``model``'s attention kernel computes in under :func:`autocast` with ``dtype`` where it is not
    ``dtype``: ``"float32"`` for a CPU model's sdpa attention; None (autocast's dtype, or no autocast) otherwise.
    A run folder records it: a search must not mix knockouts of both."""
    if dtype is None:
        return None
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    return "float32" if on_cpu and getattr(model.config, "_attn_implementation", None) in FLOAT32_ATTENTION else None


@contextlib.contextmanager
def autocast(device: str, dtype: str | None, attention: str | None = None) -> Iterator[None]:
    """Within the block, ``device``'s matrix products run in ``dtype`` (None: nothing changes), and with
    ``attention`` ``"float32"`` (:func:`autocast_attention`) the attention kernel runs in float32."""
    if dtype is None:
        yield
        return
    import torch

    if attention not in (None, "float32"):
        raise ValueError(f"attention {attention!r}: float32, or None for autocast's dtype")
    device_type = torch.device(device).type
    with torch.autocast(device_type=device_type, dtype=getattr(torch, dtype)), \
            (_float32_attention(device_type) if attention else contextlib.nullcontext()):
        yield


@contextlib.contextmanager
def _float32_attention(device_type: str) -> Iterator[None]:
    """Transformers' registered sdpa attention, for the block, runs on float32 query, key and value with
    autocast off on ``device_type`` (elsewhere, and outside autocast, it is the registered function
    itself: a float32 model computes bit for bit as without the block). Restored on exit."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner = {name: ALL_ATTENTION_FUNCTIONS[name] for name in FLOAT32_ATTENTION}

    def in_float32(name: str):
        def attention(module, query, key, value, attention_mask, *args, **kwargs):
            if query.device.type != device_type or not torch.is_autocast_enabled(device_type):
                return inner[name](module, query, key, value, attention_mask, *args, **kwargs)
            with without_autocast(device_type):
                return inner[name](module, query.float(), key.float(), value.float(), attention_mask, *args, **kwargs)
        return attention

    for name in FLOAT32_ATTENTION:
        ALL_ATTENTION_FUNCTIONS[name] = in_float32(name)
    try:
        yield
    finally:
        for name, fn in inner.items():
            ALL_ATTENTION_FUNCTIONS[name] = fn


def precision_name(dtype: str, autocast_dtype: str | None, attention: str | None = None) -> str:
    """How a run computes, in words: the weights' dtype, and the products' where autocast changes them
    (``attention``: the attention kernel's dtype where it is not autocast's, :func:`autocast_attention`)."""
    if autocast_dtype is None:
        return dtype
    return f"{dtype} weights with {autocast_dtype} autocast" + (f" ({attention} attention)" if attention else "")


def computes_in_float32(model) -> bool:
    """Whether ``model``'s forward computes in float32 now: float32 weights and no autocast around it. The
    scorers' self-checks (a shared context, a prefix replay against plain scoring) allow 1e-4 there and a
    bfloat16 tolerance otherwise; under autocast the weights' dtype alone said float32, the multiple-choice
    check failed on bfloat16 noise and turned context sharing off (found in round 39: Gemma 3's antonyms
    control ran every knockout in full)."""
    import torch

    p = next(model.parameters())
    if p.dtype != torch.float32:
        return False
    try:
        return not torch.is_autocast_enabled(p.device.type)
    except TypeError:  # torch < 2.4 takes no device
        return not (torch.is_autocast_cpu_enabled() if p.device.type == "cpu" else torch.is_autocast_enabled())
    except RuntimeError:  # a device autocast does not know (``meta``: weights offloaded by a device map)
        return True


def without_autocast(device_type: str):
    """A block in which ``device_type`` computes in its tensors' own dtypes (autocast off; nothing changes
    on a device autocast does not know)."""
    import torch

    try:
        return torch.autocast(device_type=device_type, enabled=False)
    except RuntimeError:
        return contextlib.nullcontext()

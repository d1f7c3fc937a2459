"""Where a model lives: one device, or spread over several with a ``device_map``.

A ``device_map`` is handed to ``from_pretrained`` (accelerate places the modules and moves
activations between devices with its hooks):

* a strategy: ``auto`` (= lm-eval's ``parallelize=True``), ``balanced``, ``balanced_low_0``,
  ``sequential``: GPUs first, then CPU memory, then disk;
* an explicit map, as JSON text or a ``.json`` file: module name -> device (``cpu``,
  ``cuda:1``, ``1``, ``disk``), e.g. ``{"model.embed_tokens": 0, "model.layers.0": 0, ...}``.

Every device named must exist here; a wrong one is refused before the model loads, naming
the devices there are. Under several processes on one machine, a strategy map gives each
process its own GPUs (GPU ``g`` goes to local process ``g % processes``, as lm-eval does).
Knockout hooks move their masks to wherever the activations are, so ablation works on any
placement, disk offload included. What edits weights in place and saves them (compression)
needs every weight in device memory: :func:`check_weights_in_memory` refuses offloaded ones.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from capsense.core.batching import (
    AUTO, AUTO_MEMORY_FRACTION, CPU_BATCH_SIZE, MAX_AUTO_BATCH_SIZE, config_int, row_bytes, rows_that_fit,
)
from capsense.errors import CapsenseError

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def available_devices() -> list[str]:
    """The devices this machine has: ``cpu``, each ``cuda:<i>``, ``mps`` where present."""
    import torch

    out = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        out.append("mps")
    return out


def check_device(device: str | int) -> str:
    """``device`` as a torch device string if this machine has it, else :class:`CapsenseError`."""
    name = f"cuda:{device}" if isinstance(device, int) or str(device).isdigit() else str(device)
    if name == "cpu":  # always there: no need to import torch to know (bad input fails fast without it)
        return name
    have = available_devices()
    if name == "cuda" and "cuda:0" in have:
        return name
    if name not in have:
        raise CapsenseError(f"device {name!r} does not exist on this machine: available devices are {', '.join(have)}")
    return name


def parse_device_map(spec: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """A checked ``device_map``: a strategy name, or a dict of module -> existing device (see module doc)."""
    if spec is None or spec == "":
        return None
    if isinstance(spec, str):
        text = spec.strip()
        if text.lower() in STRATEGIES:
            return text.lower()
        if text.lower() in ("true", "parallelize"):
            return "auto"
        if text.startswith("{"):
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as e:
                raise CapsenseError(f"device_map is not valid JSON ({e}): give a strategy ({', '.join(STRATEGIES)}) or a JSON map") from None
        elif text.endswith(".json"):
            if not Path(text).is_file():
                raise CapsenseError(f"device_map file {text!r} not found")
            spec = json.loads(Path(text).read_text())
        else:
            return {"": check_device(text)}  # one device: the whole model there
    if not isinstance(spec, dict) or not spec:
        raise CapsenseError(f"device_map must be a strategy ({', '.join(STRATEGIES)}), a device or a non-empty map of module -> device")
    out: dict[str, Any] = {}
    for module, dev in spec.items():
        if dev == "disk":
            out[module] = "disk"
        else:
            d = check_device(dev)
            out[module] = int(d.split(":")[1]) if d.startswith("cuda:") else d
    return out


def _process_gpus() -> list[int]:
    """The GPUs this process may fill under a strategy map (all of them for a lone process)."""
    import torch

    from capsense.core.distributed import context

    ctx = context()
    gpus = list(range(torch.cuda.device_count()))
    if ctx.local_world <= 1:
        return gpus
    mine = [g for g in gpus if g % ctx.local_world == ctx.local_rank]
    if gpus and not mine:
        raise CapsenseError(
            f"{ctx.local_world} processes on this machine but only {len(gpus)} GPUs: with a device map each process "
            "needs GPUs of its own; launch at most one process per GPU"
        )
    return mine


def placement_kwargs(device_map: str | dict[str, Any]) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments for ``device_map`` (checked; see :func:`parse_device_map`)."""
    import torch

    dm = parse_device_map(device_map)
    kwargs: dict[str, Any] = {"device_map": dm}
    if isinstance(dm, str) and torch.cuda.is_available():
        gpus = _process_gpus()
        if len(gpus) < torch.cuda.device_count():
            kwargs["max_memory"] = {g: torch.cuda.mem_get_info(g)[0] for g in gpus}
            kwargs["max_memory"]["cpu"] = available_cpu_memory()
    if isinstance(dm, str) or "disk" in dm.values():
        kwargs["offload_folder"] = _offload_folder()
    return kwargs


def available_cpu_memory() -> int:
    """Bytes of CPU memory a run may plan to use: 90% of what the system reports available now."""
    import psutil

    return int(psutil.virtual_memory().available * 0.9)


def check_cpu_memory(held: dict[str, int], what: str, advice: str, available: int | None = None) -> int:
    """The bytes of ``held`` (by what they are), refused before the work that holds them when above ``available``
    (default: :func:`available_cpu_memory`): running out of memory hours into a calibration or a Fisher loses the
    hours. The error names ``what`` holds them, each part's size and what is available, then ``advice`` (what to
    do instead): one refusal for every such check (a calibration's Gram matrices, a guided run's Fisher)."""
    return _check_held(held, "CPU memory", available_cpu_memory() if available is None else available, what, advice)


def available_device_memory(device) -> int | None:
    """Bytes a run may plan to use on ``device``: 90% of what is free there now (CUDA: free on the device plus
    what torch's caching allocator holds reserved and unused, which this process's next tensors reuse; without it a
    check made after a large solve would see the solve's freed memory as taken), the CPU's
    (:func:`available_cpu_memory`), or None where torch reports no figure (the check is then skipped)."""
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return available_cpu_memory()
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int((torch.cuda.mem_get_info(device)[0] + cached) * 0.9)
    return None


def check_placement(device: str | int | None, device_map: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Refuse, before a load, a ``device_map`` naming a device this machine lacks or, without a map, such a
    ``device``: where a command that takes both puts the model (locate, measure); the checked map
    (:func:`parse_device_map`), or None. A ``device`` other than the
    default (cpu) beside a map is refused too: the map places every module, so the device would not apply (until
    round 53 it was ignored without a word: ``--device cuda:1 --device-map auto`` spread the model from cuda:0)."""
    if device_map:
        if device not in (None, "", "cpu"):
            raise CapsenseError(f"give `device` (the whole model on one device) or `device_map` (spread over devices), "
                                f"not both: `device` {device!r} does not apply beside `device_map` {device_map!r}")
        return parse_device_map(device_map)
    check_device(device)
    return None


def check_device_memory(device, held: dict[str, int], what: str, advice: str, available: int | None = None) -> int:
    """:func:`check_cpu_memory` on ``device``'s memory (``available``: default :func:`available_device_memory`)."""
    have = available_device_memory(device) if available is None else available
    return sum(held.values()) if have is None else _check_held(held, f"{device} memory", have, what, advice)


def _check_held(held: dict[str, int], where: str, have: int, what: str, advice: str) -> int:
    total = sum(held.values())
    if total > have:
        kinds = ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in sorted(held.items()))
        raise CapsenseError(f"{what} holds {total / 2**30:.1f} GiB of {where} beside the model ({kinds}), but "
                            f"{have / 2**30:.1f} GiB is available: {advice}")
    return total


def _offload_folder() -> str:
    """A private folder for weights offloaded to disk, removed when the process exits."""
    from capsense.core.files import cache_dir

    root = cache_dir() / "offload"
    root.mkdir(parents=True, exist_ok=True)
    path = tempfile.mkdtemp(prefix="run-", dir=root)
    atexit.register(shutil.rmtree, path, True)
    return path


def input_device(model) -> "Any":
    """The device a model's input ids go to: its embedding's (accelerate's execution device
    when the weights are offloaded; a module without embeddings: its first weight's)."""
    import torch

    get = getattr(model, "get_input_embeddings", None)
    emb = get() if get is not None else None
    if emb is None:  # a plain module (no embedding): where its weights are
        return next(model.parameters()).device
    hook = getattr(emb, "_hf_hook", None)
    dev = getattr(hook, "execution_device", None)
    if dev is not None:
        return torch.device(f"cuda:{dev}" if isinstance(dev, int) else dev)
    w = emb.weight
    return torch.device("cpu") if w.device.type == "meta" else w.device


def offloaded_weights(model) -> list[str]:
    """Names of the parameters a device map offloaded (to CPU memory beside GPUs, or to disk):
    accelerate's hooks hold their values outside the model and the model's own are on ``meta``."""
    return [name for name, p in model.named_parameters() if p.device.type == "meta"]


def check_weights_in_memory(model, why: str) -> None:
    """Raise :class:`CapsenseError` if the device map offloaded any weight (see :func:`offloaded_weights`);
    ``why`` says what needs every weight in place (``"compression edits ... and saves ..."``)."""
    off = offloaded_weights(model)
    if off:
        shown = ", ".join(off[:3]) + (f" and {len(off) - 3} more" if len(off) > 3 else "")
        raise CapsenseError(
            f"the device map offloaded {len(off)} weights ({shown}) to CPU memory or disk, where accelerate's hooks "
            f"keep them outside the model; {why}: use a device map that keeps every module on a device (GPUs, or "
            "cpu on a machine without GPUs), or no `device_map` on a machine whose memory holds the model"
        )


MAX_MASKS_PER_FORWARD = 64


def auto_masks_per_forward(model, batch_size: int, longest: int, memory_fraction: float = 0.5,
                           prefix_reuse: bool = True) -> int:
    """How many masks to pack in one forward pass: 1 on CPUs (compute-bound there: packing does
    not pay) and wherever prefix reuse is on, since packed masks run full forwards; on a GPU
    without prefix reuse, the most (a power of two, at most 64) whose activations for
    ``batch_size`` requests of up to ``longest`` tokens fit in ``memory_fraction`` of what a run may use there
    (:func:`available_device_memory`: free memory plus what torch's allocator holds unused).

    Measured on one H200 (round 24, ``recipes/results/RESULTS-scale.md``): the same prior-guided
    job on a 1B-shaped model spent 1.0 s per forward-equivalent with prefix reuse and one mask per
    forward (67 masks in 36.7 FE) against 1.10-1.23 s packing 64 (49 masks in 39.7 FE: a packed
    mask pays its full forward); 16 requests of 512 tokens already keep the GPU busy, and packing
    gained 3-4% there (``recipes/bench/bench_gpu.py``). Before round 24 packing was the GPU default.
    """
    import torch

    dev = input_device(model)
    if dev.type != "cuda" or prefix_reuse:
        return 1
    free = available_device_memory(dev)
    return masks_that_fit(model.config, batch_size, longest, free * memory_fraction, torch.finfo(model.dtype).bits // 8)


def text_config(model):
    """The config that sizes ``model``'s decoder (a multimodal model's text config, else its own)."""
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def prefix_cache_bytes(model, n_tokens: int) -> int:
    """Bytes of prefix reuse's cache for ``n_tokens`` tokens: every decoder layer's input hidden
    states (:mod:`capsense.scoring.prefix`), in the model's dtype, on its device."""
    config = text_config(model)
    hidden = config_int(config, "hidden_size", "n_embd")
    return config_int(config, "num_hidden_layers", "n_layer") * n_tokens * hidden * next(model.parameters()).element_size()


def prefix_cache_fits(model, n_tokens: int, memory_fraction: float = 0.5) -> bool:
    """Whether prefix reuse's cache for ``n_tokens`` tokens fits in ``memory_fraction`` of what a run may
    use on the GPU (:func:`available_device_memory`). True off GPUs (host memory is not checked: by :func:`prefix_cache_bytes`, the
    SmolLM2 main job's 5,661 request tokens come to 0.2 GB in bf16). Until round 24 a GPU run
    packed masks by default, which keeps no cache; with one mask per forward the default there
    too, a run whose cache would not fit turns prefix reuse off instead of running out of memory
    mid-search (Llama-3.1-8B in bf16 keeps 256 KiB per token: 100 few-shot prompts of 800 tokens
    are 20 GiB)."""
    dev = input_device(model)
    if dev.type != "cuda":
        return True
    return prefix_cache_bytes(model, n_tokens) <= available_device_memory(dev) * memory_fraction


def recast_fits(model, dtype: str, memory_fraction: float = 0.5) -> bool:
    """Whether ``model`` cast in place to ``dtype`` (measure-and-choose's float32 after a bf16
    search) takes at most ``memory_fraction`` of its GPU's total memory. Total, not free: every GPU
    of a kind answers the same, so a resumed run resolves the same precision (it identifies the
    run folder). True off GPUs and under a device map (which is never recast). On an 80 GB GPU
    models up to 10B parameters are measured in float32; a 34B model in bf16 (68 GB) would need
    136 GB in float32."""
    import torch

    if getattr(model, "hf_device_map", None):
        return True
    dev = input_device(model)
    if dev.type != "cuda":
        return True
    n_bytes = sum(p.numel() for p in model.parameters()) * (torch.finfo(getattr(torch, dtype)).bits // 8)
    return n_bytes <= torch.cuda.get_device_properties(dev).total_memory * memory_fraction


def plan_scoring(model, batch_size: int | str, lengths: list[int], prefix_reuse: bool, masks_per_forward: int | None,
                 dtype: str, refine_dtype: str, refine_asked: bool = False, log=print, scored: int = 0,
                 most_requests: int | None = None) -> dict[str, Any]:
    """How a run scores masks on ``model``'s device: ``prefix_reuse`` (as asked, unless its cache for requests of
    ``lengths`` tokens does not fit: :func:`prefix_cache_fits`), ``batch_size`` and ``attribution_batch_size``
    (as given, else ``auto`` resolved by :func:`auto_batch_size` for requests of up to ``scored`` scored tokens,
    at most ``most_requests`` in a batch, beside the prefix cache), ``masks_per_forward`` (as given, else
    :func:`auto_masks_per_forward`) and ``refine_dtype`` (the run's ``dtype`` instead where a float32 copy would
    not fit and none was asked for: :func:`recast_fits`). Each fallback is said through ``log``."""
    n_tokens, longest = sum(lengths), max(lengths, default=1)
    reuse = prefix_reuse and prefix_cache_fits(model, n_tokens)
    if prefix_reuse and not reuse:
        log(f"prefix reuse off: its cache of clean block inputs ({prefix_cache_bytes(model, n_tokens) / 2**30:.1f} GiB) "
            "does not fit in half the GPU's free memory")
    batch = grad_batch = batch_size
    if batch_size == AUTO:
        # (the attribution's forward fills the prefix cache: it is reserved for both)
        sizes = dict(longest=longest, scored=scored, n_requests=most_requests or len(lengths) or 1,
                     reserved_bytes=prefix_cache_bytes(model, n_tokens) if reuse else 0)
        batch, grad_batch = auto_batch_size(model, **sizes), auto_batch_size(model, **sizes, backward=True)
    mpf = masks_per_forward or auto_masks_per_forward(model, batch, longest, prefix_reuse=reuse)
    if not refine_asked and refine_dtype != dtype and not recast_fits(model, refine_dtype):
        log(f"refine: measuring sets in {dtype}: the model in {refine_dtype} would take more than half the GPU's memory "
            f"(--refine-dtype {refine_dtype} asks for it anyway)")
        refine_dtype = dtype
    return {"batch_size": batch, "attribution_batch_size": grad_batch, "masks_per_forward": mpf, "prefix_reuse": reuse,
            "refine_dtype": refine_dtype}


def masks_that_fit(config, batch_size: int, longest: int, budget_bytes: float, dtype_bytes: int = 2) -> int:
    """The packing :func:`auto_masks_per_forward` picks for ``budget_bytes`` (pure arithmetic, testable): one
    (mask, request) row costs :func:`~capsense.core.batching.row_bytes`."""
    fit = int(budget_bytes // max(1, row_bytes(config, longest, dtype_bytes) * batch_size))
    mpf = 1
    while mpf * 2 <= min(fit, MAX_MASKS_PER_FORWARD):
        mpf *= 2
    return mpf


def auto_batch_size(model, longest: int, scored: int, n_requests: int, backward: bool = False,
                    reserved_bytes: int = 0) -> int:
    """``batch_size: auto`` resolved for ``model`` (:mod:`capsense.core.batching`): its CPU figure off CUDA devices
    and under a device map (whose activations cross devices), else the requests of ``longest`` tokens (``scored``
    of them through the LM head; ``backward``: a gradient pass) that fit in its share of the input device's free
    memory less ``reserved_bytes`` (the prefix cache), at most ``n_requests`` (the most one batch can hold)."""
    import torch

    dev = input_device(model)
    if dev.type != "cuda" or getattr(model, "hf_device_map", None):
        return CPU_BATCH_SIZE
    budget = max(0, available_device_memory(dev) - reserved_bytes) * AUTO_MEMORY_FRACTION
    fit = rows_that_fit(text_config(model), longest, budget, torch.finfo(model.dtype).bits // 8, scored, backward)
    return max(1, min(fit, MAX_AUTO_BATCH_SIZE, n_requests))

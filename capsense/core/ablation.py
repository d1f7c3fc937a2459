"""Exact head ablation by forward pre-hooks on the attention output projection.

A pre-hook sees the projection's input ``x`` of shape ``[batch, seq, n_heads * head_dim]``
and rewrites head ``h``'s slice ``[h * head_dim, (h + 1) * head_dim)``:

* ``zero``: multiply it by 0, exactly what zeroing those input columns of the weight does;
* ``mean``: replace it by its mean over a reference set of texts (:func:`compute_head_means`).

Knockouts are a boolean tensor ``[rows, n_layers, n_heads]`` (True = ablate). With one row
it applies to the whole batch; with ``rows == batch`` each batch row gets its own knockout,
so one forward pass evaluates many knockouts. No weight is copied or modified.

torch is imported inside the functions that use it, so that :data:`ABLATION_MODES` and
:func:`check_ablation_mode` serve the commands and the export preflight, which check their
input before any heavy import.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from capsense.core.arch import arch_spec, head_layout, out_projections
from capsense.core.heads import HeadSet, HeadsLike, load_heads_file, looks_like_heads_file
from capsense.errors import CapsenseError


if TYPE_CHECKING:
    import torch
    from torch import nn

AblationMode = Literal["zero", "mean"]
ABLATION_MODES = ("zero", "mean")


def check_ablation_mode(mode: str) -> AblationMode:
    if mode not in ABLATION_MODES:
        raise CapsenseError(f"unknown `ablation` mode {mode!r}: valid modes are {', '.join(ABLATION_MODES)}")
    return mode  # type: ignore[return-value]


class HeadAblator:
    """Applies head knockouts to a model for the duration of a ``with`` block.

    >>> ablator = HeadAblator(model)
    >>> with ablator.apply("L3H1+L5H0"):
    ...     logits = model(input_ids).logits
    """

    def __init__(
        self,
        model: nn.Module,
        ablation: str = "zero",
        means: dict[int, torch.Tensor] | None = None,
    ) -> None:
        self.model = model
        self.ablation = check_ablation_mode(ablation)
        self.layout = head_layout(model)
        self.projections = out_projections(model)
        if self.ablation == "mean" and means is None:
            raise CapsenseError(
                "mean ablation needs per-head means: compute them with "
                "capsense.core.ablation.compute_head_means(model, tokenizer, texts) and pass means="
            )
        self.means = means or {}

    def knockouts(self, heads: HeadsLike) -> torch.Tensor:
        """A one-row knockout tensor ``[1, n_layers, n_heads]`` for a head set."""
        import torch

        hs = HeadSet.parse(heads).check_fits(self.layout)
        ko = torch.zeros(1, self.layout.n_layers, self.layout.n_heads, dtype=torch.bool)
        for h in hs:
            ko[0, h.layer, h.head] = True
        return ko

    def _as_knockouts(self, mask: HeadsLike | torch.Tensor) -> torch.Tensor:
        import torch

        if isinstance(mask, torch.Tensor):
            ko = mask.bool()
            if ko.dim() == 2:
                ko = ko.unsqueeze(0)
            expected = (self.layout.n_layers, self.layout.n_heads)
            if ko.dim() != 3 or tuple(ko.shape[1:]) != expected:
                raise CapsenseError(
                    f"knockout tensor must have shape [rows, {expected[0]}, {expected[1]}], "
                    f"got {tuple(mask.shape)}"
                )
            return ko
        return self.knockouts(mask)

    @contextmanager
    def apply(self, mask: HeadsLike | torch.Tensor) -> Iterator[None]:
        """Ablate ``mask`` (heads, or a knockout tensor) inside the block; hooks always removed."""
        ko = self._as_knockouts(mask)
        handles = []
        try:
            for layer in ko.any(dim=(0, 2)).nonzero().flatten().tolist():
                proj = self.projections[layer]
                keep = (~ko[:, layer, :]).repeat_interleave(self.layout.head_dim, dim=1).unsqueeze(1)
                mean = self.means[layer] if self.ablation == "mean" else None
                handles.append(proj.register_forward_pre_hook(_make_hook(keep, mean)))
            yield
        finally:
            for h in handles:
                h.remove()


def _make_hook(keep_mask: torch.Tensor, mean: torch.Tensor | None):
    rows = keep_mask.shape[0]
    placed: dict[tuple, tuple] = {}

    def on(x: torch.Tensor) -> tuple:
        # Built where the activations are, on first use: the layer's weights may sit on
        # another device, or on "meta" when accelerate offloads them (device_map).
        key = (x.device, x.dtype)
        if key not in placed:
            keep = keep_mask.to(device=x.device, dtype=x.dtype)
            fill = None if mean is None else (1 - keep) * mean.to(device=x.device, dtype=x.dtype)
            placed[key] = (keep, fill)
        return placed[key]

    def hook(module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        if rows != 1 and x.shape[0] != rows:
            raise CapsenseError(
                f"knockout tensor has {rows} rows but the batch has {x.shape[0]}: "
                "use one row (applies to all) or one row per batch row"
            )
        keep, fill = on(x)
        k, f = (keep, fill) if x.dim() == 3 else (keep[:, 0], None if fill is None else fill[:, 0])
        x = x * k if f is None else x * k + f
        return (x, *args[1:])

    return hook


@contextmanager
def scale_heads(model: nn.Module, scale: torch.Tensor, means: dict[int, torch.Tensor] | None = None) -> Iterator[None]:
    """Multiply each head's slice of the output-projection input by ``scale[layer, head]``.

    The continuous twin of :class:`HeadAblator` (same hook point, same slices): with ``means``
    the slice becomes ``x + (scale - 1) * (x - mean)``, so ``scale = 0`` is mean ablation and
    ``scale = 1`` the clean model to the bit (written ``mean + scale * (x - mean)`` it is not: the
    rounding of the two terms moves the clean forward by ~1e-7, and the attribution's forward serves as
    the run's clean evaluation). ``scale`` may require grad: derivatives of any score with
    respect to it estimate every head's ablation effect at once (gradient attribution).
    ``scale`` may also be ``[rows, n_layers, n_heads]``, one multiplier per row of the batch (the
    batch must have ``rows`` rows): its gradient is then each row's (document's) own, from one backward.
    """
    layout = head_layout(model)
    if tuple(scale.shape[-2:]) != (layout.n_layers, layout.n_heads) or scale.dim() not in (2, 3):
        raise CapsenseError(f"`scale` must have shape [{layout.n_layers}, {layout.n_heads}] or "
                            f"[rows, {layout.n_layers}, {layout.n_heads}], got {tuple(scale.shape)}")
    handles = []

    def make(layer: int, proj: nn.Module):
        mean = None if means is None else means[layer]

        def hook(module: nn.Module, args: tuple) -> tuple:
            x = args[0]
            s = scale[..., layer, :].repeat_interleave(layout.head_dim, dim=-1).to(device=x.device, dtype=x.dtype)
            if s.dim() == 2:  # one multiplier per row: [rows, 1, width] against x [rows, positions, width]
                if s.shape[0] != x.shape[0]:
                    raise CapsenseError(f"`scale` has {s.shape[0]} rows but the batch has {x.shape[0]}")
                s = s[:, None, :]
            if mean is None:
                return (x * s, *args[1:])
            m = mean.to(device=x.device, dtype=x.dtype)
            return (x + (s - 1) * (x - m), *args[1:])

        return proj.register_forward_pre_hook(hook)

    try:
        for layer, proj in enumerate(out_projections(model)):
            handles.append(make(layer, proj))
        yield
    finally:
        for h in handles:
            h.remove()


def check_reference_file(path: str | os.PathLike) -> Path:
    """``path`` as a :class:`Path`, or one :class:`CapsenseError` saying what a mean-ablation reference file is."""
    p = Path(path)
    if not p.is_file():
        raise CapsenseError(f"mean_reference file {str(p)!r} not found: give a text file (a passage per line) "
                            "or JSONL with a 'text' field")
    return p


def read_reference_texts(path: str | os.PathLike) -> list[str]:
    """Reference texts for mean ablation: plain text (a passage per line) or JSONL (``text``)."""
    p = check_reference_file(path)
    lines = [ln for ln in p.read_text().splitlines() if ln.strip()]
    if p.suffix == ".jsonl":
        return [json.loads(ln)["text"] for ln in lines]
    return lines


def resolve_ablation(located: dict, ablation: str | None, mean_reference: str | os.PathLike | None = None,
                     ) -> tuple[str, str | None]:
    """The ablation to apply to a heads file's set, and its reference texts: ``ablation`` when given, else the one
    the file's run located under (``located``: the file's meta; ``zero`` for a file from before the setting or one
    locate did not write). The run's reference texts come along when the mode is the run's and none are given:
    what validate and export do with a set by default is what the run measured."""
    ran = located.get("ablation") or "zero"
    mode = check_ablation_mode(ablation or ran)
    if mean_reference is None and mode == ran == "mean":
        mean_reference = located.get("mean_reference")
    if mean_reference is not None:
        if mode != "mean":
            raise CapsenseError("`mean_reference` only applies to `ablation` mean")
        check_reference_file(mean_reference)
    return mode, None if mean_reference is None else str(mean_reference)


def located_ablation(heads: HeadsLike, ablation: str | None, mean_reference: str | os.PathLike | None = None,
                     ) -> tuple[str, str | None]:
    """The ablation to apply to ``heads`` (:func:`resolve_ablation`): ``ablation`` when given, else what the run
    behind ``heads`` (a heads file) located under; ``zero`` for a head spec. What export, evaluate and
    ``capsense-masked`` apply by default (evaluate and ``capsense-masked`` zeroed a mean-located set until round 51,
    so their numbers were not validate's)."""
    meta = {}
    if isinstance(heads, (str, os.PathLike)) and looks_like_heads_file(heads):
        meta = load_heads_file(Path(heads)).meta
    return resolve_ablation(meta, ablation, mean_reference)


def ablation_identity(ablation: str, mean_reference: str | os.PathLike | None = None) -> str | None:
    """What a knocked-out head becomes, as a run or a validation is identified by it: None for zero ablation (as
    in folders from before the setting), else ``mean`` and its reference texts (a digest of the file's bytes, so a
    moved file is the same reference and an edited one is not)."""
    if ablation == "zero":
        return None
    if mean_reference is None:
        return "mean (capsense.tasks.prose.PASSAGES)"
    import hashlib

    return f"mean (sha256 {hashlib.sha256(Path(mean_reference).read_bytes()).hexdigest()[:16]})"


def reference_means(model: nn.Module, tokenizer, ablation: str,
                    mean_reference: str | os.PathLike | None = None) -> dict[int, torch.Tensor] | None:
    """What an ablation of kind ``ablation`` replaces a head by: None for ``zero``; for ``mean``, the
    head means over ``mean_reference``'s texts (:func:`read_reference_texts`), or over capsense's
    neutral prose when it is None. The one place a run, a validation and an export get their means."""
    mode, mean_reference = resolve_ablation({}, ablation, mean_reference)
    if mode == "zero":
        return None
    texts = read_reference_texts(mean_reference) if mean_reference else None
    return compute_head_means(model, tokenizer, texts)


def compute_head_means(model: nn.Module, tokenizer, texts: Sequence[str] | None = None, batch_size: int = 8,
                       max_length: int = 512) -> dict[int, torch.Tensor]:
    """Mean of each layer's output-projection input over all tokens of ``texts``.

    The default reference set is capsense's neutral English prose
    (:data:`capsense.tasks.prose.PASSAGES`); pass other ``texts`` to choose another.
    Returns ``{layer: tensor[n_heads * head_dim]}`` in float32 on the CPU.
    """
    import torch

    if texts is None:
        from capsense.tasks.prose import PASSAGES

        texts = list(PASSAGES)
    if not texts:
        raise CapsenseError("mean ablation needs at least one reference text in `texts`")
    projections = out_projections(model)
    sums: dict[int, torch.Tensor] = {}
    count = torch.zeros((), dtype=torch.float64)
    current: dict[str, torch.Tensor] = {}

    def make(layer: int):
        def hook(module, args):
            x = args[0].double()
            w = current["mask"].to(x.device, x.dtype).unsqueeze(-1)
            s = (x * w).sum(dim=(0, 1)).cpu()
            sums[layer] = sums[layer] + s if layer in sums else s

        return hook

    handles = [p.register_forward_pre_hook(make(i)) for i, p in enumerate(projections)]
    from capsense.core.placement import input_device

    device = input_device(model)
    pad_side = tokenizer.padding_side
    try:
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "right"
        for i in range(0, len(texts), batch_size):
            enc = tokenizer(
                list(texts[i : i + batch_size]),
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=max_length,
            ).to(device)
            current["mask"] = enc["attention_mask"]
            with torch.no_grad():
                model(**enc)
            count += enc["attention_mask"].sum().double().cpu()
    finally:
        tokenizer.padding_side = pad_side
        for h in handles:
            h.remove()
    return {layer: (s / count).float() for layer, s in sums.items()}


def zero_heads_in_weights(model: nn.Module, heads: HeadsLike) -> None:
    """Zero the ablated heads' input columns of the output projection, in place.

    The weight-space twin of zero ablation (rows for GPT-2's Conv1D).
    """
    spec = arch_spec(model)
    layout = head_layout(model)
    hs = HeadSet.parse(heads).check_fits(layout)
    projections = out_projections(model)
    import torch

    from capsense.core.arch import projection_weight

    with torch.no_grad():
        for layer, head_ids in hs.by_layer().items():
            w = projection_weight(projections[layer])
            for h in head_ids:
                sl = slice(h * layout.head_dim, (h + 1) * layout.head_dim)
                if spec.transposed:
                    w[sl, :] = 0
                else:
                    w[:, sl] = 0

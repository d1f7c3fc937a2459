"""Block replay: record what a model's decoder blocks received and returned, then start later.

When the blocks before layer ``l`` compute exactly what they computed in a recorded pass (a
clean model before the first ablated head; a compressed model before the unit whose level
changed), a forward can start at ``l`` and skip that prefix. Two ways to start there, one
recorder:

* :meth:`BlockReplay.run_from` calls the blocks from ``l`` on directly with the recorded
  inputs of block ``l`` (hidden states plus the call's other arguments: attention mask,
  rotary embeddings, position ids, as the model itself passed them) and returns the last
  block's hidden states: :mod:`capsense.scoring.prefix`, which owns the final norm.
* :meth:`BlockReplay.skip_before` lets the model's own forward run (any caller, any number
  of batches) while the blocks before ``l`` hand on, call after call, the recorded outputs of
  block ``l - 1`` instead of computing: :mod:`capsense.compress.measured_sensitivity`,
  whose loss is a whole probe scorer. The same batches must run in the same order as when
  recorded.

:meth:`BlockReplay.rows` replays some rows of a recorded batch, at their share of the cost: the prefix scorers
check their replay on two rows (:mod:`capsense.scoring.prefix`).

Skipping shadows a block's ``forward`` on the instance and restores exactly what was there
afterwards. Under a device map accelerate has already put its own hook on the instance
(``block.forward`` wraps the class's forward to move inputs to the block's device); deleting
the shadow, as the first version of measured sensitivity did, removed that hook for good.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from capsense.core.arch import arch_spec, unwrap

T = TypeVar("T")
_MISSING = object()


def swapped(args: tuple, kwargs: dict[str, Any], old: Any, new: Any) -> tuple[tuple, dict[str, Any], int]:
    """``args`` and ``kwargs`` with every value that is ``old`` (by identity) replaced by ``new``, and
    how many were replaced: how a recorded call is handed a fresh KV cache, or stops keeping one alive."""
    n = sum(a is old for a in args) + sum(v is old for v in kwargs.values())
    return (tuple(new if a is old else a for a in args), {k: new if v is old else v for k, v in kwargs.items()}, n)


@dataclass
class BlockCall:
    """One call of one block: its hidden-state input, the other arguments, and how they were passed."""

    hidden: torch.Tensor
    args: tuple
    kwargs: dict[str, Any]
    positional: bool  # hidden states passed as the first positional argument (else as ``hidden_states=``)

    def __call__(self, block: nn.Module, hidden: torch.Tensor, swap: tuple[Any, Any] | None = None) -> torch.Tensor:
        """``block`` called as it was, on ``hidden``; its hidden-state output. ``swap`` = (old, new):
        every argument that is ``old`` (positional or keyword) is passed as ``new`` (a fresh KV cache)."""
        args, kwargs = self.args, self.kwargs
        if swap is not None:
            args, kwargs, _ = swapped(args, kwargs, *swap)
        if self.positional:
            out = block(hidden, *args, **kwargs)
        else:
            out = block(*args, hidden_states=hidden, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def mapped(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> BlockCall:
        """This call with ``fn`` applied to every tensor it holds (:func:`map_tensors`)."""
        return BlockCall(fn(self.hidden), map_tensors(self.args, fn), map_tensors(self.kwargs, fn), self.positional)


def map_tensors(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``x`` with ``fn`` applied to every tensor in it, inside tuples (named ones too), lists and dicts: a block's
    arguments nest them (rotary tables as a ``(cos, sin)`` pair, a mask per layer type in a dict)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (tuple, list)):
        vals = [map_tensors(v, fn) for v in x]
        return type(x)(*vals) if hasattr(x, "_fields") else type(x)(vals)
    if isinstance(x, dict):
        return {k: map_tensors(v, fn) for k, v in x.items()}
    return x


class BlockReplay:
    """Per block, the inputs and/or outputs of every call during :meth:`record`'s function."""

    def __init__(self, model: nn.Module) -> None:
        base = unwrap(model)
        self.blocks = base.get_submodule(arch_spec(base).layers)
        self.inputs: list[list[BlockCall]] = [[] for _ in self.blocks]
        self.outputs: list[list[Any]] = [[] for _ in self.blocks]

    def record(self, fn: Callable[[], T], inputs: bool = True, outputs: bool = False) -> T:
        """Run ``fn`` keeping each block's inputs (and outputs) of every call; ``fn``'s result."""
        self.inputs = [[] for _ in self.blocks]
        self.outputs = [[] for _ in self.blocks]

        def keep_input(i: int):
            def pre(_module, args, kwargs):
                if args:
                    self.inputs[i].append(BlockCall(args[0], args[1:], dict(kwargs), True))
                else:
                    kw = dict(kwargs)
                    self.inputs[i].append(BlockCall(kw.pop("hidden_states"), (), kw, False))

            return pre

        hooks = []
        for i, b in enumerate(self.blocks):
            if inputs:
                hooks.append(b.register_forward_pre_hook(keep_input(i), with_kwargs=True))
            if outputs:
                hooks.append(b.register_forward_hook(lambda _m, _a, out, i=i: self.outputs[i].append(out)))
        try:
            return fn()
        finally:
            for h in hooks:
                h.remove()

    def replace(self, old: Any, new: Any) -> int:
        """Every recorded argument that is ``old`` becomes ``new`` (a cache the recording must not keep
        alive becomes a placeholder); how many were replaced."""
        n = 0
        for calls in self.inputs:
            for c in calls:
                c.args, c.kwargs, k = swapped(c.args, c.kwargs, old, new)
                n += k
        return n

    def detach(self) -> BlockReplay:
        """Drop the autograd history of everything recorded (a pass recorded under a backward, as
        the gradient attribution's is, would otherwise keep its whole graph alive); ``self``."""
        self.inputs = [[c.mapped(torch.Tensor.detach) for c in calls] for calls in self.inputs]
        self.outputs = [[map_tensors(o, torch.Tensor.detach) for o in outs] for outs in self.outputs]
        return self

    def rows(self, index: list[int]) -> BlockReplay:
        """A replay of the recorded batch's rows ``index`` only (the blocks are shared): in every call the hidden
        states and each tensor argument of two or more dimensions whose first is the batch's (an attention mask,
        per-row positions or rotary tables, inside tuples, lists and dicts too) keep those rows; the rest (a
        broadcast row, ``cache_position``, flags, a cache) is passed as it was. What a row computes does not depend
        on the other rows in a decoder block, so this replays ``index`` at ``len(index) / batch`` of the cost: the
        prefix scorers' replay check (:mod:`capsense.scoring.prefix`). An argument indexed by row that this does
        not slice (a one-dimensional per-row tensor, a mask object that is no tensor) should make the replay fail
        or differ from the recorded rows: the prefix scorers then check the whole batch."""
        def picked(call: BlockCall) -> BlockCall:
            batch, rows = call.hidden.shape[0], torch.tensor(index, device=call.hidden.device)
            return call.mapped(lambda t: t.index_select(0, rows.to(t.device)) if t.dim() >= 2 and t.shape[0] == batch else t)

        view = BlockReplay.__new__(BlockReplay)
        view.blocks = self.blocks
        view.inputs = [[picked(c) for c in calls] for calls in self.inputs]
        view.outputs = [[] for _ in self.blocks]
        return view

    @property
    def complete(self) -> bool:
        """Every block's input was recorded (false when the model bypassed a block's hooks)."""
        return all(self.inputs)

    def run_from(self, start: int, call: int = 0, swap: tuple[Any, Any] | None = None) -> torch.Tensor:
        """Hidden states after the last block, computing blocks ``start..`` from recorded call ``call``
        (``swap``: see :meth:`BlockCall.__call__`)."""
        hidden = self.inputs[start][call].hidden
        for i in range(start, len(self.blocks)):
            hidden = self.inputs[i][call](self.blocks[i], hidden, swap)
        return hidden

    @contextmanager
    def skip_before(self, layer: int) -> Iterator[None]:
        """Blocks ``< layer`` skip their computation and hand on block ``layer - 1``'s recorded outputs."""
        if layer == 0:
            yield
            return
        saved = self.outputs[layer - 1]
        shadowed = []
        for b in self.blocks[:layer]:
            shadowed.append((b, b.__dict__.get("forward", _MISSING)))  # accelerate's hook, if any
            calls = iter(saved)
            b.forward = lambda *_a, _calls=calls, **_k: next(_calls)
        try:
            yield
        finally:
            for b, before in shadowed:
                if before is _MISSING:
                    del b.forward
                else:
                    b.forward = before

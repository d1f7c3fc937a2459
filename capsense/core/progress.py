"""One progress display for a whole run: phases (``locate 1/3``, ``refine 2/3``, ``validate 3/3``) and a total ETA.

A run declares its phases up front, each with its number of units (masks, candidate sets,
validation conditions) and the cost of one unit relative to the others (a validation
condition runs every held-out document of every task, so it costs more than one mask on the
probe documents). One tqdm bar counts cost over all phases, so its ETA covers what is left
of the whole run, not only of the current phase::

    progress = RunProgress([Phase("locate", 151, "masks"), Phase("refine", 24, "sets"),
                            Phase("validate", 5, "conditions", unit_cost=6.0)])
    with progress.phase("locate") as p:
        p.update(done_before_resume, resumed=True)
        for mask in masks:
            ...
            p.update()
    with progress.phase("validate") as p:
        p.label("random 2/3")       # what the bar is doing now
        ...
    progress.close()

A phase left early (converged, nothing to refine) jumps the bar to that phase's end.
``enabled=False`` (or a non-interactive log) keeps the API and prints one line per phase.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Phase:
    """A named stage of a run: ``units`` of work, each costing ``unit_cost`` (relative)."""

    name: str
    units: int
    unit: str = "steps"
    unit_cost: float = 1.0

    @property
    def cost(self) -> float:
        return max(self.units, 0) * self.unit_cost


class PhaseProgress:
    """The handle a phase updates: counts its own units, moves the run's one bar."""

    def __init__(self, run: RunProgress, index: int) -> None:
        self.run, self.index = run, index
        self.phase = run.phases[index]
        self.done = 0
        self._label = ""

    def update(self, n: int = 1, *, resumed: bool = False) -> None:
        """``n`` more units done (``resumed``: done by an earlier process; they do not count toward the rate)."""
        n = max(0, min(n, self.phase.units - self.done)) if self.phase.units else n
        self.done += n
        self.run._advance(n * self.phase.unit_cost, resumed=resumed)
        self.run._describe(self)

    def close(self) -> None:
        """Nothing to do (the run's bar outlives its phases); lets a phase stand where a tqdm bar was."""

    def label(self, text: str) -> None:
        """What the phase is doing now (shown beside the counts), e.g. ``random 2/3``."""
        self._label = text
        self.run._describe(self)

    @property
    def description(self) -> str:
        n = len(self.run.phases)
        return f"{self.phase.name} {self.index + 1}/{n}"

    @property
    def postfix(self) -> str:
        counts = f"{self.done}/{self.phase.units} {self.phase.unit}"
        return f"{counts}, {self._label}" if self._label else counts


class RunProgress:
    """The one progress display of a run; see the module docstring."""

    def __init__(self, phases: Sequence[Phase], enabled: bool = True, file: Any = None) -> None:
        if not phases:
            raise ValueError("a run needs at least one phase")
        self.phases = list(phases)
        self.enabled = enabled
        self.file = file if file is not None else sys.stderr
        self._bar = None
        self._spent = 0.0
        self._start = time.monotonic()

    def index(self, name: str) -> int:
        for i, p in enumerate(self.phases):
            if p.name == name:
                return i
        raise KeyError(f"no phase {name!r}; phases are {', '.join(p.name for p in self.phases)}")

    def set_units(self, name: str, units: int) -> None:
        """Correct phase ``name``'s unit count once it is known (e.g. after the model is loaded)."""
        i = self.index(name)
        self.phases[i] = replace(self.phases[i], units=int(units))
        if self._bar is not None:
            self._bar.total = self.total_cost
            self._bar.refresh()

    @property
    def total_cost(self) -> float:
        return sum(p.cost for p in self.phases)

    def _ensure_bar(self):
        if self._bar is None and self.enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total_cost, file=self.file, dynamic_ncols=True, leave=True,
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining} total{postfix}]")
        return self._bar

    def _advance(self, cost: float, resumed: bool = False) -> None:
        self._spent += cost
        bar = self._ensure_bar()
        if bar is not None:
            if resumed:  # counted in the position, not in the rate
                bar.n += cost
                bar.last_print_n = bar.n
                bar.refresh()
            else:
                bar.update(cost)

    def _describe(self, p: PhaseProgress) -> None:
        bar = self._ensure_bar()
        if bar is not None:
            bar.set_description_str(p.description, refresh=False)
            bar.set_postfix_str(p.postfix)

    @contextmanager
    def phase(self, name: str) -> Iterator[PhaseProgress]:
        """Run the phase ``name``; on leaving, the bar moves to the phase's end (early exits included)."""
        i = self.index(name)
        handle = PhaseProgress(self, i)
        before = sum(p.cost for p in self.phases[:i])
        if self.enabled:
            self._describe(handle)
        if self._spent < before:  # earlier phases skipped entirely
            self._advance(before - self._spent, resumed=True)
        if not self.enabled:
            print(f"[{handle.description}] {handle.phase.name}: {handle.phase.units} {handle.phase.unit}",
                  file=self.file, flush=True)
        yield handle
        end = before + self.phases[i].cost
        if self._spent < end:
            self._advance(end - self._spent, resumed=True)

    def write(self, message: str) -> None:
        """A log line that does not break the bar."""
        bar = self._bar
        if bar is not None:
            bar.write(message, file=self.file)
        else:
            print(message, file=self.file, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@contextmanager
def without_library_bars() -> Iterator[None]:
    """No library's bar within the block (capsense's own bars live outside it), and as they were after it: transformers'
    (one over the weights of a load, one over the shards of a save; they were switched on after every load, whatever
    a user's ``HF_HUB_DISABLE_PROGRESS_BARS`` said) and compressed-tensors' (three per load of a packed checkpoint:
    applying its quantization config, compressing, dispatching). They say nothing to a capsense user beside its own
    bars and lines, and fill logs: ``--no-progress`` left "Writing model shards" in every log of ``compress`` and
    ``distill``, and three bars in every load of a packed checkpoint.

    compressed-tensors has no switch, and passes its own ``disable`` to tqdm: every tqdm bar started within the block
    is made with ``disable=True`` (tqdm's ``__init__`` wrapped, and given back after). Swapping the name ``tqdm`` in
    its modules instead needed them imported before the load, which cost 2.3 s for every load (measured)."""
    from tqdm import std

    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    init = std.tqdm.__init__

    def hidden(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **{**kwargs, "disable": True})

    std.tqdm.__init__ = hidden
    try:
        yield
    finally:
        std.tqdm.__init__ = init
        if was:
            hf_logging.enable_progress_bar()

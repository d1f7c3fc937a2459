"""Measured sensitivity: price each unit's levels by the kept capability's loss, measured.

``Guide(sensitivity="measured")`` (``capsense compress --keep math --sensitivity measured``)
allocates the method's levels over *units* (a layer's attention or MLP matrices, or whole
layers) from losses measured on the model itself instead of the second-order Fisher estimate:

1. compress every target at the uniform setting (the size to match), and measure the kept
   capabilities' loss ``L_u`` on their allocation documents: the task's *last* ``samples``
   documents (the ones the Fisher estimate reads; probes take the first ones, so no probe
   document chooses the allocation), scored as probes are (prompt masked, nats/token);
2. for each unit and each candidate level: put that unit at the level, measure ``L``, put it
   back; the cost of (unit, level) is ``L - L_u`` (negative for an upgrade);
3. :func:`capsense.compress.allocate.allocate` picks one level per unit, least total cost with
   total exact bits at most the uniform setting's; the choice becomes per-unit overrides
   (``layers`` + ``matrices``) of an ordinary budget, so the budget file reproduces it.

Why measured, for quantization above all: ``sum F (W - W')^2`` is a second-order estimate
around the trained weights. It is good for small perturbations (Wanda's pruned weights are
small by construction) but underprices large ones: RTN at 2-3 bits moves every weight by up
to half a step, the loss responds far beyond quadratically (on SmolLM2 3-bit RTN costs math
+2.2 nats/token) and the Fisher-guided allocation was no better than uniform. A measured
forward pass prices the real perturbation, non-linearity included.

Why in the uniform context: the allocation changes a few units away from the uniform level,
so the relevant cost is a unit's change *with every other unit already compressed* (errors
compound through the residual stream; a layer that looks harmless alone can matter when its
inputs are already noisy). Each unit is measured once per level against that context;
treating the costs as additive is the one approximation left (interactions between units
that both move are ignored).

Cost: ``rounds x units x (levels - 1)`` forwards over ``samples`` documents per kept capability,
each starting at its unit's layer (:meth:`capsense.core.replay.BlockReplay.skip_before`).
SmolLM2-135M on 2 CPU cores: a full forward over 32 math documents takes about 7 s, so 30
layers x 3 levels take about 6 minutes; 60 attention/MLP units x 5 levels about 20.

Measured outcome (``recipes/results/RESULTS-compress.md``): on SmolLM2 at 3-bit RTN the
measured allocation did *not* beat uniform on the held-out probes; see there for why.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

import capsense.compress.accounting as acc
from capsense.compress.allocate import Candidate, allocate
from capsense.compress.budget import Override
from capsense.errors import BudgetError, CapsenseError
from capsense.compress.engine import stats_for
from capsense.compress.methods import Setting
from capsense.compress.targets import Target, restore, snapshot
from capsense.core.registry import Registry
from capsense.core.replay import BlockReplay

# How targets group into units: a name and the override condition of a unit.
UNITS: Registry[Callable[[Target], tuple[int, str | None]]] = Registry("unit", "units", BudgetError)
UNITS.register("kind", lambda t: (t.layer, t.kind))  # a layer's attention matrices, or its MLP matrices
UNITS.register("layer", lambda t: (t.layer, None))  # all of a layer's target matrices


@dataclass(frozen=True)
class Unit:
    """Target matrices that share one level: a layer (``kind`` None) or a layer's ``attn``/``mlp``."""

    layer: int
    kind: str | None
    targets: tuple[Target, ...]

    @property
    def name(self) -> str:
        return f"L{self.layer}" + (f".{self.kind}" if self.kind else "")

    def override(self, setting: Setting) -> Override:
        """The budget override that gives this unit ``setting``."""
        return Override(layers={self.layer}, matrices={self.kind} if self.kind else None, setting=setting.to_dict())


def check_unit(unit: str) -> str:
    """``unit`` if it names a unit kind, else :class:`BudgetError` listing the valid ones."""
    return UNITS.check(unit)


def units_of(targets: Sequence[Target], unit: str) -> list[Unit]:
    """The targets grouped into units, in model order."""
    key = UNITS[check_unit(unit)]
    groups: dict[tuple[int, str | None], list[Target]] = {}
    for t in targets:
        groups.setdefault(key(t), []).append(t)
    return [Unit(layer, kind, tuple(ts)) for (layer, kind), ts in groups.items()]


def ladder(base: Setting, levels: Sequence[Setting], n: int, sample: Sequence[torch.Tensor] = ()) -> list[Setting]:
    """At most ``n`` of ``levels`` (``base`` always among them), spread evenly over their size.

    Each level costs one measured forward per unit, so the ladder is short. With ``sample``
    (a few of the model's matrices), levels that another level beats in both size and
    relative weight error on them are dropped first (RTN: a finer group of fewer bits vs a
    coarser one of more bits), then ``n`` are picked closest to an even spacing of bits.
    """
    if n < 2:
        raise BudgetError(f"a measured allocation needs at least 2 levels per unit, got {n}")
    def bits(s: Setting) -> int:
        return s.typical_bits(acc.BASE_BITS)

    pool = sorted({*levels, base}, key=bits)
    if sample:
        pool = sorted({*_undominated(pool, sample, bits), base}, key=bits)
    if len(pool) <= n:
        return pool
    lo, hi = bits(pool[0]), bits(pool[-1])
    goals = [lo + (hi - lo) * i / (n - 1) for i in range(n)]
    goals.remove(min(goals, key=lambda g: abs(g - bits(base))))  # the base takes the goal nearest it
    picked = {base}
    for g in goals:
        picked.add(min((s for s in pool if s not in picked), key=lambda s: abs(bits(s) - g)))
    return sorted(picked, key=bits)


def _undominated(pool: Sequence[Setting], sample: Sequence[torch.Tensor], bits) -> list[Setting]:
    """Levels no other level beats in both size and relative squared error on ``sample``."""
    norm = sum(float(w.float().pow(2).sum()) for w in sample)
    err = {}
    for s in pool:
        try:
            err[s] = sum(float((w.float() - s.apply("sample", w, None, None, acc.BASE_BITS).weight).pow(2).sum())
                         for w in sample) / norm
        except CapsenseError:
            continue  # a level needing calibration or a rank the sample cannot take: kept
    return [s for s in pool if s not in err or not any(
        bits(o) <= bits(s) and err[o] < err[s] for o in err if o != s)]


def allocation_probes(model: nn.Module, tokenizer, keep: Sequence[str], n: int, include_path: Sequence[str] = ()) -> dict:
    """Each kept capability's last ``n`` documents as a probe (disjoint from the first-document probes), a
    perplexity task's texts cut at ``model``'s length (``include_path``: folders of task YAMLs)."""
    from capsense.compress.capability_loss import capability_probe
    from capsense.scoring.probe import model_max_length

    return {cap: capability_probe(cap, tokenizer, n, "calibration", include_path, model_max_length(model)) for cap in keep}


def probe_loss(model: nn.Module, probes: Mapping[str, object]) -> float:
    """Sum over the probes of the model's loss (nats/token), as it stands."""
    from capsense.compress.capability_loss import measure_probe

    return sum(measure_probe(model, p, cap).nll for cap, p in probes.items())


@torch.no_grad()
def measure_costs(
    units: Sequence[Unit], levels: Sequence[Setting], base: Setting, original: Mapping[str, torch.Tensor],
    stats, prot: Mapping[str, object], loss: Callable[[], float], progress: Callable[[int], None] | None = None,
    replay: BlockReplay | None = None, held: Mapping[str, Setting] | None = None,
) -> tuple[float, dict[str, list[Candidate]]]:
    """(loss of the model as it is, each unit's candidates): the model must hold ``base`` on every
    unit, or the level ``held`` names for it; a candidate's cost is its loss change from there.

    Every unit at every level is set, measured and put back, so the model ends as it started.
    With ``replay``, blocks before a unit's layer are not recomputed.
    """
    held = held or {}
    uniform = snapshot(t for u in units for t in u.targets)
    l_u = replay.record(loss, inputs=False, outputs=True) if replay is not None else loss()
    cands: dict[str, list[Candidate]] = {}
    for u in units:
        now = held.get(u.name, base)
        out = []
        for s in sorted(levels, key=lambda s: s != now):  # the held level first: ties keep it
            try:
                applied = [(t, _applied(t, s, original, stats, prot)) for t in u.targets]
            except CapsenseError:
                applied = None  # a level this unit cannot take
            if applied is not None:
                bits = sum(a.bits for _, a in applied)
                if s == now:
                    out.append(Candidate(s, bits, 0.0))
                else:
                    for t, a in applied:
                        t.set(a.weight)
                    with replay.skip_before(u.layer) if replay is not None else nullcontext():
                        out.append(Candidate(s, bits, loss() - l_u))
                    restore(u.targets, uniform)
            if progress and s != now:
                progress(1)
        cands[u.name] = out
    return l_u, cands


def monotone(cands: Sequence[Candidate]) -> list[Candidate]:
    """The candidates with costs made to fall with size (ties: the larger level, by a hair).

    A level of more bits measured dearer than one of fewer is noise of the allocation
    documents (the levels of a ladder are nested or nearly so); the hair lets the allocator
    spend leftover bits on such upgrades, so the allocation fills its size.
    """
    order = sorted(range(len(cands)), key=lambda i: cands[i].bits)
    out = list(cands)
    best = float("inf")
    for i in order:
        best = min(best, cands[i].cost)
        out[i] = Candidate(cands[i].setting, cands[i].bits, best - 1e-12 * cands[i].bits)
    return out


def _applied(t: Target, s: Setting, original: Mapping[str, torch.Tensor], stats, prot: Mapping[str, object]):
    """Target ``t``'s original weight compressed at ``s`` (its calibration statistics and protection)."""
    return s.apply(t.name, original[t.name], stats_for(t, s, stats), prot.get(t.name), acc.BASE_BITS)


def _hold(units: Sequence[Unit], choice: Mapping[str, Setting], original, stats, prot) -> None:
    """Put each unit's matrices at its chosen level."""
    for u in units:
        for t in u.targets:
            t.set(_applied(t, choice[u.name], original, stats, prot).weight)


def measured_allocation(
    model: nn.Module, tokenizer, keep: Sequence[str], base: Setting, targets: Sequence[Target], goal: int,
    levels: Sequence[Setting], prot: Mapping[str, object], stats, unit: str = "kind", n_levels: int = 6,
    samples: int = 32, log: Callable[[str], None] | None = None, progress: bool = True, replay: bool = True,
    rounds: int = 1, include_path: Sequence[str] = (),
) -> tuple[list[Override], dict]:
    """Per-unit overrides of ``base`` at most ``goal`` bits, least measured loss of ``keep``; and what chose them.

    ``levels``: the method's candidate levels (thinned to ``n_levels`` by :func:`ladder`);
    ``prot``: each target's protection; ``replay``: reuse the outputs of the blocks before each
    unit (:class:`~capsense.core.replay.BlockReplay`: blocks before a unit's layer hold the uniform
    weights while it is measured, so they hand on their recorded outputs; on SmolLM2 this halves the time); ``rounds`` > 1 measures again around the previous round's allocation
    and allocates from those costs (interactions the first round's uniform context misses). ``include_path``:
    folders of task YAMLs declaring kept capabilities.
    The model's weights are the same on return.
    """
    from tqdm.auto import tqdm

    log = log or (lambda _m: None)
    units = units_of(targets, unit)
    sample = [] if base.calibrated else [t.get() for t in targets[:: max(1, len(targets) // 8)]]
    ladder_ = ladder(base, levels, n_levels, sample)
    probes = allocation_probes(model, tokenizer, keep, samples, include_path)
    original = snapshot(targets)
    log(f"measured sensitivity: {len(units)} units x {len(ladder_) - 1} levels x {rounds} round(s) "
        f"({', '.join(s.label for s in ladder_)}) on {samples} documents of {', '.join(keep)}")
    bar = tqdm(total=rounds * len(units) * (len(ladder_) - 1), desc="sensitivity", unit="fwd", disable=not progress)
    choice = {u.name: base for u in units}
    losses = []
    try:
        for _ in range(rounds):
            _hold(units, choice, original, stats, prot)
            l_now, cands = measure_costs(units, ladder_, base, original, stats, prot, lambda: probe_loss(model, probes),
                                         bar.update, BlockReplay(model) if replay else None, held=choice)
            losses.append(l_now)
            chosen = allocate({k: monotone(cs) for k, cs in cands.items()}, goal)
            choice = {k: c.setting for k, c in chosen.items()}
    finally:
        bar.close()
        restore(targets, original)
    by_name = {u.name: u for u in units}
    overrides = [by_name[k].override(c.setting) for k, c in chosen.items() if c.setting != base]
    info = {
        "unit": unit, "levels": [s.label for s in ladder_], "allocation_documents": samples, "rounds": rounds,
        "uniform_loss": losses[0], "round_losses": losses, "estimated_cost": sum(c.cost for c in chosen.values()),
        "allocated_bits": sum(c.bits for c in chosen.values()),
        "per_unit": {k: c.setting.label for k, c in chosen.items()},
        "measured_costs": {k: {c.setting.label: round(c.cost, 5) for c in cs} for k, cs in cands.items()},
    }
    return overrides, info

"""A guided sequential run, shared by the tests that check it (test_compress_guided_sequential: it is the one-pass
run; test_compress_spill: on disk it is the in-memory run, and with the Fisher summed a group of layers at a time).

A module imported by name (``from _guided_run import run_guided_sequential``), as tests/_toy_task.py is, not a
conftest.py here: a second conftest.py outside a package is imported as the top-level module ``conftest`` too and
replaces the root one, so every ``from conftest import make_tiny_model`` collected after it fails; making this
folder a package instead breaks its tests' imports of each other by name (``from test_compress_fit import ...``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from conftest import make_char_tokenizer, make_tiny_model

import capsense.compress.guided_sequential as gs
from capsense.compress.budget import uniform_budget
from capsense.compress.calibration import calibration_samples
from capsense.compress.select import compress_guided
from capsense.compress.sequential import compress_sequential


class GuidedRun(NamedTuple):
    """What a guided sequential run gives: the model (compressed), the candidate allocations ((name,
    Allocation), ``guided`` first), what shipped ((result, budget, allocation): ``compress_guided``) and the
    calibration samples (token ids)."""

    model: Any
    allocations: list
    shipped: tuple
    samples: Sequence[Sequence[int]]


def run_guided_sequential(arch: str, overrides: dict, setting: dict, guide, calibration: str, n: int) -> GuidedRun:
    """A guided run one decoder layer at a time on a tiny ``arch`` model (config ``overrides``), at ``setting``'s
    size, on ``n`` texts of ``calibration``: the candidates priced layer by layer
    (``guided_candidates_sequential``), each compressed layer by layer on the original outputs, one shipped."""
    model, tok = make_tiny_model(arch, **overrides), make_char_tokenizer()
    uni = uniform_budget(setting)
    samples, _ = calibration_samples(calibration, tok, n)
    allocations = gs.guided_candidates_sequential(model, tok, uni, samples, guide)
    shipped = compress_guided(model, tok, uni, allocations, None, guide,
                              compress=lambda b: compress_sequential(model, b, samples, "original"))
    return GuidedRun(model, allocations, shipped, samples)

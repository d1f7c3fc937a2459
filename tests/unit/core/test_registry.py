"""The one registry type: explicit and lazy entries, one message for an unknown name."""

from __future__ import annotations

import sys

import pytest

from capsense.core.registry import Registry
from capsense.errors import CapsenseError


class OwnError(CapsenseError):
    pass


def test_explicit_and_lazy_entries_and_the_unknown_message():
    r: Registry = Registry("solver", "solvers", OwnError)
    r.register("a", 1)

    @r.register("b")
    def b():
        return 2

    r.register_lazy("c", "json:dumps")
    assert r.names() == ["a", "b", "c"] and "c" in r and len(r) == 3
    assert r["a"] == 1 and r["b"] is b and r.get("zzz") is None
    import json

    assert r["c"] is json.dumps
    with pytest.raises(OwnError, match=r"^unknown `solver` 'x': valid solvers are a, b, c$"):
        r.check("x")
    with pytest.raises(OwnError):
        r["x"]
    assert r.help() == "a, b, c"


def test_lazy_entries_import_nothing_until_used():
    r: Registry = Registry("thing", "things")
    r.register_lazy("heavy", "capsense_no_such_module_xyz:X")
    assert r.check("heavy") == "heavy" and r.names() == ["heavy"]  # no import attempted
    assert "capsense_no_such_module_xyz" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        r["heavy"]


def test_every_registry_is_a_registry_and_the_cli_lists_them():
    from click.testing import CliRunner

    from capsense.cli import main
    from capsense.compress.lowrank import FACTORIZERS
    from capsense.compress.measured_sensitivity import UNITS
    from capsense.compress.methods import METHODS as COMPRESSION_METHODS
    from capsense.compress.study.grid_spec import GRID_AXES
    from capsense.compress.study.select import PREDICTORS, SIZE_KEYS
    from capsense.localize.designs import DESIGNS
    from capsense.localize.registry import METHODS
    from capsense.localize.solvers import SOLVERS
    from capsense.ship.base import FORMATS

    for reg in (FACTORIZERS, UNITS, COMPRESSION_METHODS, GRID_AXES, PREDICTORS, SIZE_KEYS, DESIGNS, METHODS, SOLVERS,
                FORMATS):
        assert isinstance(reg, Registry) and len(reg) > 0
    assert METHODS["prior-guided"].name == "prior-guided"  # declared in the registry, imported on use
    locate_help = " ".join(CliRunner().invoke(main, ["locate", "--help"]).output.split())
    for name in [*METHODS, *DESIGNS, *SOLVERS]:
        assert name in locate_help, name
    compress_help = " ".join(CliRunner().invoke(main, ["compress", "--help"]).output.split())
    assert all(name in compress_help for name in COMPRESSION_METHODS)

"""Every fixed list of values a command offers is the library's own list.

The commands spell their ``click.Choice`` lists out rather than import the modules that define them,
so that parsing a command line imports neither torch nor numpy (bad input is refused in a fraction of a
second). That leaves each list a twin of a library constant; this test is what keeps the twins equal,
and it fails for a new ``click.Choice`` until the constant behind it is named here.
"""

import click
import pytest

from capsense.cli import main


def _library_lists() -> dict[tuple[str, str], tuple[str, ...]]:
    from capsense.compress.compensated import PRICING_NAMES, SOLVE_ON
    from capsense.compress.packed import FORMATS as PACKED_FORMATS
    from capsense.compress.sequential import PROPAGATE
    from capsense.compress.study.select import SIZE_KEYS
    from capsense.core.ablation import ABLATION_MODES
    from capsense.core.models import DTYPES, TRAIN_DTYPES
    from capsense.core.precision import AUTOCAST_DTYPES
    from capsense.localize.prior import GROUP_PRICES, PRIOR_SCORES
    from capsense.localize.refine import SEARCHES, SET_CONTROLS
    from capsense.localize.screen import SINGLE_CONTROLS
    from capsense.ship.base import FORMATS as EXPORT_FORMATS

    loaded = DTYPES[1:]  # a dtype to load in: every one but auto
    return {
        ("compress", "solve_on"): SOLVE_ON,
        ("compress", "dtype"): loaded,
        ("compress", "save_dtype"): DTYPES,
        ("compress", "pricing"): PRICING_NAMES,
        ("compress", "fmt"): ("auto", *PACKED_FORMATS),  # pipeline.resolve_format: auto, then a packed format
        ("compress", "sequential_propagate"): PROPAGATE,
        ("distill", "dtype"): TRAIN_DTYPES,
        ("evaluate", "ablation"): ABLATION_MODES,
        ("evaluate", "dtype"): loaded,
        ("export", "format"): tuple(EXPORT_FORMATS),
        ("export", "ablation"): ABLATION_MODES,
        ("export", "dtype"): DTYPES,
        ("validate", "ablation"): ABLATION_MODES,
        ("grid", "dtype"): loaded,
        ("locate", "ablation"): ABLATION_MODES,
        ("locate", "prior_score"): PRIOR_SCORES,
        ("locate", "group_price"): GROUP_PRICES,
        ("locate", "single_controls"): SINGLE_CONTROLS,
        ("locate", "set_controls"): SET_CONTROLS,
        ("locate", "refine_dtype"): loaded,
        ("locate", "refine_search"): SEARCHES,
        ("locate", "dtype"): DTYPES,
        ("locate", "autocast"): AUTOCAST_DTYPES,
        ("measure", "dtype"): loaded,
        ("select", "size_key"): tuple(SIZE_KEYS),
        ("validate", "dtype"): loaded,
    }


def _cli_lists() -> dict[tuple[str, str], tuple[str, ...]]:
    ctx = click.Context(main)
    found = {}
    for name in main.list_commands(ctx):
        for p in main.get_command(ctx, name).params:
            if isinstance(p.type, click.Choice):
                found[(name, p.name)] = tuple(p.type.choices)
    return found


def test_every_choice_a_command_offers_is_named_here():
    cli, library = _cli_lists(), _library_lists()
    assert sorted(cli) == sorted(library), "a command's click.Choice without its library constant here (or gone)"


@pytest.mark.parametrize("key", sorted(_library_lists()), ids=lambda k: f"{k[0]}-{k[1]}")
def test_choice_is_the_library_list(key):
    cli = _cli_lists()[key]
    assert len(cli) == len(set(cli))
    assert set(cli) == set(_library_lists()[key])


def test_a_default_is_one_of_the_choices():
    ctx = click.Context(main)
    for name in main.list_commands(ctx):
        for p in main.get_command(ctx, name).params:
            if isinstance(p.type, click.Choice) and isinstance(p.default, str):
                assert p.default in p.type.choices, (name, p.name, p.default)


def test_locate_defaults_are_the_library_defaults():
    """``capsense locate``'s defaults spell out :class:`LocateConfig`'s, for the same reason as the lists
    above; a default changed in one place only would make the command and the library run differently."""
    import dataclasses

    from capsense.localize.config import LocateConfig

    library = {f.name: f.default for f in dataclasses.fields(LocateConfig) if f.default is not dataclasses.MISSING}
    cli = {p.name: p.default for p in main.get_command(click.Context(main), "locate").params}
    cli["masks_per_forward"] = None if cli["masks_per_forward"] == "auto" else cli["masks_per_forward"]  # auto: None
    shared = {n for n in library if n in cli and isinstance(cli[n], (str, int, float, type(None)))}
    assert {"budget", "top_m", "group_size", "prior_score", "group_price", "tolerance", "top_k", "screen"} <= shared
    assert {n: cli[n] for n in shared} == {n: library[n] for n in shared}

"""Renamed options keep their old names for one release: accepted, noted on stderr, hidden from --help."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from capsense.cli import main
from capsense.commands.options import old_name, with_old_name


@pytest.fixture
def probe_command():
    @click.command("probe-old-names")
    @click.option("--fe-budget", "budget", type=float, default=50.0)
    @old_name("--budget", "--fe-budget", "budget", type=float)
    def probe(budget):
        click.echo(f"budget={with_old_name('budget', budget, '--fe-budget')}")

    main.add_command(probe)
    yield probe
    main.commands.pop("probe-old-names")


def test_old_name_gives_its_value_with_a_note(probe_command):
    r = CliRunner().invoke(main, ["probe-old-names", "--budget", "6"])
    assert r.exit_code == 0 and "budget=6.0" in r.stdout
    assert "Note: --budget is deprecated and will be removed in the next release: use --fe-budget" in r.stderr
    r = CliRunner().invoke(main, ["probe-old-names", "--fe-budget", "7"])
    assert r.exit_code == 0 and "budget=7.0" in r.stdout and "Note" not in r.stderr
    r = CliRunner().invoke(main, ["probe-old-names"])
    assert "budget=50.0" in r.stdout
    r = CliRunner().invoke(main, ["probe-old-names", "--fe-budget", "7", "--budget", "6"])
    assert r.exit_code == 2 and "give --fe-budget or its old name --budget, not both" in r.output


@pytest.mark.parametrize("command, new, old", [
    ("locate", "--fe-budget", "--budget"), ("locate", "--no-progress", "--quiet"), ("run", "--no-progress", "--quiet"),
    ("compress", "--budget-file", "--budget"), ("select", "--max-size", "--budget"),
])
def test_commands_list_the_new_name_and_accept_the_old(command, new, old):
    help_text = CliRunner().invoke(main, [command, "--help"]).output
    assert new in help_text and f"{old} " not in help_text.replace(f"{old}-", "")
    cmd = main.get_command(None, command)
    assert any(old in p.opts and p.hidden for p in cmd.params if isinstance(p, click.Option)), (command, old)


def test_locate_takes_the_old_budget_flag_before_anything_heavy():
    r = CliRunner().invoke(main, ["locate", "smollm2-135m", "--task", "capsense_induction", "--budget", "6",
                                  "--method", "nosuch", "--out", "/nonexistent/run"])
    assert r.exit_code == 1 and "Note: --budget is deprecated" in r.stderr
    assert "unknown --method 'nosuch'" in r.output

"""The ``capsense`` command line: one click group, one subcommand per step of the data flow."""

from __future__ import annotations

import click

from capsense import __version__


class CapsenseError(click.ClickException):
    """A user-facing error: printed as ``Error: <message>`` with exit status 1, no traceback."""


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="capsense")
def main() -> None:
    """Find the attention heads a capability depends on, prove it, ship the edited model."""


def _register() -> None:
    from capsense.commands.evaluate import evaluate
    from capsense.commands.export import export
    from capsense.commands.locate import locate
    from capsense.commands.push import push
    from capsense.commands.run import run
    from capsense.commands.validate import validate

    for command in (evaluate, export, locate, push, run, validate):
        main.add_command(command)

    from capsense.commands.compress import compress; main.add_command(compress)  # noqa: E702
    from capsense.commands.measure import measure; main.add_command(measure)  # noqa: E702
    from capsense.commands.grid import grid; main.add_command(grid)  # noqa: E702
    from capsense.commands.fit import fit; main.add_command(fit)  # noqa: E702
    from capsense.commands.select import select; main.add_command(select)  # noqa: E702


_register()

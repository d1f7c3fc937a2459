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

    for command in (evaluate, export, locate, push):
        main.add_command(command)


_register()

if __name__ == "__main__":
    main()

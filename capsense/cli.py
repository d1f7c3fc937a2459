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


# The data flow, in order: evaluate, locate, validate, run (a recipe), export, push, then
# compression. One module per subcommand in capsense/commands/, each named for its command.
COMMANDS = ("evaluate", "locate", "validate", "run", "export", "push", "compress", "measure", "grid", "fit", "select",
            "distill")


def _register() -> None:
    import importlib

    for name in COMMANDS:
        main.add_command(getattr(importlib.import_module(f"capsense.commands.{name}"), name))


_register()

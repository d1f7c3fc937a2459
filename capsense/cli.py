"""The ``capsense`` command line: one click group, one subcommand per step of the data flow.

Errors are turned into messages in exactly one place, :class:`CapsenseGroup`: a
:class:`capsense.errors.CapsenseError` raised anywhere below a command becomes ``Error:
<message>`` with exit status 1, its parameter names mapped to the command's flags; any other
exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import re

import click

from capsense import __version__
from capsense.errors import CapsenseError

# Library messages name parameters in backticks (`top_k`); the CLI shows the flag (--top-k).
_PARAM = re.compile(r"`([a-z_][a-z0-9_]*)`")


def cli_message(message: str, command: click.Command | None) -> str:
    """``message`` with each backticked parameter name that ``command`` has as an option replaced by its flag."""
    flags = {}
    for p in getattr(command, "params", ()):
        if isinstance(p, click.Option) and p.opts:
            flags[p.name] = max(p.opts, key=len)
        elif isinstance(p, click.Argument) and p.name:
            flags[p.name] = p.name.upper()
    return _PARAM.sub(lambda m: flags.get(m.group(1), m.group(0)), message)


class CapsenseGroup(click.Group):
    """A click group that turns :class:`CapsenseError` into one ``Error:`` line (exit 1), and only that.

    As the command line (standalone mode), a process of a multi-process launch ends through
    :func:`capsense.core.distributed.finish`, which skips the native teardown that aborted
    finished runs (see there).
    """

    def main(self, *args, **kwargs):
        try:
            return super().main(*args, **kwargs)
        except SystemExit as e:
            if kwargs.get("standalone_mode", True):  # embedded callers (standalone_mode=False) keep their process
                from capsense.core.distributed import finish

                finish(e.code)  # returns unless this process is one of several
            raise

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except CapsenseError as e:
            name = ctx.invoked_subcommand
            command = self.get_command(ctx, name) if name else None
            message = cli_message(str(e), command)
            from capsense.core.distributed import is_main_process, quiet_exit

            if not is_main_process():  # accelerate launch: every process meets bad input; the main one says it
                quiet_exit(message)
            raise click.ClickException(message) from None


@click.group(cls=CapsenseGroup, context_settings={"help_option_names": ["-h", "--help"]})
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

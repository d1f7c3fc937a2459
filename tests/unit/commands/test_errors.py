"""One error path: CapsenseError -> one `Error:` line (exit 1, flags named as the command spells them);
any other exception is a bug and keeps its traceback."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from capsense.cli import cli_message, main
from capsense.errors import CapsenseError


@pytest.fixture
def probe_command():
    @click.command("probe-errors")
    @click.option("--top-k", type=int, default=1)
    @click.option("--push-to-hub", "push_repo", default=None)
    @click.option("--kind", default="capsense")
    def probe(top_k, push_repo, kind):
        if kind == "capsense":
            raise CapsenseError(f"`top_k` must be at least 1, got {top_k}; `push_repo` too; `unknown_param` stays")
        raise ValueError("a real bug")

    main.add_command(probe)
    yield probe
    main.commands.pop("probe-errors")


def test_capsense_error_is_one_line_with_flags(probe_command):
    r = CliRunner().invoke(main, ["probe-errors", "--top-k", "0"])
    assert r.exit_code == 1
    assert r.output == "Error: --top-k must be at least 1, got 0; --push-to-hub too; `unknown_param` stays\n"


def test_other_exceptions_keep_their_traceback(probe_command):
    r = CliRunner().invoke(main, ["probe-errors", "--kind", "bug"])
    assert isinstance(r.exception, ValueError) and not isinstance(r.exception, CapsenseError)
    assert "Error:" not in r.output
    with pytest.raises(ValueError, match="a real bug"):
        CliRunner().invoke(main, ["probe-errors", "--kind", "bug"], catch_exceptions=False)


def test_cli_message_without_a_command_leaves_the_text():
    assert cli_message("`top_k` is bad", None) == "`top_k` is bad"


def test_no_command_catches_library_errors_itself():
    from pathlib import Path

    import capsense.commands as commands

    for f in Path(commands.__file__).parent.glob("*.py"):
        text = f.read_text()
        assert "except (" not in text, f"{f.name} catches a tuple of errors: let the CLI's one handler do it"
        assert "from capsense.commands." not in text.replace("from capsense.commands.options", "").replace(
            "from capsense.commands.output", ""), f"{f.name} imports another command"

"""What commands print: file sizes, the list of files written, log lines to stderr."""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import click


def human_size(n: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def echo_files(folder: Path, files: Sequence[str]) -> None:
    """Print ``files`` of ``folder`` with their sizes, one per line."""
    width = max((len(f) for f in files), default=0)
    for f in files:
        click.echo(f"  {f:<{width}}  {human_size((folder / f).stat().st_size):>10}")


def echo_written(paths: Sequence[str | os.PathLike]) -> None:
    """The last lines of a command: every file it wrote, one per line."""
    paths = [Path(p) for p in paths]
    if not paths:
        return
    click.echo("Wrote:")
    for p in paths:
        click.echo(f"  {p}")


def log(message: str) -> None:
    """A progress line, to stderr (stdout is for results)."""
    click.echo(message, err=True)


def echo_push(folder: Path, result: Any) -> None:
    """Report a push (or dry run) of ``folder``: where, which files, what changed."""
    total = sum((folder / f).stat().st_size for f in result.files)
    where = f"https://huggingface.co/{result.repo_id}" + (f" (branch {result.revision})" if result.revision else "")
    flags = ", ".join(x for x in ("private" if result.private else "public if new",
                                  "as a pull request" if result.create_pr else "") if x)
    if result.dry_run:
        click.echo(f"Dry run: would upload {len(result.files)} files ({human_size(total)}) to {where} [{flags}]")
        click.echo(f"Commit message: {result.commit_message}")
    else:
        click.echo(f"Uploaded {len(result.files)} files ({human_size(total)}) to {where} [{flags}]")
    echo_files(folder, result.files)
    for note in result.notes:
        click.echo(note)
    if result.card_rendered:
        click.echo(f"README.md now loads from {result.repo_id}")
    if result.url:
        click.echo(f"Done: {result.url}")


def command_line(name: str, command: click.Command, arguments: Sequence[Any], values: Mapping[str, Any]) -> str:
    """``capsense NAME ARGUMENTS --option value ...``: the call of ``command`` that gives each of its parameters the
    value in ``values`` (by parameter name), options at their default left out, flags given when true, a list
    joined by commas, a repeatable option repeated. What ``capsense run --dry-run`` prints for a recipe's steps, so
    that a printed line reruns the step; it printed a hand-picked few options, and the main job's line ran another
    search (without its control limit, top-m, group size and refine budget)."""
    parts = ["capsense", name, *(shlex.quote(str(a)) for a in arguments)]
    for p in command.params:
        if not isinstance(p, click.Option) or p.hidden or p.name not in values:
            continue
        value, flag = values[p.name], p.opts[0]
        if p.is_flag:  # (an --x/--no-x pair: the one that says the value, where it is not the default)
            parts += [] if bool(value) == bool(p.default) else [flag] if value else p.secondary_opts[:1]
        elif p.multiple:
            parts += [x for v in value or () for x in (flag, shlex.quote(str(v)))]
        elif value is not None and value != p.default:
            parts += [flag, shlex.quote(_option_text(value))]
    return " ".join(parts)


def _option_text(value: Any) -> str:
    """A value as an option takes it: a list joined by commas, a float in its shortest exact form (20, not 20.0)."""
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    if isinstance(value, float):
        return f"{value:g}" if float(f"{value:g}") == value else repr(value)
    return str(value)

"""``capsense push``: upload an export folder to the Hugging Face Hub."""

from __future__ import annotations

from pathlib import Path

import click

from capsense.cli import CapsenseError


def human_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def echo_files(folder: Path, files: list[str]) -> None:
    """Print ``files`` of ``folder`` with their sizes, one per line."""
    width = max((len(f) for f in files), default=0)
    for f in files:
        click.echo(f"  {f:<{width}}  {human_size((folder / f).stat().st_size):>10}")


def run_push(
    folder: Path, repo_id: str, *, private: bool, revision: str | None, commit_message: str | None,
    create_pr: bool, dry_run: bool,
) -> None:
    """Push (or dry-run) ``folder`` and report it; :class:`CapsenseError` on failure."""
    from capsense.ship.hub import HubError, push_folder

    try:
        result = push_folder(
            folder, repo_id, private=private, revision=revision, commit_message=commit_message,
            create_pr=create_pr, dry_run=dry_run,
        )
    except HubError as e:
        raise CapsenseError(str(e)) from None
    total = sum((folder / f).stat().st_size for f in result.files)
    where = f"https://huggingface.co/{repo_id}" + (f" (branch {revision})" if revision else "")
    flags = ", ".join(
        x for x in ("private" if private else "public if new", "as a pull request" if create_pr else "") if x
    )
    if dry_run:
        click.echo(f"Dry run: would upload {len(result.files)} files ({human_size(total)}) to {where} [{flags}]")
        click.echo(f"Commit message: {result.commit_message}")
    else:
        click.echo(f"Uploaded {len(result.files)} files ({human_size(total)}) to {where} [{flags}]")
    echo_files(folder, result.files)
    for note in result.notes:
        click.echo(note)
    if result.card_rendered:
        click.echo(f"README.md now loads from {repo_id}")
    if result.url:
        click.echo(f"Done: {result.url}")


@click.command("push")
@click.argument("folder", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("repo_id")
@click.option("--private", is_flag=True, help="Create the repo as private (an existing repo keeps its visibility).")
@click.option("--revision", help="Branch to push to (created if missing).")
@click.option("--commit-message", help="Commit message (default: a capsense upload message).")
@click.option("--create-pr", is_flag=True, help="Open a pull request instead of committing directly.")
@click.option("--dry-run", is_flag=True, help="Print the repo and the files that would be uploaded; send nothing.")
def push(
    folder: Path, repo_id: str, private: bool, revision: str | None, commit_message: str | None,
    create_pr: bool, dry_run: bool,
) -> None:
    """Upload an export FOLDER to the Hub model repo REPO_ID.

    The token comes from HF_TOKEN or `hf auth login` and is never printed. A model card
    written by `capsense export` is re-rendered to load from REPO_ID.
    """
    run_push(
        folder, repo_id, private=private, revision=revision, commit_message=commit_message,
        create_pr=create_pr, dry_run=dry_run,
    )

"""``capsense push``: upload an export folder to the Hugging Face Hub."""

from __future__ import annotations

from pathlib import Path

import click

from capsense.commands.output import echo_push


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
    from capsense.ship.push import push_folder

    result = push_folder(folder, repo_id, private=private, revision=revision, commit_message=commit_message,
                         create_pr=create_pr, dry_run=dry_run)
    echo_push(folder, result)

"""``capsense run``: a recipe (YAML) of locate + validate steps, run end to end."""

from __future__ import annotations

from pathlib import Path

import click

from capsense.commands.options import no_progress_option, old_name, out_option, with_old_name
from capsense.commands.output import echo_written, log


@click.command("run")
@click.argument("recipe", type=click.Path(path_type=Path))
@out_option("Output root (default: the recipe's 'out').", required=False)
@click.option("--dry-run", is_flag=True, help="Print the steps and stop.")
@no_progress_option()
@old_name("--quiet", "--no-progress", "quiet", is_flag=True)
def run(recipe: Path, out: Path | None, dry_run: bool, quiet: bool) -> None:
    """Run RECIPE: locate each target (resumable), then validate its top heads on held-out documents."""
    from capsense.evaluation.recipe import describe_steps, load_recipe, recipe_steps
    from capsense.evaluation.run import check_steps

    quiet = with_old_name("quiet", quiet, "--no-progress")

    data = load_recipe(recipe)
    steps = recipe_steps(data, out)
    check_steps(steps)  # before any heavy import: tasks, model, folders
    from capsense.core.distributed import is_main_process

    if is_main_process():  # under accelerate launch the main process speaks
        click.echo("\n".join(describe_steps(data, steps, recipe.stem)))
    if dry_run:
        return
    from capsense.evaluation.run import run_steps

    for cfg, _ in steps:
        cfg.progress = not quiet
    results = run_steps(steps, log=log, progress=not quiet)

    if not is_main_process():
        return  # under accelerate launch the main process reports
    written = []
    for result in results:
        if result.validation_table:
            click.echo(f"\n{result.task}: top-{result.validation_info['top_k']} = {result.validation_info['heads']}\n"
                       + result.validation_table + f"\nVerdict: {result.validation_info['verdict']['line']}")
        written += result.written
    echo_written(written)

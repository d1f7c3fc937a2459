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
        click.echo("\n".join(describe_steps(data, steps, recipe.stem, _step_lines)))
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


def _step_lines(cfg, val) -> list[str]:
    """The ``capsense locate`` and ``capsense validate`` command lines that run one step of a recipe (the commands
    taken from the running group: a command does not import another)."""
    from capsense.commands.output import command_line

    commands = click.get_current_context().find_root().command.commands
    lines = ["  " + command_line("locate", commands["locate"], [cfg.model], _locate_values(cfg))]
    if val:
        lines.append("  " + command_line("validate", commands["validate"], [cfg.model], _validate_values(cfg, val)))
    return lines


def _locate_values(cfg) -> dict:
    """The parameters of ``capsense locate`` that run ``cfg`` (a :class:`~capsense.localize.config.LocateConfig`): its
    fields by name, and where the option says it another way."""
    from dataclasses import asdict

    values = asdict(cfg)
    values.update(controls=list(cfg.controls) or ["none"], no_prefix_reuse=not cfg.prefix_reuse,
                  masks_per_forward="auto" if cfg.masks_per_forward is None else cfg.masks_per_forward,
                  sparsity=None if cfg.heads_per_mask is not None or cfg.sparsity == 0.02 else cfg.sparsity)
    return values


def _validate_values(cfg, val: dict) -> dict:
    """The parameters of ``capsense validate`` that run a recipe's validate section ``val`` after the locate step
    ``cfg`` (the settings :func:`~capsense.evaluation.run.validate_kwargs` reads)."""
    from capsense.evaluation.run import validate_kwargs

    return {**validate_kwargs(cfg, val), "heads": str(Path(cfg.out) / "heads.json"), "top_k": val.get("top_k", cfg.top_k),
            "tasks": val["tasks"], "out": val["out"]}

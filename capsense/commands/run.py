"""``capsense run``: a recipe (YAML) of locate + validate steps, run end to end."""

from __future__ import annotations

from pathlib import Path

import click

from capsense.cli import CapsenseError


@click.command("run")
@click.argument("recipe", type=click.Path(path_type=Path))
@click.option("--out", help="Output root (default: the recipe's 'out').")
@click.option("--dry-run", is_flag=True, help="Print the steps and stop.")
def run(recipe: Path, out: str | None, dry_run: bool) -> None:
    """Run RECIPE: locate each target (resumable), then validate its top heads on held-out documents."""
    from capsense.evaluation.recipe import RecipeError, load_recipe, recipe_steps

    try:
        data = load_recipe(recipe)
        steps = recipe_steps(data, out)
    except (RecipeError, TypeError) as e:
        raise CapsenseError(str(e)) from None
    from capsense.core.distributed import is_main_process

    say = click.echo if is_main_process() else (lambda *a, **k: None)  # under accelerate launch: the main process
    say(f"Recipe {data.get('name', recipe.stem)}: {len(steps)} target(s); expects "
               f"{data.get('hardware', 'unspecified hardware')}, {data.get('expected_time', 'unspecified time')}")
    for cfg, val in steps:
        say(f"  locate {cfg.model} --task {cfg.task} --controls {','.join(cfg.controls) or '-'} "
                   f"--masks {cfg.masks} --limit {cfg.limit} --out {cfg.out}")
        if val:
            say(f"  validate --top-k {val.get('top_k', 5)} --tasks {','.join(val['tasks'])} --out {val['out']}")
    if dry_run:
        return
    from capsense.localize.locate import LocateError, locate
    from capsense.scoring.probe import ProbeError
    from capsense.localize.store import RunStoreError
    from capsense.evaluation.validate import ValidateError, format_validation, validate, write_validation

    for cfg, val in steps:
        try:
            _, heads_path = locate(cfg, log=lambda m: click.echo(m, err=True))
            if val:
                rows, info = validate(
                    cfg.model, heads_path, int(val.get("top_k", 5)), val["tasks"], n_random=int(val.get("random", 3)),
                    limit=val.get("limit", 100), seed=int(val.get("seed", 0)), batch_size=int(val.get("batch_size", 16)),
                    device=val.get("device", cfg.device), dtype=val.get("dtype", "float32"),
                    device_map=val.get("device_map", cfg.device_map),
                    include_path=val.get("include_path", cfg.include_path),
                    confirm_run_unsafe_code=bool(val.get("confirm_run_unsafe_code", cfg.confirm_run_unsafe_code)),
                    log=lambda m: click.echo(m, err=True),
                )
                if is_main_process():  # under accelerate launch every process evaluates, the main one writes
                    write_validation(Path(val["out"]), rows, info)
                    click.echo(f"\n{cfg.task}: top-{info['top_k']} = {info['heads']}\n" + format_validation(rows))
        except (LocateError, ProbeError, RunStoreError, ValidateError, ValueError, FileNotFoundError) as e:
            raise CapsenseError(f"{cfg.task}: {e}") from None

"""``capsense validate``: prove a heads file on held-out documents against random heads."""

from __future__ import annotations

from pathlib import Path

import click

from capsense.commands.options import (
    ablation_option, mean_reference_option, batch_size_option, csv_list, device_map_from, device_map_option, device_option, dtype_option, include_path_option,
    limit_option, no_progress_option, out_option, revision_from, revision_option,
    top_k_option, unsafe_code_option,
)
from capsense.commands.output import echo_written


@click.command("validate")
@click.argument("model")
@click.option("--heads", "heads", required=True, type=click.Path(path_type=Path),
              help="heads.json of a locate run (its manifest.json says which documents to hold out).")
@top_k_option(None, "Ablate the first K heads (default: the set the run chose).")
@click.option("--tasks", help="Comma-separated lm-eval tasks and suites (default: the run's target, its controls and "
                               "the held-out control suite, which the search never scored).")
@click.option("--tolerance", type=float, default=0.10, show_default=True,
              help="Largest relative worsening of an off-target task for the verdict 'selective'.")
@click.option("--random", "n_random", type=click.IntRange(min=0), default=3, show_default=True,
              help="Random K-head ablations to compare with.")
@ablation_option(None, "What an ablated head's output becomes: zero or mean (default: what the heads file's run "
                       "located under; zero for a file from before the setting).")
@mean_reference_option("Default: the run's, when --ablation is the run's.")
@limit_option(100, "Held-out documents per task.")
@click.option("--seed", type=int, default=0, show_default=True)
@batch_size_option(auto=True)
@device_option()
@device_map_option()
@dtype_option()
@revision_option(located=True)
@include_path_option()
@unsafe_code_option()
@out_option("Folder for validation.json/.md/.png.")
@no_progress_option()
def validate(model: str, heads: Path, top_k: int, tasks: str | None, tolerance: float, n_random: int, ablation: str | None,
             mean_reference: str | None, limit: int, seed: int,
             batch_size: int | str, device: str, device_map: str | None, parallelize: bool, dtype: str, revision: str | None, include_path: tuple[str, ...], confirm_run_unsafe_code: bool,
             out: Path, quiet: bool) -> None:
    """Evaluate MODEL as is, with the top-K heads of --heads ablated, and with random K heads ablated."""
    from capsense.core.placement import check_placement
    from capsense.evaluation.validate import check_validate

    task_list = csv_list(tasks) if tasks else None
    revision = revision_from(heads, model, revision)
    check_validate(model, heads, top_k, task_list, limit, include_path, out, tolerance,  # before any heavy import
                   ablation=ablation, mean_reference=mean_reference, revision=revision)
    device_map = device_map_from(device_map, parallelize)
    check_placement(device, device_map)
    from capsense.core.progress import Phase, RunProgress
    from capsense.evaluation.validate import format_validation, validate as run_validate, write_validation

    progress = RunProgress([Phase("validate", 2 + n_random, "conditions")], enabled=not quiet)
    with progress.phase("validate") as phase:
        rows, info = run_validate(
            model, heads, top_k, task_list, n_random=n_random, limit=limit, seed=seed, batch_size=batch_size,
            device=device, dtype=dtype, include_path=list(include_path), device_map=device_map,
            confirm_run_unsafe_code=confirm_run_unsafe_code, log=progress.write, progress=phase, tolerance=tolerance,
            ablation=ablation, mean_reference=mean_reference, out=out, revision=revision,
        )
    progress.close()
    from capsense.core.distributed import is_main_process

    if not is_main_process():
        return  # under accelerate launch the main process writes and prints
    written = write_validation(out, rows, info)
    click.echo(format_validation(rows))
    click.echo(f"\nVerdict: {info['verdict']['line']}")
    echo_written(written)

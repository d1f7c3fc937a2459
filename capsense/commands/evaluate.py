"""``capsense evaluate``: lm-eval tasks on a model with and without ablated heads."""

from __future__ import annotations


import click

from capsense.commands.options import (
    ablation_option, batch_size_option, csv_list, device_map_from, device_map_option, device_option, dtype_option,
    heads_option, include_path_option, limit_option, mean_reference_option, no_progress_option, out_option, revision_from,
    revision_option, top_k_option,
)
from capsense.commands.output import echo_written

DEFAULT_TASKS = "capsense_induction,capsense_addition,capsense_arithmetic,capsense_code,capsense_prose,capsense_antonyms"


@click.command()
@click.argument("model")
@heads_option(required=False)
@top_k_option()
@ablation_option(None, "What an ablated head's output becomes: zero or mean (default: what the heads file's run "
                       "located under, as validate and export apply it; zero for a spec).")
@mean_reference_option("Default: the run's, when --ablation is the run's.")
@click.option("--tasks", default=DEFAULT_TASKS, show_default=True, help="Comma-separated lm-eval tasks.")
@limit_option(None, "Documents per task (the first N).")
@batch_size_option(auto=True)
@device_option()
@device_map_option()
@dtype_option()
@revision_option(located=True)
@include_path_option()
@out_option("Write the table as JSON to this file.", required=False, file=True)
@no_progress_option()
def evaluate(model, heads, top_k, ablation, mean_reference, tasks, limit, batch_size, device, device_map, parallelize,
             dtype, revision, include_path, out, quiet):
    """Evaluate MODEL on lm-eval TASKS, as is and with HEADS ablated, and print the table."""
    from capsense.core.ablation import located_ablation
    from capsense.core.placement import check_placement
    from capsense.evaluation.evaluate import check_evaluate, run_evaluate

    task_list = csv_list(tasks)
    revision = revision_from(heads, model, revision)
    head_set = check_evaluate(model, heads, top_k, task_list, limit, include_path, out, revision,
                              ablation=ablation, mean_reference=mean_reference)  # before any heavy import
    device_map = device_map_from(device_map, parallelize)
    check_placement(device, device_map)
    from capsense.core.heads import looks_like_heads_file

    ablation, mean_reference = located_ablation(heads, ablation, mean_reference)
    table, written = run_evaluate(model, head_set, task_list, ablation=ablation, mean_reference=mean_reference,
                                  limit=limit, batch_size=batch_size, device=device,
                                  device_map=device_map, dtype=dtype,
                                  include_path=include_path, out=out, revision=revision, progress=not quiet,
                                  heads_file=heads if heads and looks_like_heads_file(heads) else None)
    click.echo(table)
    echo_written(written)

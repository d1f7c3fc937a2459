"""``capsense evaluate``: lm-eval tasks on a model with and without ablated heads."""

from __future__ import annotations

import json
from pathlib import Path

import click

from capsense.cli import CapsenseError

DEFAULT_TASKS = "capsense_induction,capsense_addition,capsense_arithmetic,capsense_code,capsense_prose,capsense_antonyms"


@click.command()
@click.argument("model")
@click.option("--heads", default=None, help="Heads to ablate: 'L3H1+L5H0' or a heads JSON file.")
@click.option("--top-k", type=int, default=None, help="Keep the first K heads of a ranked heads file.")
@click.option("--ablation", type=click.Choice(["zero", "mean"]), default="zero", show_default=True)
@click.option("--tasks", default=DEFAULT_TASKS, show_default=True, help="Comma-separated lm-eval tasks.")
@click.option("--limit", type=int, default=None, help="Documents per task (the first N).")
@click.option("--batch-size", type=int, default=16, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--dtype", default="float32", show_default=True)
@click.option("--include-path", multiple=True, help="Extra folders of lm-eval task YAMLs.")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Write the table as JSON here.")
def evaluate(model, heads, top_k, ablation, tasks, limit, batch_size, device, dtype, include_path, out):
    """Evaluate MODEL on lm-eval TASKS, as is and with HEADS ablated, and print the table."""
    from capsense.evaluation.evaluate import evaluate_head_sets, format_table, load_lm
    from capsense.core.heads import HeadSet, HeadSpecError
    from capsense.tasks import task_manager

    task_list = [t.strip() for t in tasks.split(",") if t.strip()]
    try:
        head_set = HeadSet.parse(heads, top_k=top_k) if heads else HeadSet()
        task_manager(include_path, task_list)  # unknown tasks fail before the model loads
        lm = load_lm(model, ablation=ablation, batch_size=batch_size, device=device, dtype=dtype)
        sets = {"base": HeadSet()}
        if head_set:
            lm.set_heads(head_set)  # validates against the model before any evaluation
            sets[f"ablated ({head_set})" if len(head_set) <= 6 else f"ablated ({len(head_set)} heads)"] = head_set
        rows = evaluate_head_sets(lm, sets, task_list, limit=limit, include_path=include_path)
    except (HeadSpecError, ValueError, FileNotFoundError) as e:
        raise CapsenseError(str(e)) from None
    click.echo(format_table(rows))
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps([r.__dict__ for r in rows], indent=2) + "\n")

"""``capsense validate``: prove a heads file on held-out documents against random heads."""

from __future__ import annotations

from pathlib import Path

import click

from capsense.cli import CapsenseError


@click.command("validate")
@click.argument("model")
@click.option("--heads", "heads_path", required=True, type=click.Path(path_type=Path),
              help="heads.json of a locate run (its manifest.json says which documents to hold out).")
@click.option("--top-k", type=int, default=5, show_default=True, help="Ablate the first K heads.")
@click.option("--tasks", required=True, help="Comma-separated lm-eval tasks: the target and the controls.")
@click.option("--random", "n_random", type=click.IntRange(min=0), default=3, show_default=True,
              help="Random K-head ablations to compare with.")
@click.option("--limit", type=int, default=100, show_default=True, help="Held-out documents per task.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--batch-size", type=int, default=16, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--device-map", help="Spread the model over devices: auto (= lm-eval's parallelize=True), or a JSON map.")
@click.option("--dtype", default="float32", show_default=True)
@click.option("--include-path", multiple=True, type=click.Path(exists=True, file_okay=False), help="Extra lm-eval task folder.")
@click.option("--confirm-run-unsafe-code", is_flag=True,
              help="Allow tasks that execute model-written code (HumanEval, MBPP), as lm-eval requires.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Folder for validation.json/.md/.png.")
def validate(model: str, heads_path: Path, top_k: int, tasks: str, n_random: int, limit: int, seed: int,
             batch_size: int, device: str, device_map: str | None, dtype: str, include_path: tuple[str, ...], confirm_run_unsafe_code: bool, out: Path) -> None:
    """Evaluate MODEL as is, with the top-K heads of --heads ablated, and with random K heads ablated."""
    from capsense.core.distributed import is_main_process
    from capsense.core.heads import HeadSpecError
    from capsense.evaluation.validate import ValidateError, format_validation, validate as run_validate, write_validation

    task_list = [t.strip() for t in tasks.split(",") if t.strip()]
    if limit is not None and limit < 1:
        raise CapsenseError(f"--limit must be at least 1, got {limit}")
    try:
        rows, info = run_validate(
            model, heads_path, top_k, task_list, n_random=n_random, limit=limit, seed=seed, batch_size=batch_size,
            device=device, dtype=dtype, include_path=list(include_path), device_map=device_map,
            confirm_run_unsafe_code=confirm_run_unsafe_code, log=lambda m: click.echo(m, err=True),
        )
    except (ValidateError, HeadSpecError, ValueError, FileNotFoundError) as e:
        raise CapsenseError(str(e)) from None
    if not is_main_process():
        return  # several processes (accelerate launch): the main one writes and prints
    write_validation(out, rows, info)
    click.echo(format_validation(rows))
    click.echo(f"Wrote validation.json, validation.md and validation.png in {out}")

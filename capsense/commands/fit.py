"""``capsense fit``: fit the compact pruning relation, its per-density baseline and the
stable-rank predictor from a grid file; predict unmeasured densities."""

from __future__ import annotations

import json
from pathlib import Path

import click

from capsense.commands.output import echo_written


@click.command("fit")
@click.argument("grid_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--report", "report_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write report.md, fits.json and plots to this folder.")
@click.option("--predict", "predict_densities", default=None, help="Densities to predict dL for, e.g. 0.75,0.65.")
@click.option("--method", default=None, help="Pruning method for --predict (default: every fitted one).")
@click.option("--allow-extrapolation", is_flag=True, help="Predict outside the measured density range (flagged).")
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the fits as JSON.")
def fit(grid_file, report_dir, predict_densities, method, allow_extrapolation, json_out):
    """Fit predictors to GRID_FILE (from capsense grid) and report held-out errors."""
    from capsense.compress.study.analysis import fit_grid, predict_pruning
    from capsense.compress.study.grid import read_records
    from capsense.compress.study.predictors import FitError
    from capsense.compress.study.report import fits_markdown, write_report

    from capsense.core.files import atomic_write_text

    try:
        densities = [float(x) for x in predict_densities.split(",")] if predict_densities else []
    except ValueError:
        raise FitError(f"`predict_densities` must be comma-separated numbers, got {predict_densities!r}") from None
    records = read_records(grid_file)
    if not records:
        raise FitError(f"{grid_file} holds no measurements")
    fits = fit_grid(records)
    click.echo(fits_markdown(fits))
    if densities:
        methods = [method] if method else list(fits["pruning"])
        if not methods:
            raise FitError("the grid has no pruning measurements to predict from")
        for m in methods:
            for d in densities:
                pred = predict_pruning(fits, m, d, allow_extrapolation=allow_extrapolation)
                for cap, p in pred.items():
                    flag = "  EXTRAPOLATED outside [%g, %g]" % tuple(p["range"]) if p["extrapolated"] else ""
                    click.echo(f"predict {m} d={d:g} {cap}: dL {p['dL']:+.4f} nats/token{flag}")
    written = []
    if json_out:
        written.append(atomic_write_text(json_out, json.dumps(fits, indent=1, default=float) + "\n"))
    if report_dir:
        path = write_report(records, fits, report_dir)
        click.echo(f"report: {path}")
        written.append(path)
    echo_written(written)

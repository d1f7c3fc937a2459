"""``capsense fit``: fit the compact pruning relation, its per-density baseline and the
stable-rank predictor from grid files (several models: also across them); predict unmeasured densities."""

from __future__ import annotations

import json
from pathlib import Path

import click

from capsense.commands.output import echo_written


@click.command("fit")
@click.argument("grid_files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--report", "report_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write report.md, fits.json and plots to this folder.")
@click.option("--predict", "predict_densities", default=None, help="Densities to predict dL for, e.g. 0.75,0.65.")
@click.option("--method", default=None, help="Pruning method for --predict (default: every fitted one).")
@click.option("--allow-extrapolation", is_flag=True, help="Predict outside the measured density range (flagged).")
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the fits as JSON.")
def fit(grid_files, report_dir, predict_densities, method, allow_extrapolation, json_out):
    """Fit predictors to GRID_FILES (from capsense grid) and report held-out errors.

    Several files (one grid per model) are pooled and also fitted across models: a shared
    density response, a held-out model, and the stable-rank line of one model scored on another."""
    from capsense.compress.study.fits import fit_grid_file
    from capsense.compress.study.report import fits_markdown, write_report
    from capsense.core.files import atomic_write_text
    from capsense.errors import CapsenseError

    try:
        densities = [float(x) for x in predict_densities.split(",")] if predict_densities else []
    except ValueError:
        raise CapsenseError(f"`predict_densities` must be comma-separated numbers, got {predict_densities!r}") from None
    fitted = fit_grid_file(grid_files, densities, method, allow_extrapolation)
    fits = fitted.fits
    click.echo(fits_markdown(fits))
    for p in fitted.predictions:
        flag = "  EXTRAPOLATED outside [%g, %g]" % tuple(p["range"]) if p["extrapolated"] else ""
        click.echo(f"predict {p['method']} d={p['density']:g} {p['capability']}: dL {p['dL']:+.4f} nats/token{flag}")
    written = []
    if json_out:
        written.append(atomic_write_text(json_out, json.dumps(fits, indent=1, default=float) + "\n"))
    if report_dir:
        path = write_report(fitted.records, fits, report_dir)
        click.echo(f"report: {path}")
        written.append(path)
    echo_written(written)

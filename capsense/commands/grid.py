"""``capsense grid``: measure a grid of compression settings x capabilities, resumably."""

from __future__ import annotations


import click

from capsense.commands.options import (
    device_map_from, device_map_option, device_option, dtype_option, include_path_option, no_progress_option, out_option,
    revision_option,
)
from capsense.commands.output import log


def _floats(text: str | None) -> list[float]:
    from capsense.errors import CapsenseError

    try:
        return [float(x) for x in text.split(",") if x.strip()] if text else []
    except ValueError:
        raise CapsenseError(f"expected comma-separated numbers, got {text!r}") from None


@click.command("grid")
@click.argument("model", required=False)
@click.option("--spec", "spec_file", type=click.Path(dir_okay=False), default=None,
              help="Grid YAML (model, capabilities, probes, settings); command-line values override it.")
@click.option("--methods", default=None, help="Comma-separated methods for the density/bits/ratio lists below.")
@click.option("--densities", default=None, help="Pruning densities, e.g. 0.9,0.8,0.7,0.6,0.5.")
@click.option("--bits", "bits_list", default=None, help="Bit widths of the quantizers (rtn, gptq), e.g. 8,4,3.")
@click.option("--group-size", type=int, default=None, help="Group size of the quantizers (rtn, gptq) [default: 128].")
@click.option("--ratios", default=None, help="Low-rank parameter ratios, e.g. 0.9,0.8,0.7,0.6.")
@click.option("--targets", default=None, help="attn, mlp or attn,mlp (default both).")
@click.option("--capabilities", default=None, help="Comma-separated capabilities (default math,code,qa; any lm-eval task, "
              "a user's with --include-path).")
@click.option("--probes", type=int, default=None, help="Probe documents per capability (default 64).")
@dtype_option(None, help="Dtype to load and compress in (default: the spec's, else float32).")
@click.option("--calibration", default=None, help="Calibration sources (default prose,math,code,qa; refused where no "
              "method of the grid calibrates).")
@click.option("--calibration-samples", type=int, default=None)
@device_option()
@device_map_option()
@revision_option()
@include_path_option()
@out_option("JSONL file (appended; resumed).", file=True)
@no_progress_option()
def grid(model, spec_file, methods, densities, bits_list, group_size, ratios, targets, capabilities, probes, dtype,
         calibration, calibration_samples, device, device_map, parallelize, revision, include_path, out, quiet):
    """Measure every (method, setting) x capability of a grid; one JSONL line per measurement.

    Re-running the same command skips the measurements the file already holds.
    """
    from capsense.core.models import check_model
    from capsense.core.placement import check_placement
    from capsense.errors import CapsenseError

    placed = device_map_from(device_map, parallelize)
    check_placement(device, placed)  # before any heavy import
    if model:
        check_model(model, revision)
    elif not spec_file:
        raise CapsenseError("give `model` (or `spec_file` FILE)")
    from capsense.compress.study.grid import grid_table, run_grid
    from capsense.compress.study.grid_spec import grid_spec

    names = [x.strip() for x in (methods or "").split(",") if x.strip()]
    values = {"densities": _floats(densities) or None, "bits": _floats(bits_list) or None, "ratios": _floats(ratios) or None}
    spec = grid_spec(spec_file, names, values, group_size, model=model, capabilities=capabilities, probes=probes,
                     dtype=dtype, calibration=calibration, calibration_samples=calibration_samples, targets=targets,
                     include_path=list(include_path) or None, revision=revision)
    records = run_grid(spec, out, progress=not quiet, log=log, device=device, device_map=placed)
    click.echo(grid_table(records))
    click.echo(f"{len(records)} measurements in {out}")
    click.echo(f"Wrote:\n  {out}")

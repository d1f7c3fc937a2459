"""``capsense select``: the setting with the lowest predicted capability loss under a size budget."""

from __future__ import annotations

from pathlib import Path

import click

from capsense.commands.options import old_name, with_old_name


@click.command("select")
@click.argument("grid_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--max-size", "budget", type=float, help="Largest allowed size, as a fraction of the dense 16-bit size "
              "(required).")
@old_name("--budget", "--max-size", "budget", type=float)
@click.option("--size", "size_key", default="size_ratio", show_default=True,
              type=click.Choice(["size_ratio", "target_size_ratio", "model_param_ratio", "target_param_ratio"]),
              help="What the budget limits: bits of the whole model or of the compressed matrices, or parameter counts.")
@click.option("--capabilities", default=None, help="Capabilities to protect (default: all in the grid).")
@click.option("--weights", default=None, help="Capability weights, e.g. math=2,code=1.")
def select(grid_file, budget, size_key, capabilities, weights):
    """Pick from GRID_FILE by prediction, and report regret against the best measured setting."""
    from capsense.compress.study.select import select_from_grid
    from capsense.errors import CapsenseError

    budget = with_old_name("budget", budget, "--max-size")
    if budget is None:
        raise CapsenseError("give `budget`: the largest allowed size, as a fraction of the dense 16-bit size")
    w = {}
    for part in (weights or "").split(","):
        if part.strip():
            k, _, v = part.partition("=")
            try:
                w[k.strip()] = float(v)
            except ValueError:
                raise CapsenseError(f"`weights` must look like math=2,code=1, got {part!r}") from None
    caps = [c.strip() for c in capabilities.split(",")] if capabilities else None
    s = select_from_grid(grid_file, budget, size_key, caps, w)
    c, b = s["chosen"], s["best_measured"]
    click.echo(f"budget {size_key} <= {budget:g}: {s['n_feasible']} settings fit, {s['n_predictable']} predictable")
    click.echo(f"chosen: {c['label']} ({c['targets']}) size {c['size']:.3f}, predicted dL {c['predicted']:+.4f}, measured {c['measured']:+.4f}")
    click.echo(f"best measured: {b['label']} ({b['targets']}) size {b['size']:.3f}, measured {b['measured']:+.4f}")
    click.echo(f"regret: {s['regret']:.4f} nats/token")

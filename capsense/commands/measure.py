"""``capsense measure``: per-capability nats/token of a model on fixed offline probe sets."""

from __future__ import annotations

import json

import click

from capsense.commands.options import (
    batch_size_option, device_map_from, device_map_option, device_option, dtype_option, include_path_option, out_option,
    no_progress_option, revision_option,
)
from capsense.commands.output import echo_written


@click.command("measure")
@click.argument("model")
@click.option("--capabilities", default="math,code,qa", show_default=True,
              help="Comma-separated: math, code, qa, arithmetic, addition, induction, prose, antonyms, text, or lm-eval "
                   "task names (capsense's, --include-path's, lm-eval's own); perplexity tasks score whole texts.")
@click.option("--probes", type=int, default=64, show_default=True, help="Probe documents per capability (the first N).")
@batch_size_option()
@device_option()
@device_map_option()
@dtype_option()
@revision_option()
@click.option("--reference", default=None, help="Also measure this model and report dL = L(MODEL) - L(reference).")
@click.option("--reference-revision", default=None, help="Revision (branch, tag or commit) of a Hub --reference "
              "(MODEL and its --revision may be the same Hub model: one revision against another).")
@click.option("--per-doc", is_flag=True, help="Include per-document nats and token counts in the JSON.")
@include_path_option()
@out_option("Write the JSON here (atomically).", required=False, file=True)
@no_progress_option()
def measure(model, capabilities, probes, batch_size, device, device_map, parallelize, dtype, revision, reference,
            reference_revision, per_doc, include_path, out, quiet):
    """Measure MODEL's loss per capability: nats/token of reference completions (prompt masked), or of whole texts."""
    from capsense.compress.capabilities import check_measure

    placed = device_map_from(device_map, parallelize)
    check_measure(model, reference, probes, out, capabilities, include_path, device, placed, revision,  # before any heavy import
                  reference_revision)
    from capsense.compress.capability_loss import measure_models
    from capsense.core.files import atomic_write_text

    doc = measure_models(model, capabilities, probes, batch_size, dtype, reference, per_doc, include_path,
                         device=device, device_map=placed, revision=revision, reference_revision=reference_revision,
                         progress=not quiet)
    result = doc["capabilities"]
    text = json.dumps(doc, indent=2) + "\n"
    for c, v in result.items():
        se = f" (se {v['dL_se']:.4f})" if v.get("dL_se") is not None else ""
        extra = f"  dL {v['dL']:+.4f}{se}" if "dL" in v else ""
        acc = "" if v["acc"] is None else f"  acc {v['acc']:.3f}"
        click.echo(f"{c:12s} {v['nll']:.4f} nats/token{acc}  ({v['n_docs']} docs, {v['n_tokens']} tokens){extra}",
                   err=bool(not out))
    if out:
        echo_written([atomic_write_text(out, text)])
    else:
        click.echo(text, nl=False)

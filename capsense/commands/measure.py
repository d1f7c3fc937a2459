"""``capsense measure``: per-capability nats/token of a model on fixed offline probe sets."""

from __future__ import annotations

import json

import click

from capsense.commands.options import batch_size_option, dtype_option, out_option
from capsense.commands.output import echo_written


@click.command("measure")
@click.argument("model")
@click.option("--capabilities", default="math,code,qa", show_default=True,
              help="Comma-separated: math, code, qa, arithmetic, addition, induction, prose, antonyms.")
@click.option("--probes", type=int, default=64, show_default=True, help="Probe documents per capability (the first N).")
@batch_size_option()
@dtype_option()
@click.option("--reference", default=None, help="Also measure this model and report dL = L(MODEL) - L(reference).")
@click.option("--per-doc", is_flag=True, help="Include per-document nats and token counts in the JSON.")
@out_option("Write the JSON here (atomically).", required=False, file=True)
def measure(model, capabilities, probes, batch_size, dtype, reference, per_doc, out):
    """Measure MODEL's loss (nats/token of reference completions, prompt masked) per capability."""
    from capsense.core.models import check_model
    from capsense.errors import CapsenseError
    from capsense.evaluation.evaluate import check_output_file

    if probes < 1:
        raise CapsenseError(f"`probes` must be at least 1, got {probes}")
    check_output_file(out)  # before any heavy import
    for name in (model, reference):
        if name:
            check_model(name)
    from capsense.compress.capabilities import parse_capabilities
    from capsense.compress.capability_loss import build_probes, measure as run_measure
    from capsense.core.files import atomic_write_text
    from capsense.core.models import load_model

    # NOTE (issue 9): the reference/dL arithmetic below belongs in capsense.compress.capability_loss
    # (helper "compress" owns it); it stays here until that module grows a function for it.
    caps = parse_capabilities(capabilities)
    m, tok = load_model(model, dtype=dtype)
    probe_sets = build_probes(tok, caps, probes)
    result = {c: v.to_dict(per_doc) for c, v in run_measure(m, probe_sets, batch_size).items()}
    doc: dict = {"model": model, "probes": probes, "dtype": dtype, "capabilities": result}
    if reference:
        del m
        r, rtok = load_model(reference, dtype=dtype)
        ref = run_measure(r, build_probes(rtok, caps, probes), batch_size)
        doc["reference"] = reference
        for c in caps:
            result[c]["nll0"] = ref[c].nll
            result[c]["dL"] = result[c]["nll"] - ref[c].nll
    text = json.dumps(doc, indent=2) + "\n"
    for c, v in result.items():
        extra = f"  dL {v['dL']:+.4f}" if "dL" in v else ""
        click.echo(f"{c:12s} {v['nll']:.4f} nats/token  acc {v['acc']:.3f}  ({v['n_docs']} docs, {v['n_tokens']} tokens){extra}", err=bool(not out))
    if out:
        echo_written([atomic_write_text(out, text)])
    else:
        click.echo(text, nl=False)

"""``capsense measure``: per-capability nats/token of a model on fixed offline probe sets."""

from __future__ import annotations

import json
from pathlib import Path

import click

from capsense.cli import CapsenseError


@click.command("measure")
@click.argument("model")
@click.option("--capabilities", default="math,code,qa", show_default=True,
              help="Comma-separated: math, code, qa, arithmetic, addition, induction, prose, antonyms.")
@click.option("--probes", type=int, default=64, show_default=True, help="Probe documents per capability (the first N).")
@click.option("--batch-size", type=int, default=16, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--reference", default=None, help="Also measure this model and report dL = L(MODEL) - L(reference).")
@click.option("--per-doc", is_flag=True, help="Include per-document nats and token counts in the JSON.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Write the JSON here (atomically).")
def measure(model, capabilities, probes, batch_size, dtype, reference, per_doc, out):
    """Measure MODEL's loss (nats/token of reference completions, prompt masked) per capability."""
    from capsense.compress.measure import MeasureError, build_probes, measure as run_measure, parse_capabilities
    from capsense.core.files import atomic_write_text
    from capsense.core.models import load_model
    from capsense.scoring.probe import ProbeError

    try:
        caps = parse_capabilities(capabilities)
        if probes < 1:
            raise MeasureError(f"--probes must be at least 1, got {probes}")
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
    except (MeasureError, ProbeError) as e:
        raise CapsenseError(str(e)) from None
    text = json.dumps(doc, indent=2) + "\n"
    if out:
        atomic_write_text(out, text)
    for c, v in result.items():
        extra = f"  dL {v['dL']:+.4f}" if "dL" in v else ""
        click.echo(f"{c:12s} {v['nll']:.4f} nats/token  acc {v['acc']:.3f}  ({v['n_docs']} docs, {v['n_tokens']} tokens){extra}", err=bool(not out))
    if not out:
        click.echo(text, nl=False)

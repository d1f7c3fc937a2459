"""``capsense distill``: recover a pruned student with knowledge distillation from its teacher."""

from __future__ import annotations

import click

from capsense.commands.options import (
    device_map_from, device_map_option, device_option, dtype_option, include_path_option, no_progress_option,
    out_option, overwrite_option,
)
from capsense.commands.output import echo_written
from capsense.compress.capabilities import DISTILL_SOURCES
from capsense.core.models import TRAIN_DTYPES


@click.command("distill")
@click.argument("student")
@click.option("--teacher", required=True, help="The uncompressed model (Hub id, folder or smollm2-135m).")
@click.option("--epochs", type=int, default=3, show_default=True, help="Passes over the fixed token set.")
@click.option("--sources", default=DISTILL_SOURCES, show_default=True,
              help="Where the training texts come from, as compress's --calibration: capabilities/tasks "
                   "(comma-separated, their last documents; a user's with --include-path) or a text/JSONL file.")
@click.option("--texts", type=int, default=96, show_default=True, help="Texts in the token set, shared by the sources.")
@click.option("--gen-tokens", type=int, default=32, show_default=True, help="Teacher-generated tokens after each text.")
@click.option("--seq-len", type=int, default=128, show_default=True)
@click.option("--lr", type=float, default=2e-5, show_default=True)
@click.option("--fresh", is_flag=True,
              help="Every epoch reads --texts texts no earlier epoch read (epochs x texts in all, one pass): the "
                   "fresh arm of a data-reuse comparison (recipes/bench/distill_reuse.py).")
@click.option("--capabilities", default="math,code,qa,arithmetic,induction", show_default=True,
              help="Capabilities whose dL (vs the teacher, first --probes documents) is measured after each epoch "
                   "(any lm-eval task, a user's with --include-path).")
@click.option("--probes", type=int, default=32, show_default=True)
@click.option("--teacher-revision", default=None,
              help="Revision (branch, tag or commit) of a Hub teacher (default: the one STUDENT's base model was "
                   "compressed from, where TEACHER is that model).")
@dtype_option(choices=TRAIN_DTYPES, help="Dtype both models load and compute in (bfloat16: half the memory; Adam "
              "updates float32 copies of the trained matrices). The student is saved in it.")
@device_option()
@device_map_option()
@include_path_option()
@out_option("Output folder (written atomically at the end; rerun the same command to resume).")
@overwrite_option()
@no_progress_option()
def distill(student, teacher, epochs, sources, texts, gen_tokens, seq_len, lr, fresh, capabilities, probes,
            teacher_revision, dtype, device, device_map, parallelize, include_path, out, overwrite, quiet):
    """Distil STUDENT (a pruned checkpoint from `capsense compress`) from TEACHER on offline task text.

    Resumable: rerun the same command after a kill. Prints dL per capability before and
    after each epoch and the fit dL(E) = d0 + a*log(1+E). Both models load on --device; with --device-map
    they are spread over devices (the student's weights must stay in device memory).
    """
    from capsense.core.files import check_output_dir
    from capsense.core.models import check_model
    from capsense.core.placement import check_placement

    check_output_dir(out, overwrite, (student, teacher, sources, *include_path))  # before any heavy import
    placed = device_map_from(device_map, parallelize)
    check_placement(device, placed)  # every device it (or --device) names exists here
    check_model(student)
    check_model(teacher, teacher_revision)
    from capsense.compress.distill import (
        DistillConfig, capability_evaluator, check_distill_held_out, load_models, run_distill, teacher_revision as resolve,
    )
    from capsense.compress.study.epochs import epoch_fits
    from capsense.compress.capabilities import parse_capabilities

    caps = parse_capabilities(capabilities, include_path)
    if (resolved := resolve(student, teacher, teacher_revision)) != teacher_revision:  # a compressed student's base
        check_model(teacher, resolved)  # (the given one was checked above)
        teacher_revision = resolved
    cfg = DistillConfig(student=student, teacher=teacher, sources=sources, n_texts=texts, gen_tokens=gen_tokens,
                        seq_len=seq_len, epochs=epochs, lr=lr, fresh=fresh, teacher_revision=teacher_revision,
                        dtype=dtype)
    check_distill_held_out(cfg, caps, probes, include_path)
    s_model, t_model, tok = load_models(cfg, placed, device)
    evaluate = capability_evaluator(t_model, tok, caps, probes, include_path=include_path)
    records = run_distill(cfg, out, evaluate, overwrite=overwrite, models=(s_model, t_model, tok), progress=not quiet,
                          include_path=include_path)
    for r in records:
        click.echo(f"epoch {r['epoch']}: " + "  ".join(f"{c} {v:+.4f}" for c, v in r["dL"].items()))
    for c, f in epoch_fits(records).items():
        click.echo(f"{c}: dL(E) = {f['d0']:+.4f} {f['a']:+.4f} log(1+E)  (rms {f['rms']:.4f})")
    echo_written([out])

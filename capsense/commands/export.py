"""``capsense export``: an ablated checkpoint or a PEFT IA3 mask adapter, optionally pushed."""

from __future__ import annotations

from pathlib import Path

import click

from capsense.cli import CapsenseError


@click.command("export")
@click.argument("model")
@click.option("--heads", "heads", required=True, help="Heads to ablate: a spec (L3H1+L5H0) or a heads JSON file.")
@click.option("--top-k", type=click.IntRange(min=1), help="Keep the first K heads of a ranked heads file.")
@click.option(
    "--format", "fmt", type=click.Choice(["checkpoint", "adapter"]), required=True,
    help="checkpoint: edited safetensors model; adapter: PEFT IA3 mask adapter.",
)
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Output folder (written atomically).")
@click.option(
    "--ablation", type=click.Choice(["zero", "mean"]), default="zero", show_default=True,
    help="mean: fold head means into the output projection's bias (checkpoint only; gpt2, gpt_neox, "
    "and models whose attention has a bias).",
)
@click.option(
    "--mean-reference", type=click.Path(exists=True, dir_okay=False),
    help="Reference texts for mean ablation (a passage per line, or JSONL with 'text'); default: neutral prose.",
)
@click.option(
    "--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto", show_default=True,
    help="Checkpoint weight dtype (auto: as stored) / adapter vector dtype (auto: float32).",
)
@click.option("--revision", help="Revision of a Hub base model.")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest safetensors shard.")
@click.option("--overwrite", is_flag=True, help="Replace an existing non-empty output folder.")
@click.option("--push-to-hub", "push_repo", metavar="REPO_ID", help="Push the result to this Hub model repo.")
@click.option("--private", is_flag=True, help="With --push-to-hub: create the repo as private.")
def export(
    model: str, heads: str, top_k: int | None, fmt: str, out: Path, ablation: str, mean_reference: str | None,
    dtype: str, revision: str | None, max_shard_size: str, overwrite: bool, push_repo: str | None, private: bool,
) -> None:
    """Export MODEL (Hub id, local folder or smollm2-135m) with --heads ablated.

    The result loads with stock transformers (checkpoint) or peft (adapter) and carries a
    model card (README.md) and capsense.json saying exactly what was removed.
    """
    from capsense.core.arch import UnsupportedArchitectureError
    from capsense.ship.export import ExportError, export_model
    from capsense.core.files import OutputExistsError
    from capsense.core.heads import HeadSpecError
    from capsense.ship.hub import HubError, check_push_ready

    from capsense.commands.push import echo_files, human_size, run_push

    if private and not push_repo:
        raise CapsenseError("--private only applies with --push-to-hub REPO_ID")
    try:
        if push_repo:
            check_push_ready(push_repo)  # no token or offline: fail before the export, not after
        result = export_model(
            model, heads, out, format=fmt, top_k=top_k, ablation=ablation, mean_reference=mean_reference,
            dtype=dtype, revision=revision, overwrite=overwrite, max_shard_size=max_shard_size,
            repo_id=push_repo, log=lambda m: click.echo(m, err=True),
        )
    except (HeadSpecError, ExportError, OutputExistsError, UnsupportedArchitectureError, HubError) as e:
        raise CapsenseError(str(e)) from None
    total = sum((result.out / f).stat().st_size for f in result.files)
    click.echo(f"Exported {fmt} to {result.out} ({len(result.files)} files, {human_size(total)}): {result.heads}")
    echo_files(result.out, result.files)
    if push_repo:
        run_push(
            result.out, push_repo, private=private, revision=None, commit_message=None,
            create_pr=False, dry_run=False,
        )

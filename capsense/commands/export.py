"""``capsense export``: an ablated checkpoint or a PEFT adapter (IA3 mask; LoRA for mean ablation), optionally pushed."""

from __future__ import annotations

from pathlib import Path

import click

from capsense.commands.options import (
    ablation_option, mean_reference_option, device_map_from, device_map_option, device_option, dtype_option, heads_option,
    out_option, overwrite_option, revision_from, revision_option,
)
from capsense.commands.output import echo_files, echo_push, human_size, log


@click.command("export")
@click.argument("model")
@heads_option(required=True)
@click.option("--top-k", type=click.IntRange(min=1),
              help="Keep the first K heads of a ranked heads file (default: the set its run chose).")
@click.option(
    "--format", "format", type=click.Choice(["checkpoint", "adapter"]), required=True,
    help="checkpoint: edited safetensors model; adapter: PEFT adapter (IA3 mask; LoRA with a bias for mean ablation).",
)
@out_option("Output folder (written atomically).")
@ablation_option(None, "zero, or mean: fold head means into the output projection's bias (checkpoint: gpt2, "
                       "gpt_neox, and models whose attention has or can switch on a bias) or into a LoRA adapter's "
                       "bias (adapter). Default: what the heads file's run located "
                       "under (zero for a head spec or a file from before the setting).")
@mean_reference_option("Default: the run's, when --ablation is the run's.")
@dtype_option("auto", auto=True, help="Checkpoint weight dtype (auto: as stored) / adapter weight dtype (auto: float32).")
@revision_option(located=True)
@device_option()
@device_map_option()
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest safetensors shard.")
@overwrite_option()
@click.option("--push-to-hub", "push_repo", metavar="REPO_ID", help="Push the result to this Hub model repo.")
@click.option("--private", is_flag=True, help="With --push-to-hub: create the repo as private.")
def export(
    model: str, heads: str, top_k: int | None, format: str, out: Path, ablation: str | None, mean_reference: str | None,
    dtype: str, revision: str | None, device: str, device_map: str | None, parallelize: bool, max_shard_size: str,
    overwrite: bool, push_repo: str | None, private: bool,
) -> None:
    """Export MODEL (Hub id, local folder or smollm2-135m) with --heads ablated.

    The result loads with stock transformers (checkpoint) or peft (adapter) and carries a
    model card (README.md) and capsense.json saying exactly what was removed.
    """
    from capsense.errors import CapsenseError
    from capsense.core.ablation import located_ablation
    from capsense.ship.preflight import check_export_inputs

    if private and not push_repo:
        raise CapsenseError("`private` only applies with `push_repo` REPO_ID")
    ablation, mean_reference = located_ablation(heads, ablation, mean_reference)
    revision = revision_from(heads, model, revision)
    placed = device_map_from(device_map, parallelize)
    settings = dict(top_k=top_k, ablation=ablation, mean_reference=mean_reference, dtype=dtype, revision=revision,
                    overwrite=overwrite, max_shard_size=max_shard_size, repo_id=push_repo, log=log,
                    **({"device_map": placed} if placed else {}), **({"device": device} if device != "cpu" else {}))
    checked = check_export_inputs(model, heads, out, format=format, **settings)  # once, before any heavy import
    if push_repo:
        from capsense.ship.push import check_push_ready

        check_push_ready(push_repo)  # no token or offline: fail before the export, not after
    from capsense.ship.export import export_model

    result = export_model(model, heads, out, format=format, checked=checked, **settings)
    total = sum((result.out / f).stat().st_size for f in result.files)
    click.echo(f"Exported {format} to {result.out} ({len(result.files)} files, {human_size(total)}): {result.heads}")
    echo_files(result.out, result.files)
    if push_repo:
        from capsense.ship.push import push_folder

        echo_push(result.out, push_folder(result.out, push_repo, private=private))
    else:
        click.echo(f"Wrote {len(result.files)} files in {result.out}")

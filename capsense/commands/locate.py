"""``capsense locate``: rank the attention heads a task depends on (resumable run folder)."""

from __future__ import annotations

from pathlib import Path

import click

from capsense.cli import CapsenseError

_METHODS = ("cs", "exhaustive", "greedy", "thompson")
_DESIGNS = ("balanced", "bernoulli", "adaptive")
_SOLVERS = ("lasso", "lasso-cv", "omp", "stability")


def _csv(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


@click.command("locate")
@click.argument("model")
@click.option("--task", required=True, help="Target lm-eval task (capsense's lm_eval_tasks/ are always included).")
@click.option("--controls", help="Comma-separated control tasks: rank heads that hurt the target but not these.")
@click.option("--metric", default="nll", show_default=True,
              help="nll (nats/token of the reference continuation), acc (greedy exact match / multiple-choice "
                   "accuracy), or one of the target task's own lm-eval metrics (e.g. exact_match, "
                   "exact_match,flexible-extract, pass@1): then the target is run through lm-eval under each mask "
                   "(generation for generation tasks: faithful, slow) and the controls use nll.")
@click.option("--confirm-run-unsafe-code", is_flag=True,
              help="Allow tasks that execute model-written code (HumanEval, MBPP), as lm-eval requires.")
@click.option("--limit", type=int, default=100, show_default=True, help="Documents per task, sampled with --seed (paper: 100).")
@click.option("--masks", type=int, default=100, show_default=True, help="Knockout masks for cs and thompson (paper: 100).")
@click.option("--sparsity", type=float, help="Fraction of heads knocked out per mask (default 0.02, the paper's).")
@click.option("--heads-per-mask", type=int, help="Heads knocked out per mask (instead of --sparsity).")
@click.option("--design", default="balanced", show_default=True, help="Mask design: " + ", ".join(_DESIGNS) + ".")
@click.option("--solver", default="lasso", show_default=True, help="Sparse solver: " + ", ".join(_SOLVERS) + ".")
@click.option("--alpha", type=float, help="Lasso penalty on the standardized score (default 0.01, the paper's).")
@click.option("--method", default="cs", show_default=True, help="cs (compressed sensing) or a baseline: exhaustive, greedy, thompson.")
@click.option("--top-k", type=int, default=5, show_default=True,
              help="Size of the head set the run hands on: greedy's rounds, and the set selective mode measures and chooses.")
@click.option("--refine", type=int,
              help="Evaluations spent measuring candidate top-K sets on the run's documents (default 24 with --controls, else 0).")
@click.option("--tolerance", type=float, default=0.03, show_default=True,
              help="Largest relative worsening of any control a chosen set may cause on the run's documents.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--batch-size", type=int, default=16, show_default=True, help="Requests per forward pass.")
@click.option("--masks-per-forward", default="auto", show_default=True,
              help="Masks packed in one forward pass: auto (1 on CPUs, where packing does not pay; on a GPU the most "
                   "that fit in half its free memory) or a number.")
@click.option("--no-prefix-reuse", is_flag=True, help="Always run the full forward (prefix reuse starts at the first ablated layer); multiple-choice contexts are still shared across choices.")
@click.option("--device", default="cpu", show_default=True,
              help="cpu, cuda, cuda:N, mps. Under accelerate launch each process takes its own GPU.")
@click.option("--device-map",
              help="Spread a model larger than one device: auto (GPUs, then CPU, then disk; = lm-eval's "
                   "parallelize=True), balanced, sequential, or a JSON map of module -> device (text or .json file).")
@click.option("--parallelize", is_flag=True, help="lm-eval's spelling of --device-map auto.")
@click.option("--dtype", default="auto", show_default=True,
              help="auto (bfloat16 on GPUs and CPUs with native bf16, else float32), float32, bfloat16, float16.")
@click.option("--revision", help="Revision of a Hub model.")
@click.option("--include-path", multiple=True, type=click.Path(exists=True, file_okay=False), help="Extra lm-eval task folder (repeatable).")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Run folder (rerunning the same command resumes).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def locate(model: str, task: str, controls: str | None, metric: str, limit: int, masks: int, sparsity: float | None,
           heads_per_mask: int | None, design: str, solver: str, alpha: float | None, method: str, top_k: int, refine: int | None, tolerance: float,
           seed: int, batch_size: int, masks_per_forward: str, no_prefix_reuse: bool, device: str, device_map: str | None,
           parallelize: bool, dtype: str,
           revision: str | None, include_path: tuple[str, ...], out: Path, quiet: bool, confirm_run_unsafe_code: bool) -> None:
    """Rank MODEL's attention heads by how much --task depends on them.

    Writes OUT/manifest.json, evaluations.jsonl (one line per mask, durable), heads.json
    (ranked), scores.csv, heatmap.png and report.md.
    """
    from capsense.localize.locate import LocateConfig, LocateError, locate as run_locate
    from capsense.scoring.probe import ProbeError
    from capsense.localize.store import RunStoreError

    from capsense.core.distributed import context, quiet_exit

    if sparsity is not None and heads_per_mask is not None:
        raise CapsenseError("give --sparsity or --heads-per-mask, not both")
    if parallelize and device_map not in (None, "auto"):
        raise CapsenseError("give --parallelize or --device-map, not both")
    if masks_per_forward != "auto" and not masks_per_forward.isdigit():
        raise CapsenseError(f"--masks-per-forward must be auto or a number of masks, got {masks_per_forward!r}")
    cfg = LocateConfig(
        model=model, task=task, out=str(out), controls=_csv(controls), metric=metric, limit=limit, masks=masks,
        sparsity=0.02 if sparsity is None and heads_per_mask is None else sparsity, heads_per_mask=heads_per_mask,
        design=design, solver=solver, alpha=alpha, method=method, seed=seed, batch_size=batch_size,
        masks_per_forward=None if masks_per_forward == "auto" else int(masks_per_forward), device=device,
        device_map="auto" if parallelize else device_map, dtype=dtype, include_path=list(include_path),
        revision=revision, top_k=top_k, refine=refine, tolerance=tolerance, prefix_reuse=not no_prefix_reuse,
        progress=not quiet and context().is_main,
        confirm_run_unsafe_code=confirm_run_unsafe_code,
    )
    try:
        cfg.check()
        result, heads_path = run_locate(cfg, log=lambda m: click.echo(m, err=True))
    except (LocateError, ProbeError, RunStoreError, ValueError, FileNotFoundError, OSError) as e:
        if not context().is_main:
            quiet_exit(str(e))
        raise CapsenseError(str(e)) from None
    if not context().is_main:
        return  # the main process reports
    from capsense.core.heads import load_heads_file

    hf = load_heads_file(heads_path)
    top = ", ".join(f"L{r['layer']}H{r['head']}" for r in hf.heads[:10])
    click.echo(f"{result.n_evaluations} masks evaluated ({result.seconds_per_mask:.2f} s each); top heads: {top}")
    click.echo(f"Wrote {heads_path} and report.md, heatmap.png, scores.csv in {out}")

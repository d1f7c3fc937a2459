"""``capsense locate``: rank the attention heads a task depends on (resumable run folder)."""

from __future__ import annotations

from pathlib import Path

import click

from capsense.commands.options import (
    ablation_option, mean_reference_option, batch_size_option, csv_list, device_map_from, device_map_option, device_option, dtype_option, include_path_option,
    limit_option, no_progress_option, old_name, out_option, registry_option, with_old_name,
    revision_option, top_k_option, unsafe_code_option,
)
from capsense.commands.output import echo_written, log
from capsense.core.precision import AUTOCAST_DTYPES


@click.command("locate")
@click.argument("model")
@click.option("--task", required=True, help="Target lm-eval task (capsense's lm_eval_tasks/ are always included).")
@click.option("--controls", default="default", show_default=True,
              help="Control tasks and suites, comma-separated: rank heads that hurt the target but not these, and set "
                   "aside heads that hurt any of them. 'default' is the broad control suite (factual recall, names, "
                   "numbers and dates, code lines, dialogue, prose, multiple choice); add tasks "
                   "(default,capsense_arithmetic), drop some (-capsense_dates); 'none' for no controls. A perplexity "
                   "task (loglikelihood_rolling, wikitext's kind) is scored by its whole text's nats/token.")
@click.option("--control-limit", type=int, help="Documents per control task (default: --limit).")
@click.option("--screen", type=float, default=3.0, show_default=True,
              help="Collateral screen: a head whose damage to a control exceeds this many robust noises (and "
                   "--tolerance / --top-k) is not handed on; 0 turns it off.")
@click.option("--metric", default="nll", show_default=True,
              help="nll (nats/token of the reference continuation; for multiple choice the gold choice's; for a "
                   "perplexity task its whole text's), acc (greedy exact match / multiple-choice accuracy; none for "
                   "a perplexity task), choice_nll (a multiple-choice target: nats per "
                   "document of the gold choice among its document's choices, the loss acc decides by; the "
                   "controls use nll), or one of the target task's own lm-eval metrics (e.g. exact_match, "
                   "exact_match,flexible-extract, pass@1): then the target is run through lm-eval under each mask "
                   "(generation for generation tasks: faithful, slow) and the controls use nll.")
@ablation_option("zero", "What a knocked-out head's output becomes in every knockout, in the gradient attribution "
                         "and in the handed-on set: zero, or mean (its mean over --mean-reference). heads.json "
                         "records it, and validate applies it by default.")
@mean_reference_option()
@unsafe_code_option()
@limit_option(100, "Documents per task, sampled with --seed (paper: 100).")
@click.option("--masks", type=int, default=100, show_default=True, help="Knockout masks for cs and thompson (paper: 100).")
@click.option("--sparsity", type=float, help="Fraction of heads knocked out per mask (default 0.02, the paper's).")
@click.option("--heads-per-mask", type=int, help="Heads knocked out per mask (instead of --sparsity).")
@registry_option("--design", default="balanced", show_default=True, registry="capsense.localize.designs:DESIGNS",
                 help="Mask design: {names}.")
@registry_option("--solver", default="lasso", show_default=True, registry="capsense.localize.solvers:SOLVERS",
                 help="Sparse solver: {names}.")
@click.option("--alpha", type=float, help="Lasso penalty on the standardized score (default 0.01, the paper's).")
@click.option("--method", default="prior-guided", show_default=True,
              help="prior-guided (gradient attribution says where to knock out, knockouts decide; needs --metric nll), "
                   "attribution (the estimate alone, nothing measured), cs (compressed sensing), or a baseline: "
                   "exhaustive, greedy, thompson.")
@click.option("--fe-budget", "budget", type=float, default=50.0, show_default=True,
              help="prior-guided: forward-equivalents for attribution and knockouts (a forward over the documents = 1, "
                   "a backward = 2, a prefix-reused forward = its share of layers); measure-and-choose comes on top.")
@click.option("--top-m", type=int, default=32, show_default=True,
              help="prior-guided: heads with the largest |estimate| knocked out one at a time.")
@click.option("--group-size", type=int, default=16, show_default=True,
              help="prior-guided: heads per group knockout over the rest (a group that hurts is split).")
@click.option("--prior-score", type=click.Choice(["documents", "estimate"]), default="documents", show_default=True,
              help="prior-guided: what orders the single-head knockouts: the |attribution estimate|, or each "
                   "document's |gradient| summed (documents: cancellation across documents cannot hide a head).")
@click.option("--group-price", type=click.Choice(["full", "target"]), default="full", show_default=True,
              help="prior-guided with --controls: a group knockout's price in --fe-budget: as if scored on every probe "
                   "(full), or what it costs, on the target alone (target: more groups and splits for the budget; on "
                   "SmolLM2 a stronger set that hurt held-out tasks the controls do not cover, so not the default).")
@click.option("--single-controls", type=click.Choice(["cheapest-first", "until-excluded", "all"]), default="cheapest-first",
              show_default=True,
              help="prior-guided with --controls and a --screen: a single-head knockout is scored on the target and the "
                   "controls cheapest first until a control is beyond its screen threshold (the head is then set aside "
                   "whatever the others say, and one set aside before the target is never scored on it); "
                   "until-excluded: the target first, then the controls cheapest first (rounds 42-44); all: every probe "
                   "(as before round 42).")
@top_k_option(5, "Size of the head set the run hands on: greedy's rounds, and the set selective mode measures and chooses.")
@click.option("--refine", type=int,
              help="Evaluations spent measuring candidate top-K sets on the run's documents (default 24 with controls, else 0).")
@dtype_option(None, name="--refine-dtype",
              help="Precision of measure-and-choose (default: float32 when the search runs in bfloat16/float16 on "
                   "one device and, on a GPU, the float32 model takes at most half its memory; else --dtype): the "
                   "handed-on set is measured in the precision validation judges in.")
@click.option("--tolerance", type=float, default=0.03, show_default=True,
              help="Largest relative worsening of any control a chosen set may cause on the run's documents.")
@click.option("--set-controls", type=click.Choice(["until-beyond", "all"]), default="until-beyond", show_default=True,
              help="Measure-and-choose with --controls: score each candidate set on the controls cheapest first until the "
                   "first beyond --tolerance or the best whole set's worst control, whichever is larger (such a set can "
                   "be neither within tolerance nor chosen over that one; the set handed on is scored on every control), "
                   "or on every control (all, as before round 43; the search may propose other sets: RESULTS-locate.md, "
                   "round 43).")
@click.option("--refine-search", type=click.Choice(["predicted", "swaps"]), default=None,
              help="Measure-and-choose after a first set that breaks --tolerance: predicted (the default: the set the "
                   "singles, corrected by the sets measured so far, predict best is measured, one at a time, until it "
                   "is one already measured; if that one breaks --tolerance too, swaps go on with the budget left) or "
                   "swaps (leave-one-out names a head to swap out, the next candidates are tried in its place; the "
                   "search before round 30).")
@click.option("--seed", type=int, default=0, show_default=True)
@batch_size_option(auto=True)
@click.option("--masks-per-forward", default="auto", show_default=True,
              help="Masks packed in one forward pass: auto (1 with prefix reuse, the default, and on CPUs: packed masks "
                   "run full forwards, which cost more than they save; on a GPU with --no-prefix-reuse the most that "
                   "fit in half its free memory) or a number.")
@click.option("--no-prefix-reuse", is_flag=True, help="Always run the full forward. Prefix reuse starts each knockout at its first ablated layer from the clean model's block inputs, kept in memory (layers x tokens x hidden size, for log-likelihood and multiple-choice probes alike); turn it off where they do not fit (on a GPU it turns itself off where they would take more than half the free memory). Multiple-choice contexts are still shared across choices.")
@device_option()
@device_map_option()
@dtype_option("auto", auto=True, help="auto (bfloat16 on GPUs; on one CPU with native bf16 float32 weights searched under bfloat16 autocast, as --dtype float32 --autocast bfloat16; else float32), float32, bfloat16, float16.")
@click.option("--autocast", type=click.Choice(list(AUTOCAST_DTYPES)), default=None,
              help="Run the search's matrix products in this dtype over float32 weights (torch.autocast; needs --dtype "
                   "float32): about bfloat16's speed on a CPU with native bf16 (AMX, AVX-512 BF16), with norms, softmax and the residual stream in "
                   "float32. Measure-and-choose measures its sets without it.")
@revision_option()
@include_path_option()
@out_option("Run folder (rerunning the same command resumes).")
@no_progress_option()
@old_name("--quiet", "--no-progress", "quiet", is_flag=True)
@old_name("--budget", "--fe-budget", "budget", type=float)
def locate(model: str, task: str, controls: str, control_limit: int | None, screen: float, metric: str, ablation: str,
           mean_reference: str | None, limit: int, masks: int, sparsity: float | None,
           heads_per_mask: int | None, design: str, solver: str, alpha: float | None, method: str, budget: float,
           top_m: int, group_size: int, prior_score: str, group_price: str, single_controls: str, top_k: int, refine: int | None, refine_dtype: str | None, tolerance: float,
           refine_search: str | None, set_controls: str,
           seed: int, batch_size: int | str, masks_per_forward: str, no_prefix_reuse: bool, device: str,
           device_map: str | None, parallelize: bool, dtype: str, autocast: str | None,
           revision: str | None, include_path: tuple[str, ...], out: Path, quiet: bool, confirm_run_unsafe_code: bool) -> None:
    """Rank MODEL's attention heads by how much --task depends on them.

    Writes OUT/manifest.json, evaluations.jsonl (one line per mask, durable), heads.json
    (ranked), scores.csv, heatmap.png and report.md.
    """
    from capsense.errors import CapsenseError
    from capsense.evaluation.preflight import check_locate

    budget = with_old_name("budget", budget, "--fe-budget")
    quiet = with_old_name("quiet", quiet, "--no-progress")
    from capsense.localize.config import LocateConfig

    if sparsity is not None and heads_per_mask is not None:
        raise CapsenseError("give `sparsity` or `heads_per_mask`, not both")
    if masks_per_forward != "auto" and not masks_per_forward.isdigit():
        raise CapsenseError(f"--masks-per-forward must be auto or a number of masks, got {masks_per_forward!r}")
    cfg = LocateConfig(
        model=model, task=task, out=str(out), controls=csv_list(controls), control_limit=control_limit, screen=screen, metric=metric,
        ablation=ablation, mean_reference=mean_reference, limit=limit, masks=masks,
        sparsity=0.02 if sparsity is None and heads_per_mask is None else sparsity, heads_per_mask=heads_per_mask,
        design=design, solver=solver, alpha=alpha, method=method, budget=budget, top_m=top_m, group_size=group_size,
        prior_score=prior_score, group_price=group_price, single_controls=single_controls, seed=seed, batch_size=batch_size,
        masks_per_forward=None if masks_per_forward == "auto" else int(masks_per_forward), device=device,
        device_map=device_map_from(device_map, parallelize), dtype=dtype, autocast=autocast, include_path=list(include_path),
        revision=revision, top_k=top_k, refine=refine, refine_dtype=refine_dtype, tolerance=tolerance,
        refine_search=refine_search, set_controls=set_controls, prefix_reuse=not no_prefix_reuse, progress=not quiet,
        confirm_run_unsafe_code=confirm_run_unsafe_code,
    )
    from capsense.localize.registry import METHODS

    METHODS.check(method)  # a bad name, before any heavy import
    check_locate(cfg)  # before any heavy import
    from capsense.core.distributed import is_main_process
    from capsense.core.heads import load_heads_file
    from capsense.localize.run import locate as run_locate

    result, heads_path = run_locate(cfg, log=log)
    if not is_main_process():
        return  # under accelerate launch the main process reports
    hf = load_heads_file(heads_path)
    top = ", ".join(str(h) for h in hf.head_set.top(min(10, len(hf.heads))))
    click.echo(f"{result.n_evaluations} masks evaluated ({result.seconds_per_mask:.2f} s each, "
               f"{result.forward_equivalents:.1f} forward-equivalents in all); top heads: {top}")
    echo_written([heads_path, *(out / f for f in ("report.md", "heatmap.png", "scores.csv", "manifest.json",
                                                  "evaluations.jsonl", "attribution.json") if (out / f).is_file())])

"""``capsense compress``: prune, quantize or factorize a model and write a checkpoint."""

from __future__ import annotations


import click

from capsense.commands.options import (
    device_map_from, device_map_option, device_option, dtype_option, include_path_option, no_progress_option, old_name,
    out_option, overwrite_option, registry_option, revision_option, with_old_name,
)
from capsense.commands.output import echo_written, log


@click.command("compress")
@click.argument("model")
@registry_option("--method", type=str, default=None, registry="capsense.compress.methods:METHODS",
                 help="{names} (or from --budget-file). gptq and sparsegpt compensate each rounding/pruning error "
                      "with the calibration inputs (Frantar et al.).")
@click.option("--density", type=float, default=None, help="Pruning: fraction of weights kept, in (0, 1].")
@click.option("--scope", type=str, default=None, help="Pruning comparison group: row (default), matrix or global; "
              "sparsegpt: row or 2:4 (two of every four weights, density 0.5).")
@click.option("--bits", type=int, default=None, help="RTN/GPTQ: bits per weight (2-16; packed checkpoints 2-8).")
@click.option("--group-size", type=int, default=None, help="RTN/GPTQ: columns per scale (default 128; 0 = per output "
              "channel). Packed checkpoints need a group size dividing every matrix's columns (SmolLM2: 64, 32 or 0).")
@click.option("--damp", type=float, default=None, help="GPTQ/SparseGPT: fraction of the mean Hessian diagonal added "
              "(default 0.01).")
@click.option("--act-order/--natural-order", "act_order", default=None,
              help="GPTQ: quantize columns by decreasing input energy (default) or left to right.")
@click.option("--solve-on", "solve_on", type=click.Choice(["cpu", "layer"]), default=None,
              help="GPTQ/SparseGPT: solve each matrix on a CPU copy (default: the result does not depend on the "
                   "placement) or on its layer's device (--device cuda, or --device-map; GPUs: minutes, not hours, "
                   "on 70B).")
@click.option("--ratio", type=float, default=None, help="Low-rank: factor parameters / dense parameters, in (0, 1].")
@click.option("--alpha", type=float, default=None, help="ASVD: activation exponent (default 0.5).")
@click.option("--targets", default=None, help="Matrices to compress: attn, mlp or attn,mlp (default both).")
@click.option("--budget-file", "budget_file", type=click.Path(dir_okay=False), default=None,
              help="Budget file (YAML/JSON): default setting, per-layer/per-matrix overrides, protected heads.")
@old_name("--budget", "--budget-file", "budget_file", type=click.Path(dir_okay=False))
@click.option("--calibration", default=None, help="Calibration: capabilities/tasks (comma-separated; a user's with --include-path), a text/JSONL file, "
              "or text of more than one word. "
              "Default: prose,math,code,qa (their last documents, disjoint from the probes); gptq and sparsegpt "
              "with --keep add the kept capabilities (each takes a second share). Read by the calibrated methods "
              "(wanda, sparsegpt, gptq, asvd, svd-llm) only: given to others it is refused.")
@click.option("--calibration-samples", type=int, default=None,
              help="Calibration texts [default: 64] (with --keep also the texts of each kept capability for its "
                   "gradients). Without --keep read by the calibrated methods only, as --calibration.")
@dtype_option(help="Dtype to load and compress in.")
@dtype_option("auto", auto=True, name="--save-dtype", help="Dtype of the saved weights (auto: as compressed, "
              "or bfloat16 for the unpacked tensors of a compressed-tensors checkpoint).")
@click.option("--keep", default=None, help="Capabilities to keep (e.g. math,code; text; any lm-eval task, a user's with "
              "--include-path): a guided allocation at the size of "
              "the uniform setting (or --budget-size), their most important whole heads protected. The Fisher diagonals "
              "and the original and chosen weights wait in a temporary folder ($TMPDIR; 4 bytes per target weight per "
              "capability, plus two copies of the target weights), not in memory; refused before any pass when its disk has not "
              "the room.")
@click.option("--probes", type=click.IntRange(min=0), default=None,
              help="With --keep: the kept capabilities' first N documents, measured before and after compressing and "
              "stated in capsense.json and the card (default 32; 0: none). A task of few documents leaves the rest "
              "for calibration: probes and calibration documents never meet.")
@click.option("--protect-heads", default=None, help="With --keep: heads to protect (heads file or L3H1+L5H0) instead "
              "of the gradient's choice.")
@click.option("--protect-top-k", type=int, default=None,
              help="With --keep: heads protected whole per kept capability (0: none; default 8, RTN 0).")
@click.option("--sensitivity", default="kept", show_default=True,
              help="With --keep: how levels are priced: kept (gradient Fisher of the kept capabilities), measured "
              "(their loss measured per layer attention/MLP and level in the uniformly compressed model; slower, and "
              "on SmolLM2 it did not beat kept at 3-bit RTN), generic or flat (controls).")
@click.option("--pricing", type=click.Choice(["output", "rtn", "wanda"]), default=None,
              help="With --keep and --method gptq or sparsegpt: price each level by the method's own solved output "
              "error (default 'output'), or by a cheaper proxy: round-to-nearest's weight error ('rtn', gptq) or "
              "Wanda's mask's weight error ('wanda', sparsegpt). See recipes/results/RESULTS-compress.md.")
@click.option("--check-uniform/--no-check-uniform", "check_uniform", default=None,
              help="With --keep (default on): also compress with the uniform setting and ship whichever has the lower "
              "kept-capability loss on the kept capabilities' calibration documents (both recorded in capsense.json).")
@click.option("--check-docs", type=click.IntRange(min=1), default=None,
              help="With --keep and the uniform check: calibration documents per kept capability the choice among "
              "the candidates measures (default: --calibration-samples, the texts the Fisher read). More documents narrow "
              "the choice's standard error; on SmolLM2 GPTQ 4 bits keep code (compressed propagation) 32 documents "
              "shipped uniform and 128 the allocation, neither resolved (RESULTS-compress.md, round 23).")
@click.option("--budget-size", type=float, default=None, help="With --keep: model size ratio to match instead of the "
              "uniform setting's.")
@click.option("--fisher-groups", type=click.IntRange(min=1), default=None,
              help="With --keep: sum the gradient Fisher over this many runs of decoder layers in turn, a pass over "
              "its texts each: its memory (4 bytes per target weight, 26 GiB for an 8B model) divided by N, its "
              "backward passes multiplied by N, the same result (default 1).")
@click.option("--format", "fmt", type=click.Choice(["auto", "compressed-tensors", "dense"]), default="auto",
              show_default=True, help="Checkpoint format. compressed-tensors: quantized matrices packed as integer codes "
              "with 16-bit group scales (real size on disk; loads with compressed-tensors installed). dense: every weight "
              "a float, as compressed in memory. auto: compressed-tensors for rtn/gptq, dense for pruning and low rank "
              "(compressed-tensors has no sparse or factored storage).")
@click.option("--sequential", is_flag=True, default=False,
              help="Calibrate and compress one decoder layer at a time (gptq, sparsegpt, svd-llm, wanda, asvd): the "
              "calibration statistics of one layer in memory instead of the whole model's (GPTQ's Gram matrices: "
              "~61 GiB for an 8B model in one pass); by default the one-pass result exactly. With --keep: the levels are "
              "priced layer by layer on the original layers' outputs, then each candidate compressed layer by layer "
              "(by default the one-pass guided result; not with --sensitivity measured).")
@click.option("--sequential-propagate", type=click.Choice(["compressed", "original"]), default=None,
              help="With --sequential: the outputs passed to the next layer, the original layer's (default: the one-pass "
              "result, with one layer's memory) or the compressed layer's (GPTQ's error-propagating order; measured on "
              "SmolLM2: lower math/code dL, higher qa dL). With --keep it applies to compressing each candidate: with "
              "gptq it turned three guided rows that missed the 25% bar in one pass into met rows (SmolLM2 4 and 3 "
              "bits, Gemma 3 4 bits); of four one-pass met rows measured that way it kept two, lost one to the choice "
              "among candidates (won back with --check-docs 128) and one by 0.7 points against the uniform setting "
              "compressed the same way (Gemma 3 3 bits keep math: the propagation halves uniform's math dL); with "
              "sparsegpt on Gemma 3 it raised the kept math dL (recipes/results/RESULTS-compress.md, rounds 20-23).")
@device_option()
@device_map_option()
@revision_option()
@include_path_option()
@out_option("Output folder (written atomically).")
@overwrite_option()
@no_progress_option()
def compress(model, method, density, scope, bits, group_size, damp, act_order, solve_on, ratio, alpha, targets, budget_file,
             calibration, calibration_samples, dtype, save_dtype, keep, probes, protect_heads, protect_top_k, sensitivity,
             pricing, check_uniform, check_docs, budget_size, fisher_groups, fmt, sequential, sequential_propagate,
             device, device_map, parallelize, revision, include_path, out, overwrite, quiet):
    """Compress MODEL (Hub id, local folder or smollm2-135m) and save a checkpoint stock transformers loads.

    Quantized models (rtn, gptq) are written packed in compressed-tensors format (their real size
    on disk, bfloat16 elsewhere unless --save-dtype). Pruned and low-rank models stay dense: pruned
    weights are zeros, low-rank matrices the reconstructed products (no standard format stores them
    smaller); --format dense writes quantized weights dequantized too. capsense.json records the
    method, settings, achieved density, bits per parameter, parameter ratio, size on disk and
    calibration data (no path of this machine). The model loads on --device; with --device-map it is
    spread over devices (weights must stay in device memory: a map that offloads them to
    CPU memory or disk is refused). Calibration runs where the layers are; each matrix is compressed on
    a CPU copy, unless --solve-on layer solves GPTQ/SparseGPT on the layers' devices.
    """
    from capsense.compress.request import check_request

    budget_file = with_old_name("budget_file", budget_file, "--budget-file")
    placed = check_request(model, out, overwrite, device_map_from(device_map, parallelize), method, budget_file,
                           calibration, solve_on, include_path, revision, device)  # before any heavy import
    from capsense.compress.request import compress_request

    setting = {"method": method, "density": density, "scope": scope, "bits": bits, "group_size": group_size,
               "damp": damp, "act_order": act_order, "solve_on": solve_on, "ratio": ratio, "alpha": alpha}
    result = compress_request(
        model, out, setting, targets=targets, budget_file=budget_file, keep=keep, probes=probes, sensitivity=sensitivity,
        protect_top_k=protect_top_k, protect_heads=protect_heads, budget_size=budget_size, pricing=pricing,
        check_uniform=check_uniform, fisher_groups=fisher_groups, check_docs=check_docs, calibration=calibration,
        calibration_samples=calibration_samples, dtype=dtype, save_dtype=save_dtype, overwrite=overwrite,
        device_map=placed, device=device, fmt=fmt, sequential=sequential, sequential_propagate=sequential_propagate,
        include_path=list(include_path), log=log, progress=not quiet, revision=revision,
    )
    s = result.summary
    click.echo(
        f"{s['label']} on {', '.join(result.budget['targets'])}; target density {s['target_density']:.4f}, "
        f"bits/param {s['target_bits_per_param']:.3f}, param ratio {s['target_param_ratio']:.4f}; "
        f"model size ratio {s['size_ratio']:.4f}"
    )
    echo_written([out])

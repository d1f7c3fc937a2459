"""Roofline of mask evaluation on SmolLM2-135M: per-mask time against this machine's GEMM rate.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 python recipes/bench/bench_locate_roofline.py \\
        [--task capsense_induction] [--limit 24] [--masks 8] [--threads 2] [--dtypes float32,bfloat16]

In one process, on the run's documents (the probe ``capsense locate`` builds, batch size 16):

1. The sustained matrix-multiply rate of this machine, float32, measured at the model's own
   GEMM shapes (rows = a batch's padded tokens; q/o, k/v, gate/up and down projections) and at
   a large square product (the peak).
2. FLOPs of one forward over the documents, counted from the model's config: the linear layers
   (2 x in x out per token), attention scores and values (2 x 2 x T x head_dim per token, head
   and layer: the full T x T product that the CPU kernel computes), the LM head at scored
   positions only. Counted on padded batches (what is executed) and on real tokens (useful).
3. Measured seconds per 5-head mask: the full-forward scorer, and the scorer ``capsense locate``
   uses (prefix reuse where the task allows it).

The floor is executed FLOPs / sustained rate at the model's shapes; the report gives measured /
floor (1.0 = at the floor). With several ``--dtypes`` every step runs for each in the same process
and the report adds the side-by-side ratio of seconds per mask (bfloat16 computes the blocks in
bf16; capsense's LM head scores in float32 either way). Records the CPU's name and whether it has
AMX-BF16 / AVX-512 BF16. Writes ``recipes/results/locate_roofline.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch


def gemm_rate(m: int, k: int, n: int, seconds: float = 1.5, dtype: torch.dtype = torch.float32) -> float:
    """Sustained FLOP/s of ``[m, k] @ [k, n]`` in ``dtype`` (repeated for about ``seconds``)."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    for _ in range(3):
        a @ b
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2.0 * m * k * n * reps / (time.perf_counter() - t0)


def forward_flops(cfg, batches: list[list[int]], scored: int, padded: bool) -> float:
    """FLOPs of one forward over ``batches`` (lists of sequence lengths) with ``scored`` LM-head rows."""
    d, ff, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    linear_per_token = 2 * (d * q + 2 * d * kv + q * d + 3 * d * ff)
    total = 0.0
    for lengths in batches:
        t_max = max(lengths)
        for t in lengths:
            t_eff = t_max if padded else t
            attn = 2 * 2 * t_eff * t_eff * hd * cfg.num_attention_heads  # scores + weighted values
            total += layers * (t_eff * linear_per_token + attn)
    return total + 2.0 * d * cfg.vocab_size * scored


def measure(args, dtype: str) -> dict:
    """Every step of the roofline for one dtype."""
    from capsense.core.models import load_model
    from capsense.localize.evaluator import MaskEvaluator
    from capsense.scoring.probe import ProbeScorer, build_probe

    tdtype = getattr(torch, dtype)
    model, tok = load_model("smollm2-135m", dtype)
    cfg = model.config
    probe = build_probe(args.task, tok, args.limit, 0)
    full = ProbeScorer(model, probe, batch_size=args.batch_size)
    batches = [[len(full._inputs[r]) for r in full._order[b : b + args.batch_size]]
               for b in range(0, len(full._order), args.batch_size)]
    scored = sum(len(t) for t in full._targets)
    flops_exec = forward_flops(cfg, batches, scored, padded=True)
    flops_useful = forward_flops(cfg, batches, scored, padded=False)

    rows = int(np.mean([len(b) * max(b) for b in batches]))
    d, ff = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads)
    shapes = {"q/o": (rows, d, d), "k/v": (rows, d, kv), "gate/up": (rows, d, ff), "down": (rows, ff, d)}
    rates = {name: gemm_rate(*s, dtype=tdtype) for name, s in shapes.items()}
    # the model's GEMMs weighted by their FLOPs: the rate its linear layers can reach at best
    weights = {"q/o": 2 * d * d, "k/v": 2 * d * kv, "gate/up": 2 * d * ff, "down": d * ff}
    model_rate = sum(weights.values()) / sum(w / rates[k] for k, w in weights.items())
    peak = gemm_rate(2048, 2048, 2048, dtype=tdtype)

    rng = np.random.default_rng(0)
    n_layers, n_heads = cfg.num_hidden_layers, cfg.num_attention_heads
    masks = np.zeros((args.masks, n_layers * n_heads), dtype=bool)
    for i in range(args.masks):
        masks[i, rng.choice(n_layers * n_heads, 5, replace=False)] = True
    ko = torch.from_numpy(masks.reshape(-1, n_layers, n_heads).copy())
    full.score(ko[:1])  # warm-up
    t0 = time.perf_counter()
    for i in range(args.masks):
        full.score(ko[i : i + 1])
    full_s = (time.perf_counter() - t0) / args.masks
    ev = MaskEvaluator(model, {args.task: probe}, batch_size=args.batch_size, masks_per_forward=1, prefix_reuse=True)
    ev(masks[:1])
    t0 = time.perf_counter()
    for i in range(args.masks):
        ev(masks[i : i + 1])
    used_s = (time.perf_counter() - t0) / args.masks

    floor_s = flops_exec / model_rate
    return {
        "dtype": dtype, "task": args.task, "documents": args.limit, "threads": args.threads, "batches": len(batches),
        "padded_tokens": sum(len(b) * max(b) for b in batches), "real_tokens": sum(map(sum, batches)), "scored_tokens": scored,
        "gflop_per_forward_executed": flops_exec / 1e9, "gflop_per_forward_useful": flops_useful / 1e9,
        "gemm_gflops_model_shapes": {k: v / 1e9 for k, v in rates.items()},
        "gemm_gflops_model_weighted": model_rate / 1e9, "gemm_gflops_peak_2048": peak / 1e9,
        "floor_s_per_mask": floor_s,
        "full_forward_s_per_mask": full_s, "full_forward_vs_floor": full_s / floor_s,
        "full_forward_gflops": flops_exec / full_s / 1e9,
        "locate_scorer": type(ev.scorers[args.task]).__name__,
        "locate_scorer_s_per_mask": used_s, "locate_scorer_vs_floor": used_s / floor_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="capsense_induction")
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--masks", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--dtypes", default="float32", help="comma-separated: float32, bfloat16")
    ap.add_argument("--out", default="recipes/results/locate_roofline.json")
    args = ap.parse_args()
    from capsense.core.provenance import cpu_info

    torch.set_num_threads(args.threads)
    runs = {dt: measure(args, dt) for dt in args.dtypes.split(",")}
    out = {"cpu": cpu_info(), **(runs[next(iter(runs))] if len(runs) == 1 else {"by_dtype": runs})}
    if "float32" in runs and "bfloat16" in runs:
        f, b = runs["float32"], runs["bfloat16"]
        out["bfloat16_vs_float32"] = {
            "locate_scorer_s_per_mask": b["locate_scorer_s_per_mask"] / f["locate_scorer_s_per_mask"],
            "full_forward_s_per_mask": b["full_forward_s_per_mask"] / f["full_forward_s_per_mask"],
            "gemm_peak_2048": b["gemm_gflops_peak_2048"] / f["gemm_gflops_peak_2048"],
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

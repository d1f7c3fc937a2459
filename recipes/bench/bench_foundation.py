"""Foundation benchmarks, each a side-by-side ratio measured in one run.

1. ``capsense-masked`` with no heads vs lm-eval's ``hf``: same task, same documents
   (goal <= 1.05x).
2. Batched knockouts: cost per (mask, example) row when every row of a batch carries its
   own knockout mask vs a plain forward of the same rows (goal <= 1.15x).

    python recipes/bench/bench_foundation.py [--model smollm2-135m] [--limit 100] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def bench_lm_eval(model: str, task: str, limit: int, repeats: int, batch_size: int) -> tuple[float, float]:
    import lm_eval

    from capsense.core.models import resolve_pretrained
    from capsense.tasks import task_manager

    path = resolve_pretrained(model)
    tm = task_manager(metadata={"tokenizer": path})
    times: dict[str, list[float]] = {"hf": [], "capsense-masked": []}
    for _ in range(repeats):
        for name in ("hf", "capsense-masked"):  # interleaved, so drift hits both alike
            t = time.perf_counter()
            lm_eval.simple_evaluate(
                model=name,
                model_args=f"pretrained={path},device=cpu,batch_size={batch_size}",
                tasks=[task],
                limit=limit,
                task_manager=tm,
                verbosity="ERROR",
            )
            times[name].append(time.perf_counter() - t)
    return statistics.median(times["hf"]), statistics.median(times["capsense-masked"])


def bench_batched_masks(model_name: str, rows: int, seq: int, repeats: int, sparsity: float) -> tuple[float, float]:
    import torch

    from capsense.core.ablation import HeadAblator
    from capsense.core.models import load_model

    model, _ = load_model(model_name)
    ablator = HeadAblator(model)
    layout = ablator.layout
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 20000, (rows, seq), generator=g)
    ko = torch.rand(rows, layout.n_layers, layout.n_heads, generator=g) < sparsity
    plain, masked = [], []
    with torch.no_grad():
        model(ids[:2])  # warm-up
        for _ in range(repeats):
            t = time.perf_counter()
            model(ids)
            plain.append(time.perf_counter() - t)
            t = time.perf_counter()
            with ablator.apply(ko):
                model(ids)
            masked.append(time.perf_counter() - t)
    return statistics.median(plain) / rows, statistics.median(masked) / rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="capsense_addition")
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--sparsity", type=float, default=0.02)
    args = ap.parse_args()

    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, model {args.model}")
    hf, masked = bench_lm_eval(args.model, args.task, args.limit, args.repeats, args.batch_size)
    print(f"lm-eval {args.task} x{args.limit}: hf {hf:.2f} s, capsense-masked (no heads) {masked:.2f} s, "
          f"ratio {masked / hf:.3f}x (goal <= 1.05x)")
    plain, per_mask = bench_batched_masks(args.model, args.rows, args.seq, args.repeats, args.sparsity)
    print(f"forward of {args.rows} rows x {args.seq} tokens: plain {1e3 * plain:.2f} ms/row, "
          f"one knockout mask per row {1e3 * per_mask:.2f} ms/row, ratio {per_mask / plain:.3f}x (goal <= 1.15x)")


if __name__ == "__main__":
    main()

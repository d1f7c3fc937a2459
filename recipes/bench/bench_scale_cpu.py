"""CPU throughput of knockout evaluations: 2 processes x 1 thread vs 1 process x 2 threads (SmolLM2-135M).

    flock /tmp/capsense-heavy.lock python recipes/bench/bench_scale_cpu.py [--task capsense_induction] [--limit 12] [--masks 24]

Runs the same ``capsense locate`` twice, side by side in one invocation, on fresh run folders:

1. one process with 2 threads: ``OMP_NUM_THREADS=2 python -m capsense locate ...``;
2. two processes with 1 thread each: ``OMP_NUM_THREADS=1 accelerate launch --multi_gpu
   --num_processes 2 -m capsense locate ...`` (``--multi_gpu`` is what makes accelerate start
   several processes on a machine without GPUs; each joins a gloo process group).

Reports knockout evaluations per second of the evaluation phase (the manifest's
``evaluate_s_this_attempt``, model loading excluded), the wall time of each command (loading
included), their ratio, and whether both runs produced the same masks and the same ranking
(scores may differ in the last bits: the thread count changes float summation order).
Writes ``--out`` (default recipes/results/bench_scale_cpu.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _locate_args(args, out: Path) -> list[str]:
    return ["locate", args.model, "--task", args.task, "--limit", str(args.limit), "--method", "cs", "--masks", str(args.masks),
            "--refine", "0", "--dtype", "float32", "--quiet", "--out", str(out),
            *(["--include-path", args.include_path] if args.include_path else [])]


def _run(cmd: list[str], threads: int, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    timing = json.loads((out / "manifest.json").read_text())["timing"]
    n, secs = timing["new_evaluations_this_attempt"], timing["evaluate_s_this_attempt"]
    return {"command": " ".join(cmd), "threads_per_process": threads, "processes": timing.get("processes", 1),
            "evaluations": n, "evaluate_s": secs, "evaluations_per_s": round(n / secs, 4), "wall_s": round(wall, 1)}


def _lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "evaluations.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="capsense_induction")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--masks", type=int, default=24)
    ap.add_argument("--include-path", help="Extra lm-eval task folder (for a smoke run on a toy task).")
    ap.add_argument("--out", default="recipes/results/bench_scale_cpu.json")
    args = ap.parse_args()
    accelerate = Path(sys.executable).parent / "accelerate"
    tmp = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    try:
        one, two = tmp / "one", tmp / "two"
        single = _run([sys.executable, "-m", "capsense", *_locate_args(args, one)], 2, one)
        print(f"1 process x 2 threads: {single}", file=sys.stderr, flush=True)
        launch = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                  "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_port()),
                  "-m", "capsense", *_locate_args(args, two)]
        double = _run(launch, 1, two)
        print(f"2 processes x 1 thread: {double}", file=sys.stderr, flush=True)
        a, b = _lines(one), _lines(two)
        same_masks = [(e["i"], e["heads"]) for e in a] == [(e["i"], e["heads"]) for e in b]
        diff = max(abs(x["scores"][t][m] - y["scores"][t][m]) for x, y in zip(a, b) for t in x["scores"] for m in x["scores"][t])
        rank = lambda p: [(h["layer"], h["head"]) for h in json.loads((p / "heads.json").read_text())["heads"][:10]]  # noqa: E731
        result = {
            "model": args.model, "task": args.task, "limit": args.limit, "masks": args.masks, "cpu_count": os.cpu_count(),
            "one_process_two_threads": single, "two_processes_one_thread": double,
            "ratio_evaluations_per_s_2x1_vs_1x2": round(double["evaluations_per_s"] / single["evaluations_per_s"], 3),
            "ratio_wall_1x2_vs_2x1": round(single["wall_s"] / double["wall_s"], 3),
            "same_masks": same_masks, "max_abs_score_diff": diff, "same_top10": rank(one) == rank(two),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""capsense-masked's log-likelihoods with the LM head at the continuations only, against lm-eval ``hf``'s path, side by side.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=2 python recipes/bench/bench_loglikelihood.py \\
        [--model smollm2-135m] [--tasks capsense_induction,...] [--heads L18H7+...] [--limit 40] [--repeats 2]

One loaded ``capsense-masked`` model (float32, batch size 16, ``--heads`` ablated: the SmolLM2 main job's set by
default) evaluates the tasks with ``lm_eval.simple_evaluate`` (``--limit`` documents each), alternately on ``hf``'s own
path (``full_logits``: every position's logits and log-softmax) and on capsense's
(:mod:`capsense.evaluation.loglikelihood`), ``--repeats`` times each. Prints the seconds of each run and the ratio of
the sums, every request's largest |difference| in log-likelihood, how many greedy flags differ, and whether each
task's metrics agree to 6 decimals. Writes ``recipes/results/loglikelihood.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

MAIN_JOB_SET = "L18H7+L19H8+L11H4+L8H0+L12H2"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", default="capsense_induction,capsense_facts,capsense_antonyms,capsense_conversions,"
                                       "capsense_arithmetic,capsense_prose")
    ap.add_argument("--heads", default=MAIN_JOB_SET)
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="recipes/results/loglikelihood.json")
    args = ap.parse_args()

    import lm_eval
    from lm_eval.api.registry import get_model

    import capsense.evaluation.lm_eval_model  # noqa: F401  (registers capsense-masked)
    from capsense.tasks import task_manager

    tasks = args.tasks.split(",")
    tm = task_manager(metadata={"pretrained": args.model})
    lm = get_model("capsense-masked")(pretrained=args.model, heads=args.heads, batch_size=16, device="cpu",
                                      dtype="float32")

    def run(full: bool) -> tuple[float, dict]:
        lm.full_logits = full
        t0 = time.perf_counter()
        out = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=args.limit, task_manager=tm, log_samples=True,
                                      verbosity="ERROR")
        return time.perf_counter() - t0, out

    seconds: dict[str, list[float]] = {"hf": [], "capsense": []}
    outs: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, full in (("hf", True), ("capsense", False)):
            s, outs[name] = run(full)
            seconds[name].append(round(s, 2))
    worst, flips, n, agree = 0.0, 0, 0, {}
    for t in tasks:
        for a, b in zip(outs["hf"]["samples"][t], outs["capsense"]["samples"][t], strict=True):
            for ra, rb in zip(a["resps"], b["resps"], strict=True):
                worst, flips, n = max(worst, abs(ra[0][0] - rb[0][0])), flips + (ra[0][1] != rb[0][1]), n + 1
        ma, mb = outs["hf"]["results"][t], outs["capsense"]["results"][t]
        agree[t] = all(round(ma[k], 6) == round(mb[k], 6) for k in ma if isinstance(ma[k], float))
    ratio = sum(seconds["capsense"]) / sum(seconds["hf"])
    print(f"hf's path {seconds['hf']} s, capsense's {seconds['capsense']} s: ratio {ratio:.3f}")
    print(f"{n} requests: largest |delta log-likelihood| {worst:.3g} nats, greedy flags that differ: {flips}")
    print("metrics agree to 6 decimals: " + ", ".join(f"{t} {v}" for t, v in agree.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "model": args.model, "heads": args.heads, "tasks": tasks, "limit": args.limit, "seconds": seconds,
        "ratio_capsense_to_hf": round(ratio, 3), "requests": n, "largest_abs_delta_loglikelihood": worst,
        "greedy_flags_differing": flips, "metrics_agree_to_6_decimals": agree}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

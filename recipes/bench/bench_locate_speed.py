"""Speed of mask evaluation on SmolLM2-135M (CPU), measured side by side in one process.

    HF_HUB_OFFLINE=1 python recipes/bench/bench_locate_speed.py [--task capsense_induction] [--limit 24] [--threads 1]

1. Reference method (the paper's code): for each mask, reload the model, build the lm-eval
   task, run lm-eval's ``hf`` model at batch size 1 with the heads ablated
   (``capsense-masked``, which is ``hf`` plus hooks) on the same documents.
2. capsense: model loaded once, the probe tokenized once, logits only at scored positions,
   prefix reuse, float32; same documents, random 5-head masks.
3. Exhaustive sweep with vs without prefix reuse: one head per layer (layer order, as in
   the sweep, so the ratio is the full sweep's), scores compared (float32); for multiple choice
   the shared-context scorer with and without its prefix reuse.
4. float32 vs bfloat16 on this CPU.
5. Multiple-choice tasks (e.g. ``--task capsense_antonyms``): each context once per mask
   (shared-context scoring) vs every request in full, scores compared.
Writes recipes/results/locate_speed.json (locate_speed_<task>.json for other tasks).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

TASK = "capsense_induction"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ref-masks", type=int, default=2)
    ap.add_argument("--masks", type=int, default=8)
    ap.add_argument("--task", default=TASK)
    ap.add_argument("--skip-sweep", action="store_true", help="Skip the prefix-reuse sweep and the bf16 check.")
    ap.add_argument("--out")
    args = ap.parse_args()
    task = args.task
    args.out = args.out or ("recipes/results/locate_speed.json" if task == TASK else f"recipes/results/locate_speed_{task}.json")
    torch.set_num_threads(args.threads)

    from capsense.core.heads import HeadSet
    from capsense.localize.evaluator import MaskEvaluator
    from capsense.scoring.probe import build_probe
    from capsense.core.models import load_model, resolve_pretrained
    from capsense.core.provenance import cpu_info
    from capsense.localize.evaluator import scorer_class
    from capsense.scoring.probe import ProbeScorer

    rng = np.random.default_rng(0)
    masks = np.zeros((args.masks, 270), dtype=bool)
    for i in range(args.masks):
        masks[i, rng.choice(270, 5, replace=False)] = True
    out: dict = {"limit": args.limit, "threads": args.threads, "task": task}

    # 2. capsense (first, to get the documents)
    model, tok = load_model("smollm2-135m", "float32")
    probe = build_probe(task, tok, args.limit, 0)
    docs = [int(d) for d in probe.doc_ids]
    ev = MaskEvaluator(model, {task: probe}, batch_size=16, masks_per_forward=1, prefix_reuse=True)
    out["capsense_scorer"] = type(ev.scorers[task]).__name__
    ev(masks[:1])  # warm-up and prefix cache
    t0 = time.perf_counter()
    ours = [ev(masks[i : i + 1])[0][task] for i in range(args.masks)]
    out["capsense_s_per_mask"] = (time.perf_counter() - t0) / args.masks
    print("capsense", out["capsense_s_per_mask"], flush=True)

    # 1. reference: reload + build task + lm-eval hf at batch size 1, per mask
    import lm_eval
    from lm_eval.tasks import TaskManager

    from capsense.evaluation.lm_eval_model import CapsenseMaskedLM
    from capsense.tasks import tasks_dir

    path = resolve_pretrained("smollm2-135m")
    ref_times, ref_nll = [], []
    for i in range(args.ref_masks):
        heads = HeadSet.from_pairs([(int(h) // 9, int(h) % 9) for h in np.flatnonzero(masks[i])])
        t0 = time.perf_counter()
        lm = CapsenseMaskedLM(pretrained=path, heads=str(heads), batch_size=1, device="cpu", dtype="float32")
        manager = TaskManager(include_path=[str(tasks_dir())], include_defaults=False, metadata={"pretrained": path})
        res = lm_eval.simple_evaluate(model=lm, tasks=[task], samples={task: docs}, task_manager=manager,
                                      log_samples=False, bootstrap_iters=0, verbosity="ERROR")
        ref_times.append(time.perf_counter() - t0)
        ref_nll.append(res["results"][task]["nats_per_token,none"])
        del lm
        print("reference", ref_times[-1], ref_nll[-1], "capsense", ours[i]["nll"], flush=True)
    out["reference_s_per_mask"] = float(np.mean(ref_times))
    out["speedup_vs_reference"] = out["reference_s_per_mask"] / out["capsense_s_per_mask"]
    out["reference_vs_capsense_nll"] = [[a, b["nll"]] for a, b in zip(ref_nll, ours)]

    # 5. multiple choice: shared context vs every request in full (same masks)
    from capsense.scoring.shared_context import SharedContextScorer, shared_context_groups

    if shared_context_groups(probe) is not None:
        ko5 = torch.from_numpy(masks.reshape(-1, 30, 9).copy())
        plain, shared = ProbeScorer(model, probe, batch_size=16), SharedContextScorer(model, probe, batch_size=16)
        plain.score(ko5[:1]), shared.score(ko5[:1])
        t0 = time.perf_counter(); a = plain.score(ko5)["nll"]; t_plain = time.perf_counter() - t0
        t0 = time.perf_counter(); b = shared.score(ko5)["nll"]; t_shared = time.perf_counter() - t0
        out["full_requests_s_per_mask"], out["shared_context_s_per_mask"] = t_plain / len(ko5), t_shared / len(ko5)
        out["shared_context_speedup"] = t_plain / t_shared
        out["shared_context_max_abs_diff_nll"] = float(np.abs(a - b).max())
        print("shared context", out["shared_context_speedup"], out["shared_context_max_abs_diff_nll"], flush=True)
    if args.skip_sweep:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(json.dumps(out, indent=1))
        return

    # 3. exhaustive sweep: prefix reuse vs full forward, one head per layer (the evaluator's scorer with
    # and without reuse: for multiple choice both share the context, round 11's reuse replays both passes)
    ko = torch.zeros(30, 30, 9, dtype=torch.bool)
    for layer in range(30):
        ko[layer, layer, layer % 9] = True
    full, reuse = (scorer_class(probe, 1, on)(model, probe, batch_size=16) for on in (False, True))
    out["sweep_scorers"] = [type(full).__name__, type(reuse).__name__]
    full.score(ko[:1]), reuse.score(ko[:1])
    t0 = time.perf_counter()
    a = np.concatenate([full.score(ko[i : i + 1])["nll"] for i in range(30)])
    t_full = time.perf_counter() - t0
    t0 = time.perf_counter()
    b = np.concatenate([reuse.score(ko[i : i + 1])["nll"] for i in range(30)])
    t_reuse = time.perf_counter() - t0
    out["sweep_full_s"], out["sweep_prefix_reuse_s"] = t_full, t_reuse
    out["prefix_reuse_speedup"] = t_full / t_reuse
    out["prefix_reuse_max_abs_diff_nll"] = float(np.abs(a - b).max())
    print("prefix reuse", out["prefix_reuse_speedup"], out["prefix_reuse_max_abs_diff_nll"], flush=True)

    # 4. bf16 vs fp32 on this CPU (full forward, 3 masks)
    m16, _ = load_model("smollm2-135m", "bfloat16")
    s16, s32 = ProbeScorer(m16, probe, batch_size=16), ProbeScorer(model, probe, batch_size=16)
    s16.score(ko[:1])
    t0 = time.perf_counter(); s32.score(ko[:3]); t32 = time.perf_counter() - t0
    t0 = time.perf_counter(); s16.score(ko[:3]); t16 = time.perf_counter() - t0
    out["bf16_speedup_vs_fp32"] = t32 / t16
    cpu = cpu_info()
    out["cpu_has_avx512_bf16"] = cpu["avx512_bf16"] or cpu["amx_bf16"]
    print("bf16/fp32", out["bf16_speedup_vs_fp32"], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

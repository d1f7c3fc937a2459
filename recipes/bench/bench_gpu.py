"""Knockout evaluations per second on a GPU: capsense vs the reference method, real model shapes.

    python recipes/bench/bench_gpu.py [--models llama-3.2-1b,llama-3.1-8b] [--requests 100] [--context 512]
    python recipes/bench/bench_gpu.py --cpu-smoke      # a tiny config on the CPU: checks the script end to end

Needs no download: each model is built from its published config on the ``meta`` device and
materialised on the GPU in bfloat16 with random weights (speed and memory depend on shapes,
not on values). The task is synthetic: ``--requests`` requests of ``--context`` random tokens
plus a 4-token continuation (a realistic few-shot prompt length). For each model:

* capsense: model loaded once, requests tokenized once, logits only at scored positions,
  ``masks_per_forward`` 1, 4 and 16 masks packed per forward pass (and the most that fit in
  half the free memory: what ``auto`` packs without prefix reuse), 5% of heads knocked out per mask;
  then one mask per forward at each of ``--batch-sizes`` requests per forward (``auto``: what
  ``--batch-size auto`` resolves to, :func:`capsense.core.placement.auto_batch_size`), side by side;
  then the gradient attribution against a clean forward of the same requests (``attribution``: its
  cost in measured forward-equivalents beside the 3 the budget charges; ``bench_attribution_cost.py``);
* reference (the paper's code): per mask, reload the weights (copied from host memory, the
  best case of ``from_pretrained`` from a warm page cache), zero the knocked-out heads, and
  score every request at batch size 1 with full logits, as lm-eval's ``hf`` model does.

Reports evaluations/s, seconds per mask, peak GPU memory and the ratio to the reference, and
the agreement of packed masks and of run-time masks with zeroed weights (``agreement``);
then GPTQ's and SparseGPT's solve of each ``--solve-shapes`` down projection on the CPU and on the
GPU side by side (``solve_on`` cpu / layer; :mod:`bench_gptq_solve`, ``solve`` in the JSON);
writes ``--out`` (default recipes/results/bench_gpu.json). Where there is no GPU it prints
a message and exits with status 0 without measuring anything (``--cpu-smoke`` aside).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

# Published configs (config.json of meta-llama/Llama-3.2-1B and meta-llama/Llama-3.1-8B).
CONFIGS = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=False),
}
COMMON = dict(max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def build(name: str, device: str, dtype: torch.dtype):
    """The model of ``name``'s config, built on ``meta`` and materialised with random weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**CONFIGS[name], **COMMON)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g) if p.dim() > 1 else p.fill_(1.0)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg).to(device)  # its buffers, computed
    return model.eval()


def synthetic_probe(vocab: int, requests: int, context: int, seed: int = 0):
    from capsense.scoring.probe import Probe

    rng = np.random.default_rng(seed)
    ctx = [[1, *rng.integers(3, vocab, size=context - 1).tolist()] for _ in range(requests)]
    cont = [rng.integers(3, vocab, size=4).tolist() for _ in range(requests)]
    return Probe(name="synthetic", kind="loglikelihood", context_ids=ctx, continuation_ids=cont,
                 doc_of=np.arange(requests), doc_ids=list(range(requests)))


def random_masks(n_masks: int, n_layers: int, n_heads: int, frac: float = 0.05) -> torch.Tensor:
    rng = np.random.default_rng(1)
    n, k = n_layers * n_heads, max(1, round(frac * n_layers * n_heads))
    ko = np.zeros((n_masks, n), dtype=bool)
    for i in range(n_masks):
        ko[i, rng.choice(n, k, replace=False)] = True
    return torch.from_numpy(ko.reshape(n_masks, n_layers, n_heads))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def peak_reset(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def bench_capsense(model, probe, masks: torch.Tensor, mpf: int, batch_size: int, device: str) -> dict:
    from capsense.scoring.probe import ProbeScorer

    scorer = ProbeScorer(model, probe, batch_size=batch_size * mpf, masks_per_forward=mpf)
    scorer.score(masks[:mpf])  # warm-up (kernels, allocator)
    peak_reset(device)
    sync(device)
    t0 = time.perf_counter()
    nll = scorer.score(masks)["nll"]
    sync(device)
    dt = time.perf_counter() - t0
    return {"masks_per_forward": mpf, "masks": len(masks), "seconds": round(dt, 3),
            "evaluations_per_s": round(len(masks) / dt, 4), "peak_gib": peak_gib(device),
            "nll": [round(float(x), 6) for x in nll]}


@torch.no_grad()
def bench_reference(model, probe, masks: torch.Tensor, device: str) -> dict:
    """Per mask: weights reloaded from host memory, heads zeroed in the weights, batch size 1, full logits."""
    from capsense.core.ablation import zero_heads_in_weights
    from capsense.core.heads import HeadSet

    host = {k: v.detach().to("cpu", copy=True).pin_memory() if device.startswith("cuda") else v.detach().clone()
            for k, v in model.state_dict().items()}
    peak_reset(device)
    sync(device)
    t0 = time.perf_counter()
    nll = []
    n_tokens = sum(len(t) for t in probe.continuation_ids)
    for ko in masks:
        model.load_state_dict(host)  # "reload the model"
        heads = HeadSet.from_pairs([(int(l), int(h)) for l, h in torch.nonzero(ko).tolist()])
        zero_heads_in_weights(model, heads)
        total = 0.0
        for c, t in zip(probe.context_ids, probe.continuation_ids):
            ids = torch.tensor([c + t[:-1]], device=device)
            logp = torch.log_softmax(model(ids).logits.float(), -1)  # every position, as lm-eval's hf
            tgt = torch.tensor(t, device=device)
            total += float(logp[0, -len(t):].gather(1, tgt[:, None]).sum())
        nll.append(round(-total / n_tokens, 6))
    sync(device)
    dt = time.perf_counter() - t0
    model.load_state_dict(host)
    return {"masks": len(masks), "seconds": round(dt, 3), "evaluations_per_s": round(len(masks) / dt, 4),
            "peak_gib": peak_gib(device), "nll": nll}


def agreement(model, probe, rows: list[dict], ref_masks: torch.Tensor, ref: dict, batch_size: int) -> dict:
    """How far the packed settings and the weight-zeroing reference are from one mask per forward pass.

    ``packing_max_abs_dnll``: per setting, the largest |nll| difference (nats/token) from the
    ``masks_per_forward`` 1 row over the masks both scored (every setting draws its masks from one
    seed, so the first ones are shared). ``vs_weights_max_abs_dnll``: the reference's masks scored
    by capsense (masks applied at run time, batched, padded) against the reference (heads zeroed
    in the output projection's weights, batch size 1): the exactness of the ablation at these
    shapes and this dtype, where kernels differ with batch shape.
    """
    from capsense.scoring.probe import ProbeScorer

    base = next((r for r in rows if r.get("masks_per_forward") == 1 and "nll" in r), None)
    packing = {}
    for r in rows:
        if base is None or r is base or "nll" not in r:
            continue
        n = min(len(base["nll"]), len(r["nll"]))
        packing[str(r["masks_per_forward"])] = float(np.max(np.abs(np.subtract(base["nll"][:n], r["nll"][:n]))))
    ours = ProbeScorer(model, probe, batch_size=batch_size).score(ref_masks)["nll"]
    return {"packing_max_abs_dnll": packing,
            "vs_weights_max_abs_dnll": float(np.max(np.abs(ours - np.asarray(ref["nll"])))),
            "nll_scale": float(np.mean(ref["nll"]))}


def run_model(name: str, args, device: str) -> dict:
    from capsense.core.placement import auto_masks_per_forward

    t0 = time.perf_counter()
    model = build(name, device, torch.bfloat16 if device.startswith("cuda") else torch.float32)
    cfg = model.config
    out: dict = {"model": name, "build_s": round(time.perf_counter() - t0, 1),
                 "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3)}
    probe = synthetic_probe(cfg.vocab_size, args.requests, args.context)
    auto = auto_masks_per_forward(model, args.batch_size, args.context + 4, prefix_reuse=False)  # it packs: no reuse
    out["auto_masks_per_forward"] = auto
    rows = []
    for mpf in sorted({*args.masks_per_forward, auto}):
        masks = random_masks(max(args.masks, 2 * mpf), cfg.num_hidden_layers, cfg.num_attention_heads)
        try:
            rows.append(bench_capsense(model, probe, masks, mpf, args.batch_size, device))
        except torch.OutOfMemoryError:
            rows.append({"masks_per_forward": mpf, "error": "out of memory"})
        print(f"{name} capsense mpf={mpf}: {rows[-1]}", file=sys.stderr, flush=True)
    out["capsense"] = rows
    out["batch_sizes"] = bench_batch_sizes(model, probe, args, device)
    out["attribution"] = bench_attribution(model, probe, args.batch_size, device)
    ref_masks = random_masks(args.ref_masks, cfg.num_hidden_layers, cfg.num_attention_heads)
    ref = bench_reference(model, probe, ref_masks, device)
    print(f"{name} reference: {ref}", file=sys.stderr, flush=True)
    out["reference"] = ref
    out["agreement"] = agreement(model, probe, rows, ref_masks, ref, args.batch_size)
    print(f"{name} agreement: {out['agreement']}", file=sys.stderr, flush=True)
    best = max((r for r in rows if "evaluations_per_s" in r), key=lambda r: r["evaluations_per_s"])
    out["speedup_best_vs_reference"] = round(best["evaluations_per_s"] / ref["evaluations_per_s"], 1)
    out["best_masks_per_forward"] = best["masks_per_forward"]
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def bench_batch_sizes(model, probe, args, device: str) -> list[dict]:
    """One mask per forward at each of ``args.batch_sizes`` (``auto`` resolved as locate resolves it), the same
    masks each time; evaluations/s and the ratio to the first size."""
    from capsense.core.placement import auto_batch_size

    masks = random_masks(args.masks, model.config.num_hidden_layers, model.config.num_attention_heads)
    rows = []
    for size in args.batch_sizes:
        n = auto_batch_size(model, args.context + 4, 4, args.requests) if size == "auto" else int(size)
        try:
            row = {"batch_size": size, "resolved": n, **bench_capsense(model, probe, masks, 1, n, device)}
        except torch.OutOfMemoryError:
            row = {"batch_size": size, "resolved": n, "error": "out of memory"}
        if rows and "evaluations_per_s" in rows[0] and "evaluations_per_s" in row:
            row["vs_first"] = round(row["evaluations_per_s"] / rows[0]["evaluations_per_s"], 3)
        rows.append(row)
        print(f"batch size {size} ({n}): {row.get('evaluations_per_s', row.get('error'))} evaluations/s "
              f"{('x' + str(row['vs_first'])) if 'vs_first' in row else ''}", file=sys.stderr, flush=True)
    return rows


def bench_attribution(model, probe, batch_size: int, device: str) -> dict:
    """The gradient attribution (forward and backward, weights frozen) against a clean forward of the same
    requests, in measured forward-equivalents beside the 3 the budget charges (``bench_attribution_cost.py``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_attribution_cost import time_attribution

    peak_reset(device)
    try:
        row = time_attribution(model, probe, batch_size, repeats=3, sync=lambda: sync(device))
        row["peak_gib"] = peak_gib(device)
    except torch.OutOfMemoryError:
        row = {"error": "out of memory"}
    print(f"attribution: {row.get('measured_fe', row.get('error'))} measured FE", file=sys.stderr, flush=True)
    return row


def table(results: list[dict]) -> str:
    lines = ["| model | method | masks/forward | evaluations/s | s/mask | peak GiB | vs reference |", "|---|---|---|---|---|---|---|"]
    for r in results:
        ref = r["reference"]["evaluations_per_s"]
        for c in r["capsense"]:
            if "error" in c:
                lines.append(f"| {r['model']} | capsense | {c['masks_per_forward']} | {c['error']} | | | |")
                continue
            lines.append(f"| {r['model']} | capsense | {c['masks_per_forward']} | {c['evaluations_per_s']:.3f} | "
                         f"{1 / c['evaluations_per_s']:.3f} | {c['peak_gib'] or '-'} | x{c['evaluations_per_s'] / ref:.1f} |")
        rr = r["reference"]
        lines.append(f"| {r['model']} | reference (reload, bs 1) | 1 | {ref:.3f} | {1 / ref:.3f} | {rr['peak_gib'] or '-'} | x1 |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama-3.2-1b,llama-3.1-8b")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--context", type=int, default=512, help="Tokens per request (prompt).")
    ap.add_argument("--batch-size", type=int, default=16, help="Requests per forward pass for one mask.")
    ap.add_argument("--masks", type=int, default=32, help="Masks timed per capsense setting.")
    ap.add_argument("--ref-masks", type=int, default=2, help="Masks timed for the (slow) reference method.")
    ap.add_argument("--masks-per-forward", default="1,4,16")
    ap.add_argument("--batch-sizes", default="16,auto",
                    help="Requests per forward timed side by side at one mask per forward (auto: as locate resolves it).")
    ap.add_argument("--solve-shapes", default="llama-3.2-1b,llama-3.1-8b",
                    help="GPTQ/SparseGPT solves timed on the CPU and the GPU (bench_gptq_solve.py's shapes; '' for none).")
    ap.add_argument("--cpu-smoke", action="store_true", help="Tiny config on the CPU, a few requests: checks the script runs.")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    args.masks_per_forward = [int(x) for x in args.masks_per_forward.split(",")]
    args.batch_sizes = [x.strip() for x in args.batch_sizes.split(",") if x.strip()]
    if args.cpu_smoke:
        device, models = "cpu", ["tiny"]
        args.requests, args.context, args.masks, args.ref_masks = 6, 24, 4, 2
        args.masks_per_forward, args.batch_sizes = [1, 2], ["2", "auto"]
        args.solve_shapes = "64x256"
    elif not torch.cuda.is_available():
        print("bench_gpu: no GPU here (torch.cuda.is_available() is False): nothing measured. "
              "Run it on a machine with a CUDA GPU, or pass --cpu-smoke to check the script on a tiny config.")
        return 0
    else:
        device, models = "cuda", [m.strip() for m in args.models.split(",") if m.strip()]
        unknown = [m for m in models if m not in CONFIGS]
        if unknown:
            print(f"bench_gpu: unknown model(s) {unknown}; known: {', '.join(CONFIGS)}", file=sys.stderr)
            return 2
    results = [run_model(m, args, device) for m in models]
    info = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "requests": args.requests, "context_tokens": args.context, "batch_size": args.batch_size, "results": results}
    if args.solve_shapes:
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_gptq_solve.py is beside this script
        from bench_gptq_solve import parse_shape, run_shape

        info["solve"] = [run_shape(*parse_shape(s.strip()), ["cpu"] if device == "cpu" else ["cpu", device], 4096)
                         for s in args.solve_shapes.split(",") if s.strip()]
    print(table(results))
    for r in results:
        print(f"{r['model']}, one mask per forward: " + "; ".join(
            f"batch {b['batch_size']} ({b['resolved']}): " + (f"{b['evaluations_per_s']:.3f} evaluations/s"
                                                             f"{' x' + str(b['vs_first']) if 'vs_first' in b else ''}"
                                                             if "evaluations_per_s" in b else b["error"])
            for b in r["batch_sizes"]))
    for r in results:
        t = r["attribution"]
        print(f"{r['model']}, attribution at batch {args.batch_size}: " + (
            f"{t['median_attribution_s']:.3f} s against a clean forward's {t['median_forward_s']:.3f} s = "
            f"{t['measured_fe']:.2f} FE measured (charged {t['charged_fe']:.0f})" if "measured_fe" in t else t["error"]))
    for r in results:
        a = r["agreement"]
        print(f"{r['model']}: |dnll| packed vs one mask per forward {a['packing_max_abs_dnll']}; "
              f"masks at run time vs heads zeroed in the weights {a['vs_weights_max_abs_dnll']:.2e} "
              f"(nll ~{a['nll_scale']:.2f} nats/token)")
    from capsense.core.files import atomic_write_json

    default = "recipes/results/bench_gpu_cpu_smoke.json" if args.cpu_smoke else "recipes/results/bench_gpu.json"
    print(f"wrote {atomic_write_json(args.out or default, info)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Does an adapter exported by capsense score every sample as ``capsense-masked`` does, in stock lm-eval?

    HF_HUB_OFFLINE=1 python recipes/bench/adapter_parity.py --model smollm2-135m \\
        --heads L18H7+L19H8+L8H0+L11H4+L12H2 --ablation mean --task capsense_induction --limit 40 \\
        --out recipes/results/adapter_parity_mean_r36.json

Exports the PEFT adapter (``capsense.ship.adapter.export_adapter``: IA3 for zero ablation, a LoRA with a bias for
mean ablation) into a temporary folder, then runs the task through lm-eval three times: ``hf`` with ``peft=`` the
adapter on the unedited base, ``capsense-masked`` with the same heads and ablation, and ``capsense-masked`` under
the other ablation mode, for contrast. It reports the largest per-sample difference of the log-likelihoods between
the adapter and each ``capsense-masked`` run, the accuracies, and the adapter's size on disk. float32 throughout.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def sample_scores(model: str, model_args: str, task: str, limit: int,
                  include_path: str) -> tuple[dict[int, list[float]], float]:
    """Each document's log-likelihoods (one per request) and the task's accuracy, from lm-eval's logged samples."""
    import lm_eval

    import capsense.evaluation.lm_eval_model  # noqa: F401  (registers capsense-masked)
    from capsense.tasks import task_manager

    res = lm_eval.simple_evaluate(model=model, model_args=f"{model_args},dtype=float32", tasks=[task], limit=limit,
                                  task_manager=task_manager([include_path], [task]), device="cpu",
                                  batch_size=8, log_samples=True, bootstrap_iters=0, verbosity="ERROR")
    scores = {s["doc_id"]: [float(r[0]) for request in s["resps"] for r in request] for s in res["samples"][task]}
    return scores, float(res["results"][task]["acc,none"])


def largest_difference(a: dict[int, list[float]], b: dict[int, list[float]]) -> float:
    """The largest absolute difference of two runs' per-request log-likelihoods over the same documents."""
    if a.keys() != b.keys():
        raise SystemExit("the two runs scored different documents")
    return max(abs(x - y) for d in a for x, y in zip(a[d], b[d], strict=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--heads", required=True, help="a head spec, e.g. L18H7+L19H8")
    ap.add_argument("--ablation", choices=("zero", "mean"), default="mean")
    ap.add_argument("--task", required=True)
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--include-path", default=str(REPO / "lm_eval_tasks"), help="where the task's YAML lives")
    ap.add_argument("--out", type=Path, help="write the result here (JSON)")
    args = ap.parse_args(argv)
    from capsense.core.models import resolve_pretrained
    from capsense.ship.adapter import export_adapter

    other = "zero" if args.ablation == "mean" else "mean"
    with tempfile.TemporaryDirectory() as tmp:
        adapter = export_adapter(args.model, args.heads, Path(tmp) / "adapter", ablation=args.ablation).out
        size = sum(f.stat().st_size for f in adapter.iterdir() if f.name.startswith("adapter_model"))
        peft, peft_acc = sample_scores("hf", f"pretrained={resolve_pretrained(args.model)},peft={adapter}",
                                       args.task, args.limit, args.include_path)
    masked_args = f"pretrained={args.model},heads={args.heads}"
    same, same_acc = sample_scores("capsense-masked", f"{masked_args},ablation={args.ablation}", args.task,
                                   args.limit, args.include_path)
    contrast, contrast_acc = sample_scores("capsense-masked", f"{masked_args},ablation={other}", args.task,
                                           args.limit, args.include_path)
    result = {"model": args.model, "heads": args.heads, "ablation": args.ablation, "task": args.task,
              "documents": len(peft), "adapter_bytes": size,
              "acc": {"hf+peft": peft_acc, f"capsense-masked {args.ablation}": same_acc,
                      f"capsense-masked {other}": contrast_acc},
              "largest_difference": {f"capsense-masked {args.ablation}": largest_difference(peft, same),
                                     f"capsense-masked {other}": largest_difference(peft, contrast)}}
    print(f"{args.ablation}-ablation adapter, {size / 2**20:.2f} MiB; {args.task}, {len(peft)} documents: "
          f"largest per-sample log-likelihood difference from capsense-masked {args.ablation} "
          f"{result['largest_difference'][f'capsense-masked {args.ablation}']:.2e}, from {other} "
          f"{result['largest_difference'][f'capsense-masked {other}']:.2e}; acc {peft_acc:.3f} / {same_acc:.3f} / "
          f"{contrast_acc:.3f}")
    if args.out:
        from capsense.core.files import atomic_write_json
        from capsense.core.provenance import provenance

        print(f"wrote {atomic_write_json(args.out, {**result, **provenance('cpu')})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How much single heads and head sets move a control task's loss, and what the task costs a knockout.

Round 16 chose the forms of the default suite's question tasks with it (recipes/results/RESULTS-locate.md):

    HF_HUB_OFFLINE=1 python recipes/bench/bench_control_sensitivity.py \\
        --tasks conversions:2,conversions:1,categories:1,categories:3 \\
        --heads L16H0,L12H2,L19H8+L18H7+L8H0+L11H4+L12H2

Each ``module:shots`` builds ``capsense.tasks.<module>.make_docs(shots=...)``; the first ``--docs``
documents become a log-likelihood :class:`~capsense.scoring.probe.Probe` (context and continuation
split as lm-eval splits them) and are scored as the project scores every capability
(:func:`~capsense.compress.capability_loss.measure_probe`: nats per reference token, token-weighted,
float32 LM head) with the model as is and with each head set zeroed
(:class:`capsense.core.ablation.HeadAblator`). Printed per task: the tokens 16 documents cost every
knockout, the base loss and each set's relative change with its paired standard error over documents.
(Round 16's first version had a loop of its own, with the context and the continuation tokenized
together; its figures differ from this one's in the first decimal.)
"""

from __future__ import annotations

import argparse
import importlib

from capsense.compress.capability_loss import measure_probe, paired_difference
from capsense.core.ablation import HeadAblator
from capsense.core.models import load_model
from capsense.scoring.probe import Probe


def task_probe(module: str, shots: int, n_docs: int, tokenizer) -> Probe:
    """The first ``n_docs`` documents of ``capsense.tasks.<module>`` at ``shots`` shots, as a probe."""
    docs = importlib.import_module(f"capsense.tasks.{module}").make_docs(shots=shots)[:n_docs]
    return Probe.from_pairs(f"{module}:{shots}", [(d["context"], d["continuation"]) for d in docs], tokenizer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", required=True, help="module:shots, comma-separated")
    ap.add_argument("--heads", required=True, help="head sets, comma-separated (L3H1+L5H0 is one set)")
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    model, tok = load_model(args.model, dtype=args.dtype)
    ablator = HeadAblator(model)
    for spec in args.tasks.split(","):
        module, shots = spec.split(":")
        probe = task_probe(module, int(shots), args.docs, tok)
        tokens = sum(len(c) + len(t) for c, t in zip(probe.context_ids, probe.continuation_ids))
        base = measure_probe(model, probe)
        changes = []
        for heads in args.heads.split(","):
            with ablator.apply(heads):
                diff, se = paired_difference(base, measure_probe(model, probe))
            changes.append(f"{heads} {100 * diff / base.nll:+.1f}% (+/- {100 * (se or 0.0) / base.nll:.1f})")
        print(f"{module} shots={shots}: {tokens * 16 // probe.n_docs} tokens / 16 docs, base {base.nll:.3f} "
              f"nats/token, acc {base.acc:.2f}; " + "; ".join(changes), flush=True)


if __name__ == "__main__":
    main()

"""How much single heads and head sets move a control task's loss, and what the task costs a knockout.

Round 16 chose the forms of the default suite's question tasks with it (recipes/results/RESULTS-locate.md):

    HF_HUB_OFFLINE=1 python recipes/bench/bench_control_sensitivity.py \\
        --tasks conversions:2,conversions:1,categories:1,categories:3 \\
        --heads L16H0,L12H2,L19H8+L18H7+L8H0+L11H4+L12H2

Each ``module:shots`` builds ``capsense.tasks.<module>.make_docs(shots=...)``; the first ``--docs``
documents are scored (nats per token of the reference continuation, token-weighted) with the model as
is and with each head set zeroed (:class:`capsense.core.ablation.HeadAblator`); printed per task:
the tokens 16 documents cost every knockout, the base loss and each set's relative change.
"""

from __future__ import annotations

import argparse
import importlib

import torch

from capsense.core.ablation import HeadAblator
from capsense.core.models import load_model


def task_loss(model, tok, docs) -> tuple[float, int]:
    """(nats per reference token, total tokens) over ``docs``."""
    nats, n_ref, n_all = 0.0, 0, 0
    for d in docs:
        k = len(tok(d["context"]).input_ids)
        ids = torch.tensor([tok(d["context"] + d["continuation"]).input_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        target = ids[0, 1:]
        nats -= logp[k - 1:].gather(1, target[k - 1:, None]).sum().item()
        n_ref += ids.shape[1] - k
        n_all += ids.shape[1]
    return nats / n_ref, n_all


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
        docs = importlib.import_module(f"capsense.tasks.{module}").make_docs(shots=int(shots))[: args.docs]
        base, tokens = task_loss(model, tok, docs)
        changes = []
        for heads in args.heads.split(","):
            with ablator.apply(heads):
                changes.append(f"{heads} {100 * (task_loss(model, tok, docs)[0] / base - 1):+.1f}%")
        print(f"{module} shots={shots}: {tokens * 16 // len(docs)} tokens / 16 docs, base {base:.3f} nats/token; "
              + "; ".join(changes), flush=True)


if __name__ == "__main__":
    main()

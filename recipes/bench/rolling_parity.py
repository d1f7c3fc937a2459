"""Does a perplexity task's probe score each document as lm-eval does? Side by side on a real model.

    python recipes/bench/newuser_task.py /tmp/usertask
    HF_HUB_OFFLINE=1 python recipes/bench/rolling_parity.py --model smollm2-135m --task user_text \\
        --include-path /tmp/usertask --limit 12

A perplexity task (``output_type: loglikelihood_rolling``) becomes a probe of windows
(:func:`capsense.scoring.requests.rolling_requests`, at :func:`~capsense.scoring.probe.model_max_length`); this scores
it clean with :class:`~capsense.scoring.probe.ProbeScorer`, sums each document's windows, and compares the sums with
what ``capsense-masked``'s ``loglikelihood_rolling`` (lm-eval's own rolling code) returns for the same documents, on
``hf``'s path (``full_logits``) and on capsense's. Prints, per path, the documents, the windows, the first tokens
(lm-eval's prefix token, then the text's) and the largest per-document difference in nats. float32.
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--task", default="user_text")
    ap.add_argument("--include-path", action="append", default=[])
    ap.add_argument("--limit", type=int, default=12)
    args = ap.parse_args()

    import numpy as np

    from capsense.evaluation.lm_eval_model import CapsenseMaskedLM
    from capsense.scoring.probe import KeepsRequestScores, ProbeScorer, build_probe, model_max_length
    from capsense.scoring.requests import load_task, quiet_request_building

    for full in (True, False):
        lm = CapsenseMaskedLM(pretrained=args.model, batch_size=8, device="cpu", dtype="float32", full_logits=full)
        probe = build_probe(args.task, lm.tokenizer, args.limit, 0, args.include_path, window=model_max_length(lm.model))
        scorer = type("Kept", (KeepsRequestScores, ProbeScorer), {})(lm.model, probe)
        scorer.score()
        mine = np.bincount(probe.doc_of, weights=scorer.last[0][0], minlength=probe.n_docs)
        task = load_task(args.task, args.include_path, lm.tokenizer)
        with quiet_request_building():
            task.build_all_requests(samples=sorted(probe.doc_ids), rank=0, world_size=1)
        theirs = dict(zip(sorted(probe.doc_ids), lm.loglikelihood_rolling(task.instances, disable_tqdm=True)))
        diff = np.abs(mine - np.array([theirs[d] for d in probe.doc_ids]))
        print(f"{args.model} {args.task} {'hf path (full_logits)' if full else 'capsense path'}: {probe.n_docs} documents, "
              f"{probe.n_requests} windows at {model_max_length(lm.model)} tokens, first tokens "
              f"{probe.context_ids[0][:1]} + {probe.continuation_ids[0][:3]}, summed log-likelihood "
              f"{sum(theirs.values()):.4f}, largest per-document |difference| {diff.max():.2e} nats")


if __name__ == "__main__":
    main()

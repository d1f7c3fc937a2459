"""Record an exhaustive single-head sweep per document: the clean model and every head knocked out
alone, each document's nats and token count (jsonl, resumable), for replays that need more than the
probe's aggregate nll (e.g. measuring a knockout on a subset of the documents first).

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python recipes/bench/record_perdoc_sweep.py \\
        --model smollm2-135m --task capsense_induction [--out runs/perdoc/smollm2-capsense_induction.jsonl] \\
        [--fold-into recipes/results/locate_smollm2_sweeps.json]

The probe and scorer are the exhaustive sweep's (``bench_locate_recovery.py``'s sweep stage):
``--limit`` 24 documents, ``--seed`` 0, batches of 16, float32, no controls, and the scorer
``capsense.localize.evaluator.scorer_class`` picks (prefix reuse for log-likelihood tasks, a shared
context for multiple choice), with its ``aggregate`` kept per request (:class:`PerDocument`). Line 1
of the jsonl describes the probe (documents, their token counts, the prefix-reuse share), then one
line per evaluation: ``heads`` ([] = clean), per-document ``nats`` (the sum over the document's
scored tokens: all its requests, or the gold choice's for multiple choice) and ``correct``, the
aggregate ``nll`` exactly as the scorer computes it, its forward-equivalents and the process CPU
seconds and wall seconds it took. A rerun skips the heads already recorded (after checking the
probe is the same). ``--fold-into`` writes the finished sweep into a sweeps json the way
``record_sweeps.py`` does (relative nll worsening per head, top 5, hit threshold); ``--compare``
prints the largest difference of the relative effects from a recorded sweep of the task (the check
that the aggregate is the sweep's), the summed CPU and wall seconds and forward-equivalents.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import numpy as np

from capsense.scoring.probe import KeepsRequestScores

HERE = Path(__file__).resolve().parent


class PerDocument(KeepsRequestScores):
    """Mixin for a :class:`~capsense.scoring.probe.ProbeScorer`: the per-request log-probabilities and
    greedy flags its last ``aggregate`` saw (:class:`~capsense.scoring.probe.KeepsRequestScores`) as
    per-document sums."""

    def doc_tokens(self) -> np.ndarray:
        """Scored tokens per document (of the counted requests)."""
        n_tok = np.array([len(t) for t in self._targets])
        return np.bincount(self.probe.doc_of, weights=n_tok * self.probe.counted, minlength=self.probe.n_docs)

    def per_document(self) -> tuple[np.ndarray, np.ndarray]:
        """Per mask of the last ``score`` call: per-document nats ``[m, docs]`` and correctness ``[m, docs]``
        (greedy exact match averaged over the document's requests; for multiple choice, gold chosen)."""
        assert self.last is not None, "score() first"
        logprob, greedy = self.last
        p, w = self.probe, self.probe.counted
        nats = np.stack([np.bincount(p.doc_of, weights=-lp * w, minlength=p.n_docs) for lp in logprob])
        if p.kind == "multiple_choice":
            correct = np.zeros((len(logprob), p.n_docs))
            for d in range(p.n_docs):
                sel = np.flatnonzero(p.doc_of == d)
                correct[:, d] = p.choice_of[sel[np.argmax(logprob[:, sel], axis=1)]] == p.gold[d]
        else:
            count = np.bincount(p.doc_of, minlength=p.n_docs)
            correct = np.stack([np.bincount(p.doc_of, weights=g.astype(float), minlength=p.n_docs) for g in greedy]) / count
        return nats, correct


def recording_scorer(model, probe, batch_size: int = 16):
    """The sweep's own scorer class for ``probe`` with :class:`PerDocument` mixed in."""
    from capsense.localize.evaluator import scorer_class

    base = scorer_class(probe, 1, True)
    cls = type(f"PerDocument{base.__name__}", (PerDocument, base), {"base_name": base.__name__})
    return cls(model, probe, batch_size=batch_size)


def reuse_share(scorer) -> float:
    return 1.0 if getattr(scorer, "reuses_prefix", False) else 0.0


def read_rows(path: Path) -> tuple[dict | None, list[dict]]:
    if not path.is_file():
        return None, []
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return (lines[0], lines[1:]) if lines else (None, [])


def header_of(args, probe, scorer, n_layers: int, n_heads: int) -> dict:
    return {"model": args.model, "task": args.task, "limit": args.limit, "seed": args.seed, "dtype": "float32",
            "batch_size": args.batch_size, "n_layers": n_layers, "n_heads": n_heads, "kind": probe.kind,
            "scorer": scorer.base_name, "doc_ids": [int(d) for d in probe.doc_ids],
            "tokens": [int(t) for t in scorer.doc_tokens()]}


def sweep(args) -> Path:
    """Evaluate the clean model and every head alone that ``args.out`` lacks; returns the file."""
    import torch

    from capsense.core.arch import head_layout
    from capsense.core.models import load_model
    from capsense.scoring.cost import mask_cost
    from capsense.scoring.probe import build_probe

    model, tok = load_model(args.model, "float32", "cpu")
    lay = head_layout(model)
    probe = build_probe(args.task, tok, args.limit, args.seed, ())
    sc = recording_scorer(model, probe, args.batch_size)
    head, rows = read_rows(args.out)
    want = header_of(args, probe, sc, lay.n_layers, lay.n_heads)
    if head is not None and head != {**want, "reuse_share": head.get("reuse_share")}:
        raise SystemExit(f"{args.out} holds another probe or model than this one; choose another --out")
    done = {tuple(r["heads"]) for r in rows}
    todo = [()] + [(h,) for h in range(lay.n_layers * lay.n_heads)]
    todo = [h for h in todo if h not in done][: args.max_masks]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for heads in todo:
            ko = torch.zeros(1, lay.n_layers, lay.n_heads, dtype=torch.bool)
            for h in heads:
                ko[0, h // lay.n_heads, h % lay.n_heads] = True
            c0, w0 = time.process_time(), time.perf_counter()
            nll = float(sc.score(ko)["nll"][0])
            nats, correct = sc.per_document()
            if head is None:  # the first evaluation settles whether prefix reuse is on
                head = {**want, "reuse_share": reuse_share(sc)}
                f.write(json.dumps(head) + "\n")
            row = {"heads": list(heads), "nll": nll, "nats": [round(float(x), 7) for x in nats[0]],
                   "correct": [float(x) for x in correct[0]],
                   "fe": mask_cost(list(heads), lay.n_layers, lay.n_heads, head["reuse_share"]),
                   "cpu_s": round(time.process_time() - c0, 3), "wall_s": round(time.perf_counter() - w0, 3)}
            f.write(json.dumps(row) + "\n")
            f.flush()
    return args.out


def finished(path: Path) -> bool:
    """Whether ``path`` holds the clean model and every head alone."""
    head, rows = read_rows(path)
    return head is not None and len({tuple(r["heads"]) for r in rows}) == 1 + head["n_layers"] * head["n_heads"]


def effects(head: dict, rows: list[dict]) -> tuple[dict, np.ndarray, np.ndarray]:
    """The clean row, and per head (flat order) the relative nll worsening and per-document nats ``[heads, docs]``."""
    n = head["n_layers"] * head["n_heads"]
    clean = next(r for r in rows if r["heads"] == [])
    single = {r["heads"][0]: r for r in rows if len(r["heads"]) == 1}
    if len(single) != n:
        raise SystemExit(f"{head['model']} {head['task']}: {len(single)} of {n} heads recorded; the sweep is not finished")
    eff = np.array([(single[h]["nll"] - clean["nll"]) / clean["nll"] for h in range(n)])
    return clean, eff, np.array([single[h]["nats"] for h in range(n)])


def fold(path: Path, sweeps_json: Path) -> dict:
    """Write the finished per-document sweep into ``sweeps_json`` as ``record_sweeps.py`` records a run folder."""
    spec = importlib.util.spec_from_file_location("record_sweeps", HERE / "record_sweeps.py")
    rs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rs)
    head, rows = read_rows(path)
    clean, eff, _ = effects(head, rows)
    rec = rs.sweep_record(model=head["model"], n_layers=head["n_layers"], n_heads=head["n_heads"],
                          share=head["reuse_share"], limit=head["limit"], seed=head["seed"], dtype=head["dtype"],
                          clean_nll=clean["nll"], clean_acc=float(np.mean(clean["correct"])), eff=dict(enumerate(eff)))
    rs.fold(sweeps_json, {head["task"]: rec})
    return rec


def compare(path: Path, sweeps_json: Path) -> dict:
    """The finished per-document sweep's aggregate against a recorded sweep of the same task."""
    head, rows = read_rows(path)
    clean, eff, _ = effects(head, rows)
    rec = json.loads(sweeps_json.read_text())[head["task"]]
    names = [f"L{h // head['n_heads']}H{h % head['n_heads']}" for h in range(len(eff))]
    diff = np.abs(eff - np.array([rec["effects"][n] for n in names]))
    top5 = [names[h] for h in np.argsort(-eff, kind="stable")[:5]]
    return {"task": head["task"], "max_abs_effect_diff": float(diff.max()), "worst_head": names[int(diff.argmax())],
            "clean_nll": clean["nll"], "recorded_clean_nll": rec["clean_nll"], "top5": top5,
            "recorded_top5": rec["top5"], "cpu_s": round(sum(r["cpu_s"] for r in rows), 1),
            "wall_s": round(sum(r["wall_s"] for r in rows), 1), "fe": round(sum(r["fe"] for r in rows), 2)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--task", required=True)
    ap.add_argument("--limit", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None, help="jsonl (default runs/perdoc/<model>-<task>.jsonl)")
    ap.add_argument("--max-masks", type=int, default=None, help="stop after this many new evaluations")
    ap.add_argument("--fold-into", type=Path, default=None, help="a sweeps json to record the finished sweep into")
    ap.add_argument("--compare", type=Path, default=None, help="a sweeps json holding this task: print the differences")
    args = ap.parse_args(argv)
    if args.limit < 1 or args.batch_size < 1:
        ap.error(f"--limit and --batch-size must be positive (got {args.limit}, {args.batch_size})")
    args.out = args.out or Path("runs/perdoc") / f"{Path(args.model).name}-{args.task}.jsonl"
    sweep(args)
    if args.fold_into:
        rec = fold(args.out, args.fold_into)
        print(args.task, rec["top5"], rec["hit_threshold"], flush=True)
    if args.compare:
        print(json.dumps(compare(args.out, args.compare)), flush=True)


if __name__ == "__main__":
    main()

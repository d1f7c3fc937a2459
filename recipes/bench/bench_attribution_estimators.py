"""Which cheap estimator of single-head knockout effects ranks the exhaustive top 5 best, on every
recorded task of both models at once?

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python recipes/bench/bench_attribution_estimators.py \\
        --case smollm2-135m:recipes/results/locate_smollm2_sweeps.json \\
        --case gemma3-270m:recipes/results/locate_gemma3_sweeps.json \\
        --raw runs/bench-estimators/raw.jsonl --out recipes/results/attribution_estimators

Per (model, task) of the recorded float32 sweeps, on the sweep's own probe (same documents, seed,
limit, no controls, batches of 16), one pass computes per-document head-multiplier gradients
(a multiplier per document row, so the documents' gradients come out of the same backward) of

* the probe's ``nll`` at xi = 1 (capsense's attribution, 1 forward + 1 backward = 3 FE),
* the per-token log-odds ``-(log p - log(1 - p))`` (non-saturating where p -> 1; 2 FE more
  from the same forward),
* the ``nll`` with the gradient dropped through one block of layers (coarse GradDrop of AtP*,
  Kramar et al. 2024: |gradient| averaged over the blocks other than the head's own, against
  cancelling paths; 2 FE per block from the same forward),

and then the ``nll`` gradient at K points ``xi = 1 + eps * v`` with random signs ``v`` (3 FE
each): a Hutchinson estimate of the Hessian's diagonal, ``diag(H) ~ mean_k v_k * (g(1 + eps v_k)
- g(1)) / eps``, for the second-order estimate ``-g + diag(H) / 2`` of a knockout (xi_h: 1 -> 0).
The raw vectors go to ``--raw`` (jsonl, one line per (model, task); a rerun skips what is there),
the estimators are derived from them with their FE cost (the clean forward the search needs
anyway, 1 FE, not included), and scored like ``bench_attribution_ig.py``: top-5 hits (a head
within 5% of the fifth-largest exhaustive effect, the recovery table's rule) in the estimator's
own order and by |estimate|, Spearman against the exhaustive effects, where the true top 5 land.
Then prior-guided search is replayed from each estimator (``replay_prior.py``'s replay: singles
answered exactly from the sweep, groups as sums) for FE to 4/5 and 5/5, the estimator's extra FE
beyond the 3-FE attribution added.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
BLOCKS = 4
EPS = 0.5
K_HUTCH = 4


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Gate(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``flags[i]`` (read at backward time)."""

    @staticmethod
    def forward(ctx, x, flags, i):
        ctx.flags, ctx.i = flags, i
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return (g if ctx.flags[ctx.i] else torch.zeros_like(g)), None, None


@contextmanager
def instrumented(model, xi: torch.Tensor, flags: list[float]):
    """Per-row head multipliers ``xi`` [rows, layers, heads] at the output projections (capsense's
    ``scale_heads``), and a gradient gate on every layer's residual update (``out = in + gate(out - in)``)."""
    from capsense.core.ablation import scale_heads
    from capsense.core.arch import arch_spec, unwrap

    layers = unwrap(model).get_submodule(arch_spec(model).layers)
    handles = []

    def post(l):
        def hook(mod, args, kwargs, out):
            inp = args[0] if args else kwargs["hidden_states"]
            h = out[0] if isinstance(out, tuple) else out
            h2 = inp + _Gate.apply(h - inp, flags, l)
            return (h2, *out[1:]) if isinstance(out, tuple) else h2
        return hook

    try:
        for l, layer in enumerate(layers):
            handles.append(layer.register_forward_hook(post(l), with_kwargs=True))
        with scale_heads(model, xi):
            yield
    finally:
        for h in handles:
            h.remove()


def batch_losses(sc, reqs):
    """Per-row sums (over the probe's token count) of nll and of -log-odds for one batch."""
    from capsense.scoring.logits import output_logits, scored_hidden
    from capsense.scoring.probe import pad_right

    seqs = [sc.base._inputs[r] for r in reqs]
    ids, att = pad_right(seqs, sc.base.pad_id)
    rows, pos, tgt = [], [], []
    for i, (s, r) in enumerate(zip(seqs, reqs)):
        t = sc.base._targets[r]
        rows += [i] * len(t)
        pos += list(range(len(s) - len(t), len(s)))
        tgt += list(t)
    hidden = scored_hidden(sc.model, ids, att)
    logits = output_logits(sc.model, hidden[torch.tensor(rows), torch.tensor(pos)]).float()
    lse = torch.logsumexp(logits, -1)
    t = torch.tensor(tgt)
    logp = logits.gather(1, t[:, None])[:, 0] - lse
    other = logits.scatter(1, t[:, None], float("-inf"))
    log1mp = torch.logsumexp(other, -1) - lse
    r = torch.tensor(rows)
    nll = torch.zeros(len(reqs)).index_add(0, r, -logp) / sc.n_tokens
    lo = torch.zeros(len(reqs)).index_add(0, r, -(logp - log1mp)) / sc.n_tokens
    return nll, lo


def raw_vectors(model, sc, n_layers: int, n_heads: int, seed: int = 0) -> dict:
    """Everything the estimators need, per document where it is free."""
    blocks = np.array_split(np.arange(n_layers), BLOCKS)
    flags = [1.0] * n_layers
    g_nll, g_lo, g_drop, nll0 = [], [], [[] for _ in blocks], 0.0
    for reqs in sc._batches():
        xi = torch.ones(len(reqs), n_layers, n_heads, requires_grad=True)
        with instrumented(model, xi, flags):
            nll, lo = batch_losses(sc, reqs)
        nll0 += float(nll.detach().sum())
        g_nll.append(torch.autograd.grad(nll.sum(), xi, retain_graph=True)[0])
        g_lo.append(torch.autograd.grad(lo.sum(), xi, retain_graph=True)[0])
        for b, blk in enumerate(blocks):
            for l in blk:
                flags[l] = 0.0
            g_drop[b].append(torch.autograd.grad(nll.sum(), xi, retain_graph=b < len(blocks) - 1)[0])
            for l in blk:
                flags[l] = 1.0
    rng = np.random.default_rng(seed)
    hutch = []
    for _ in range(K_HUTCH):
        v = rng.choice([-1.0, 1.0], size=(n_layers, n_heads))
        g = torch.zeros(n_layers, n_heads)
        for reqs in sc._batches():
            xi = (1 + EPS * torch.tensor(v, dtype=torch.float32))[None].repeat(len(reqs), 1, 1).requires_grad_(True)
            with instrumented(model, xi, flags):
                nll, _ = batch_losses(sc, reqs)
            g += torch.autograd.grad(nll.sum(), xi)[0].sum(0)
        hutch.append({"v": v.tolist(), "g": g.double().tolist()})
    cat = lambda xs: torch.cat(xs).double().numpy()  # noqa: E731
    return {"nll": nll0, "g_nll": cat(g_nll).tolist(), "g_lo": cat(g_lo).tolist(),
            "g_drop": [cat(d).tolist() for d in g_drop], "blocks": [b.tolist() for b in blocks], "hutch": hutch}


def _rankmean(*scores: np.ndarray) -> np.ndarray:
    """Mean rank (0 = largest) of each head over several scores, shaped like them."""
    ranks = [np.argsort(np.argsort(-x.reshape(-1), kind="stable"), kind="stable") for x in scores]
    return np.mean(ranks, 0).reshape(scores[0].shape)


def summary(rows: list[dict]) -> list[dict]:
    """Per estimator over every (model, task): hits, Spearman, worst and mean FE to 4/5 and 5/5
    (a search that never gets there counts as 50, the default budget)."""
    out = []
    for label in dict.fromkeys(r["estimator"] for r in rows):
        rs = [r for r in rows if r["estimator"] == label]
        r4 = [r["fe_4of5"] if r["fe_4of5"] is not None else 50.0 for r in rs]
        r5 = [r["fe_5of5"] if r["fe_5of5"] is not None else 50.0 for r in rs]
        out.append({"estimator": label, "FE": rs[0]["fe"], "hits": " ".join(str(r["hits"]) for r in rs),
                    "cases with >= 4/5": sum(r["hits"] >= 4 for r in rs), "Spearman min / mean":
                    f"{min(r['spearman'] for r in rs):.2f} / {np.mean([r['spearman'] for r in rs]):.2f}",
                    "worst 4/5": max(r4), "mean 4/5": round(float(np.mean(r4)), 2),
                    "worst 5/5": max(r5), "mean 5/5": round(float(np.mean(r5)), 2)})
    return out


def estimators(raw: dict, n_heads: int) -> list[tuple[str, float, np.ndarray, bool]]:
    """(label, FE, score per flat head, signed?) derived from one (model, task)'s raw vectors."""
    gd = np.array(raw["g_nll"])  # [docs, L, H]
    lo = np.array(raw["g_lo"])
    drop = np.array(raw["g_drop"])  # [blocks, docs, L, H]
    g = gd.sum(0)
    L = g.shape[0]
    own = np.zeros(L, dtype=int)
    for b, blk in enumerate(raw["blocks"]):
        own[blk] = b
    other = np.array([[b != own[l] for l in range(L)] for b in range(len(raw["blocks"]))], dtype=float)  # [blocks, L]
    gdrop = np.abs(drop.sum(1))  # [blocks, L, H]
    graddrop = (gdrop * other[:, :, None]).sum(0) / np.maximum(other.sum(0), 1)[:, None]
    graddrop_doc = (np.abs(drop) * other[:, None, :, None]).sum((0, 1)) / np.maximum(other.sum(0), 1)[:, None]
    fe_drop = 3 + 2 * len(raw["blocks"])
    out = [("grad@1 (attribution)", 3, -g, True), ("per-document |grad| sum", 3, np.abs(gd).sum(0), False),
           ("per-document grad RMS", 3, np.sqrt((gd ** 2).sum(0)), False),
           ("mean rank of |grad| and per-document |grad| sum", 3, g.size - _rankmean(np.abs(g), np.abs(gd).sum(0)), False),
           ("log-odds grad", 3, -lo.sum(0), True), ("per-document |log-odds grad| sum", 3, np.abs(lo).sum(0), False),
           ("grad + log-odds (both normalised)", 5, -g / np.abs(g).max() - lo.sum(0) / np.abs(lo.sum(0)).max(), True),
           (f"GradDrop, {len(raw['blocks'])} blocks", fe_drop, graddrop, False),
           (f"GradDrop, {len(raw['blocks'])} blocks, per document", fe_drop, graddrop_doc, False)]
    diags = [np.array(h["v"]) * (np.array(h["g"]) - g) / EPS for h in raw["hutch"]]
    for k in (1, 2, 4):
        if k <= len(diags):
            out.append((f"second order, Hutchinson K={k}", 3 + 3 * k, -g + np.mean(diags[:k], 0) / 2, True))
    return [(a, b, c.reshape(-1), d) for a, b, c, d in out]


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(np.argsort(np.argsort(a)), np.argsort(np.argsort(b)))[0, 1])


def score_row(score: np.ndarray, signed: bool, eff: np.ndarray, true: list[int], overlap) -> dict:
    order = list(np.argsort(-score, kind="stable"))
    aorder = list(np.argsort(-np.abs(score), kind="stable"))
    return {"hits": overlap(order[:5], eff), "hits_abs": overlap(aorder[:5], eff), "signed": signed,
            "spearman": round(spearman(score, eff), 3),
            "ranks": [order.index(h) + 1 for h in true], "abs_ranks": [aorder.index(h) + 1 for h in true]}


def compute(cases: list[tuple[str, dict]], raw_path: Path) -> None:
    """Raw vectors of every (model, task) not yet in ``raw_path`` (one model loaded at a time)."""
    from capsense.core.models import load_model
    from capsense.scoring.attribution import AttributionScorer, _frozen
    from capsense.scoring.probe import build_probe

    done = set()
    if raw_path.is_file():
        done = {(r["model"], r["task"]) for r in map(json.loads, raw_path.read_text().splitlines())}
    raw_path.parent.mkdir(parents=True, exist_ok=True)
    for model_name, sweeps in cases:
        todo = [t for t in sorted(sweeps) if (model_name, t) not in done]
        if not todo:
            continue
        model, tok = load_model(model_name, "float32", "cpu")
        for task in todo:
            d = sweeps[task]
            sc = AttributionScorer(model, build_probe(task, tok, d["limit"], d["seed"], ()), batch_size=16)
            from capsense.core.arch import head_layout
            lay = head_layout(model)
            with _frozen(model), torch.enable_grad():
                raw = raw_vectors(model, sc, lay.n_layers, lay.n_heads)
            row = {"model": model_name, "task": task, "n_layers": lay.n_layers, "n_heads": lay.n_heads, **raw}
            with raw_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{model_name} {task}: clean nll {raw['nll']:.6f} (recorded {d['clean_nll']})", flush=True)
        del model


def tables(cases: list[tuple[str, dict]], raw_path: Path, out: Path | None, grid_args=None) -> None:
    bench, rp = _load("bench_locate_recovery"), _load("replay_prior")
    from capsense.core.files import atomic_write_json, atomic_write_text
    from capsense.core.tables import markdown_table
    from capsense.localize.prior import PriorSettings

    raws = {(r["model"], r["task"]): r for r in map(json.loads, raw_path.read_text().splitlines())}
    rows = []
    for model_name, sweeps in cases:
        for task in sorted(sweeps):
            raw = raws.get((model_name, task))
            if raw is None:
                continue
            lay = bench.Layout(raw["n_layers"], raw["n_heads"])
            eff = bench.recorded_effects(sweeps[task], lay)
            true = [lay.name(i) for i in range(lay.n)]
            true = [true.index(h) for h in sweeps[task]["top5"]]
            for label, fe, score, signed in estimators(raw, lay.n_heads):
                r = score_row(score, signed, eff, true, bench.overlap)
                # the clean forward is folded into the attribution's wherever the prefix is reused (since round 12
                # multiple choice too; a sweep recorded without reuse, share 0, pays it)
                share = float(sweeps[task].get("reuse_share", 1.0))
                rep = rp.replay(score, eff, lay, share, PriorSettings(), bench.overlap, share)
                extra = fe - 3
                r.update({"fe_4of5": None if rep["fe_4of5"] is None else round(rep["fe_4of5"] + extra, 2),
                          "fe_5of5": None if rep["fe_5of5"] is None else round(rep["fe_5of5"] + extra, 2)})
                rows.append({"model": bench.tag(model_name), "task": task.removeprefix("capsense_"),
                             "estimator": label, "fe": fe + 1, **r})
    head = ["model", "task", "estimator", "FE", "hits", "hits by |e|", "Spearman", "true top 5 ranks", "by |e|",
            "prior FE to 4/5", "to 5/5"]
    md = [{"model": r["model"], "task": r["task"], "estimator": r["estimator"], "FE": r["fe"], "hits": f"{r['hits']}/5",
           "hits by |e|": f"{r['hits_abs']}/5", "Spearman": r["spearman"], "true top 5 ranks": r["ranks"],
           "by |e|": r["abs_ranks"], "prior FE to 4/5": r["fe_4of5"], "to 5/5": r["fe_5of5"]} for r in rows]
    pairs = " ".join(dict.fromkeys(f"{r['model']}/{r['task']}" for r in rows))
    text = ("Estimators of single-head knockout effects against the recorded exhaustive sweeps (FE: the "
            "estimator's forward-equivalents plus the clean forward, round 9's accounting: since round 10 the attribution's "
            "forward is the clean one on log-likelihood probes, 1 FE less; prior FE: prior-guided search replayed "
            "from the estimator with today's defaults, the extra FE included; a Spearman of an unsigned score "
            f"is against the signed effects)\n\nSummary over {pairs} (hits in that order):\n\n"
            + markdown_table(summary(rows)) + "\n\nPer task:\n\n" + markdown_table(md, head) + "\n")
    if grid_args:
        from capsense.core.tables import markdown_table as mt

        text += ("\nThe search's top-m and group size replayed for both orders (FE to 4/5 / 5/5 per task, in the "
                 "summary's order; never: 50):\n\n" + mt(grid(cases, raws, *grid_args)) + "\n")
    print(text)
    if out:
        atomic_write_text(out.with_suffix(".md"), text)
        atomic_write_json(out.with_suffix(".json"), rows)


GRID_ESTIMATORS = ("grad@1 (attribution)", "per-document |grad| sum")


def grid(cases, raws, top_ms, group_sizes) -> list[dict]:
    """The search's defaults replayed for today's estimate and the per-document magnitude: worst and
    mean FE to 4/5 and 5/5 over every (model, task) per (top_m, group_size)."""
    bench, rp = _load("bench_locate_recovery"), _load("replay_prior")
    from capsense.localize.prior import PriorSettings

    out = []
    for label in GRID_ESTIMATORS:
        for m in top_ms:
            for gs in group_sizes:
                res = []
                for model_name, sweeps in cases:
                    for task in sorted(sweeps):
                        raw = raws[(model_name, task)]
                        lay = bench.Layout(raw["n_layers"], raw["n_heads"])
                        score = next(sc for lb, _, sc, _ in estimators(raw, lay.n_heads) if lb == label)
                        share = float(sweeps[task].get("reuse_share", 1.0))
                        rep = rp.replay(score, bench.recorded_effects(sweeps[task], lay), lay, share,
                                        PriorSettings(top_m=m, group_size=gs), bench.overlap, share)
                        res.append((rep["fe_4of5"] or 50.0, rep["fe_5of5"] or 50.0))
                r4, r5 = [x[0] for x in res], [x[1] for x in res]
                out.append({"estimator": label, "top_m": m, "group": gs, "per task (4/5 / 5/5)": " ".join(f"{a}/{b}" for a, b in res),
                            "worst 4/5": max(r4), "mean 4/5": round(float(np.mean(r4)), 2),
                            "worst 5/5": max(r5), "mean 5/5": round(float(np.mean(r5)), 2)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", required=True, help="model:sweeps.json (repeatable)")
    ap.add_argument("--raw", type=Path, default=Path("runs/bench-estimators/raw.jsonl"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--table-only", action="store_true")
    ap.add_argument("--grid", action="store_true", help="also replay top-m 16,24,32,48 x group 8,16,24 for two orders")
    a = ap.parse_args()
    cases = []
    for c in a.case:
        model, _, path = c.partition(":")
        cases.append((model, json.loads(Path(path).read_text())))
    if not a.table_only:
        compute(cases, a.raw)
    tables(cases, a.raw, a.out, ((16, 24, 32, 48), (8, 16, 24)) if a.grid else None)


if __name__ == "__main__":
    main()

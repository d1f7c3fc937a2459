"""Racing singles, replayed: prior-guided search where each single is first measured on a subset of
the documents and finished on the rest only when that looks worth it.

    python recipes/bench/replay_racing.py --case smollm2-135m --case gemma3-270m \\
        [--raw runs/bench-estimators/raw.jsonl] [--perdoc runs/perdoc] [--k 4,6,8,12] [--promote 0.5] [--against full,subset] \\
        [--seeds 10] [--no-fold] [--out recipes/results/locate_racing_r10]

Per (model, task) with a recorded sweep (``locate_<tag>_sweeps.json``) and round 9's per-document
gradients (``--raw``, ``bench_attribution_estimators.py``): prior-guided replayed as
``replay_prior.py`` replays it (singles exactly from the sweep, groups as the sum of their heads'
effects, the sweep's own prefix-reuse share, budget 50 capped at the sweep's cost, FE counted from
the attribution and the clean forward, which since round 10 the attribution's forward stands in for on
log-likelihood probes (since round 12 on multiple choice too: the sweep's reuse share is the folded share); ``--no-fold``: 1 FE everywhere, as before) with the singles ordered by the attribution's ``estimate``
and by ``documents`` (each document's ``|gradient|`` summed, today's default). Where a per-document
sweep exists (``record_perdoc_sweep.py``: ``<perdoc>/<model>-<task>.jsonl``), also the racing
variant, singles in today's order: a single is measured first on ``k`` of the ``N`` documents (a
subset drawn once per run with a seeded generator, the same for every head; cost ``k/N`` of the
single's prefix-reused cost), and on the other ``N - k`` (cost ``(N-k)/N``) only while fewer than
``top_k`` singles are fully measured or when its subset damage (relative nll worsening on the
subset) reaches ``promote`` x the ``top_k``-th largest fully measured damage (``--against full``;
``subset``: the ``top_k``-th largest subset damage so far, see :class:`Rule`). A head left at its
subset is not ranked, and either left out of the groups or put into them (both are reported);
groups and splits then run as today. Reported: FE to
4/5 and 5/5 of the exhaustive top 5 (the recovery table's rule; never within the budget: counted
as the budget in means), for subset seed 0 and the mean and worst over ``--seeds`` subset seeds; and
for reference at the smallest ``k``: racing as if each subset measured the head's full
effect (what the order itself costs once small heads are nearly free; not a bound: a noisy subset
can by luck park a large head that is not in the top 5 and do better).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from capsense.core.tables import markdown_table
from capsense.localize.guided import sweep_cost
from capsense.localize.prior import PriorSearch, PriorSettings, Spender, groups_and_splits
from capsense.scoring.cost import ATTRIBUTION, mask_cost

HERE = Path(__file__).resolve().parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)
    spec.loader.exec_module(mod)
    return mod


class Replay:
    """One (model, task): the sweep's effects, cost model and bookkeeping of one replayed search."""

    def __init__(self, eff: np.ndarray, n_layers: int, n_heads: int, share: float, overlap, budget: float = 50.0,
                 folded: float = 0.0):
        self.eff, self.n_layers, self.n_heads, self.share, self.overlap = eff, n_layers, n_heads, share, overlap
        self.folded = folded  # the share of the clean forward the attribution's forward stands in for
        self.budget = min(budget, sweep_cost(self.cost, len(eff)))

    def cost(self, heads) -> float:
        return mask_cost(list(heads), self.n_layers, self.n_heads, self.share, self.folded)

    def settings(self) -> PriorSettings:
        return PriorSettings(budget=self.budget, already_spent=ATTRIBUTION + self.cost(()))

    def first(self, trail: list[tuple[float, int]]) -> dict:
        """FE at which ``trail`` ((FE, overlap) after each measurement) first reaches 4/5 and 5/5."""
        out = {f"fe_{k}of5": next((round(fe, 2) for fe, o in trail if o >= k), None) for k in (4, 5)}
        return {**out, "spent": round(trail[-1][0], 2) if trail else None, "budget": round(self.budget, 2)}

    def mark(self, search: PriorSearch, trail: list) -> None:
        top = sorted(search.singles, key=lambda h: -search.singles[h])[:5]
        trail.append((search.spent, self.overlap(top, self.eff) if len(top) == 5 else 0))


def single_order(score: np.ndarray, cost, top_m: int) -> list[int]:
    """Today's singles (:func:`capsense.localize.prior.prior_guided` without controls): the ``top_m``
    largest ``|score|``, by ``|score|`` per forward-equivalent."""
    by_size = [int(h) for h in np.argsort(-np.abs(score), kind="stable")][: min(top_m, len(score))]
    return sorted(by_size, key=lambda h: -abs(score[h]) / max(cost((h,)), 1e-9))


def second_phase(rp: Replay, search: PriorSearch, skip: set[int], settings: PriorSettings, trail: list) -> None:
    """Today's second phase (:func:`capsense.localize.prior.groups_and_splits`), answered from the sweep."""
    def measure(sets):
        out = [float(rp.eff[list(s)].sum()) for s in sets]
        spent0 = search.spent - sum(rp.cost(s) for s in sets)
        for s, d in zip(sets, out):  # the trail after each set, as the real run logs them
            spent0 += rp.cost(s)
            if len(s) == 1:
                search.singles[s[0]] = d
            top = sorted(search.singles, key=lambda h: -search.singles[h])[:5]
            trail.append((spent0, rp.overlap(top, rp.eff) if len(top) == 5 else 0))
        return out

    groups_and_splits(search, Spender(measure, rp.cost, settings.budget, search), len(rp.eff), settings,
                      frozenset(skip))


@dataclass(frozen=True)
class Rule:
    """When a raced single is finished on the other documents. ``against`` full: its subset damage
    reaches ``promote`` x the ``top_k``-th largest fully measured damage (or fewer than ``top_k`` are
    fully measured); subset: ``promote`` x the ``top_k``-th largest subset damage so far (or fewer
    than ``top_k`` heads were raced), the same documents on both sides. ``to_groups``: a head left at
    its subset still goes into the group knockouts (a safety net against an unlucky subset)."""

    against: str = "full"
    promote: float = 0.5
    to_groups: bool = False

    @property
    def label(self) -> str:
        return f"vs {self.against} x{self.promote:g}{', parked into groups' if self.to_groups else ''}"


def promoted(rule: Rule, d_sub: float, full: list[float], raced: list[float], k: int) -> bool:
    pool = sorted(full if rule.against == "full" else raced, reverse=True)
    return len(pool) < k or d_sub >= rule.promote * max(pool[k - 1], 0.0)


def racing(rp: Replay, order: list[int], sub_eff: np.ndarray | None, frac: float, rule: Rule = Rule()) -> dict:
    """The search with raced singles (``sub_eff`` None: every single measured in full, i.e. today)."""
    st = rp.settings()
    search, trail, parked, raced = PriorSearch(spent=st.already_spent), [], set(), []
    for h in order:
        c = rp.cost((h,))
        part = frac * c if sub_eff is not None else 0.0
        if search.spent + part > st.budget + 1e-9:
            search.stopped_by_budget = True
            break
        if sub_eff is not None:
            search.spent += part
            ok = promoted(rule, float(sub_eff[h]), list(search.singles.values()), raced, st.top_k)
            raced.append(float(sub_eff[h]))
            if not ok:
                parked.add(h)
                continue
        if search.spent + (c - part) > st.budget + 1e-9:
            search.stopped_by_budget = True
            break
        search.spent += c - part
        search.singles[h] = float(rp.eff[h])
        rp.mark(search, trail)
    if not search.stopped_by_budget:
        second_phase(rp, search, set() if rule.to_groups else parked, st, trail)
    res = rp.first(trail)
    missed = [h for h in parked if rp.overlap([h], rp.eff) and h not in search.singles]  # true top-5 heads lost
    return {**res, "parked": len(parked), "parked_true_top5": len(missed)}


def subset_effects(perdoc: Path, k: int, seed: int) -> tuple[np.ndarray, int]:
    """Per head the relative nll worsening on ``k`` documents drawn with ``seed``, and N."""
    rec = _load("record_perdoc_sweep")
    head, rows = rec.read_rows(perdoc)
    clean, _, nats = rec.effects(head, rows)
    n_docs = len(head["tokens"])
    docs = np.random.default_rng(seed).choice(n_docs, size=k, replace=False)
    base = float(np.sum(np.asarray(clean["nats"])[docs]))
    return (nats[:, docs].sum(1) - base) / base, n_docs


def load_cases(models: list[str], raw_path: Path, perdoc_dir: Path, fold: bool = True) -> list[dict]:
    """Every (model, task) with a recorded sweep and per-document gradients. ``fold``: the clean forward
    costs nothing where the attribution's forward stands in for it (since round 10: log-likelihood
    probes, i.e. the sweep's reuse share; multiple choice keeps its own clean forward)."""
    bench = _load("bench_locate_recovery")
    raws = {(r["model"], r["task"]): r for r in map(json.loads, raw_path.read_text().splitlines())}
    out = []
    for model in models:
        sweeps = json.loads((HERE.parent / "results" / f"locate_{bench.tag(model)}_sweeps.json").read_text())
        for task, rec in sorted(sweeps.items()):
            raw = raws.get((model, task))
            if raw is None:
                print(f"{model} {task}: no per-document gradients in {raw_path}; skipped", flush=True)
                continue
            lay = bench.Layout(raw["n_layers"], raw["n_heads"])
            g = np.asarray(raw["g_nll"])  # [docs, L, H]
            perdoc = perdoc_dir / f"{Path(model).name}-{task}.jsonl"
            if perdoc.is_file() and not _load("record_perdoc_sweep").finished(perdoc):
                print(f"{model} {task}: {perdoc} is not finished; no racing rows", flush=True)
                perdoc = None
            out.append({"model": bench.tag(model), "task": task.removeprefix("capsense_"),
                        "rp": Replay(bench.recorded_effects(rec, lay), lay.n_layers, lay.n_heads,
                                     float(rec.get("reuse_share", 1.0)), bench.overlap,
                                     folded=float(rec.get("reuse_share", 1.0)) if fold else 0.0),
                        "estimate": -g.sum(0).reshape(-1), "documents": np.abs(g).sum(0).reshape(-1),
                        "perdoc": perdoc if perdoc is not None and perdoc.is_file() else None})
    return out


def run_case(c: dict, ks: list[int], rules: list[Rule], seeds: int) -> list[dict]:
    """Rows of one (model, task): both orders, then racing per rule and k (seed 0, and over ``seeds`` seeds)."""
    rp, rows = c["rp"], []
    for label in ("estimate", "documents"):
        rows.append({"variant": f"today, order {label}", **racing(rp, single_order(c[label], rp.cost, 32), None, 1)})
    if c["perdoc"] is None:
        return rows
    order = single_order(c["documents"], rp.cost, 32)
    subsets = {(k, seed): subset_effects(c["perdoc"], k, seed) for k in ks for seed in range(seeds)}
    k, n_docs = min(ks), subsets[min(ks), 0][1]  # not a rule a run can use: a subset without noise
    rows.append({"variant": f"noiseless: racing k={k}/{n_docs} vs full x0.5, the subset telling the full effect",
                 **racing(rp, order, rp.eff, k / n_docs, Rule())})
    for rule in rules:
        for k in ks:
            runs = [racing(rp, order, subsets[k, seed][0], k / subsets[k, seed][1], rule) for seed in range(seeds)]
            r4 = [r["fe_4of5"] if r["fe_4of5"] is not None else rp.budget for r in runs]
            r5 = [r["fe_5of5"] if r["fe_5of5"] is not None else rp.budget for r in runs]
            rows.append({"variant": f"racing k={k}/{subsets[k, 0][1]} {rule.label}", "rule": asdict(rule), "k": k,
                         **runs[0], "seeds": seeds, "mean_4of5": round(float(np.mean(r4)), 2),
                         "worst_4of5": round(max(r4), 2), "mean_5of5": round(float(np.mean(r5)), 2),
                         "worst_5of5": round(max(r5), 2), "never_5of5": sum(r["fe_5of5"] is None for r in runs)})
    return rows


def summary(records: list[dict]) -> list[dict]:
    """Per variant, each (model, task)'s FE to 4/5 / 5/5 (racing: means over the subset seeds, never
    reached: the budget) and the worst over the pairs with a per-document sweep (those raced)."""
    pairs = list(dict.fromkeys((r["model"], r["task"]) for r in records))
    raced = {(r["model"], r["task"]) for r in records if "k" in r}
    out = []
    for variant in dict.fromkeys(r["variant"] for r in records):
        row, w4, w5 = {"variant": variant}, [], []
        for m, t in pairs:
            r = next((x for x in records if (x["model"], x["task"], x["variant"]) == (m, t, variant)), None)
            if r is None:
                continue
            a = r.get("mean_4of5", r["fe_4of5"] if r["fe_4of5"] is not None else r["budget"])
            b = r.get("mean_5of5", r["fe_5of5"] if r["fe_5of5"] is not None else r["budget"])
            row[f"{m} {t}"] = f"{a} / {b}" + (f" ({r['never_5of5']} never)" if r.get("never_5of5") else "")
            if (m, t) in raced:
                w4.append(a)
                w5.append(b)
        out.append({**row, "worst 4/5 (raced pairs)": max(w4, default=""), "worst 5/5 (raced pairs)": max(w5, default="")})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", required=True, help="model name (repeatable)")
    ap.add_argument("--raw", type=Path, default=Path("runs/bench-estimators/raw.jsonl"))
    ap.add_argument("--perdoc", type=Path, default=Path("runs/perdoc"))
    ap.add_argument("--k", type=lambda s: [int(x) for x in s.split(",")], default=[4, 6, 8, 12])
    ap.add_argument("--promote", type=lambda s: [float(x) for x in s.split(",")], default=[0.5])
    ap.add_argument("--against", default="full,subset", help="full, subset or both (comma-separated)")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--no-fold", action="store_true", help="count the clean forward as before round 10 (1 FE)")
    ap.add_argument("--out", type=Path, default=None, help="write <out>.md and <out>.json")
    args = ap.parse_args(argv)
    if args.seeds < 1 or any(k < 1 for k in args.k):
        ap.error("--seeds and every --k must be positive")
    against = args.against.split(",")
    if not set(against) <= {"full", "subset"}:
        ap.error(f"--against: full, subset or both, got {args.against!r}")
    rules = [Rule(a, p, g) for a in against for p in args.promote for g in (False, True)]
    records = []
    for c in load_cases(args.case, args.raw, args.perdoc, fold=not args.no_fold):
        for r in run_case(c, args.k, rules, args.seeds):
            records.append({"model": c["model"], "task": c["task"], **r})
    head = ["model", "task", "variant", "fe_4of5", "fe_5of5", "spent", "parked", "parked_true_top5",
            "mean_4of5", "worst_4of5", "mean_5of5", "worst_5of5", "never_5of5"]
    summ = summary(records)
    cols = list(dict.fromkeys(k for r in summ for k in r))
    table = ("Summary (FE to 4/5 / FE to 5/5; racing: mean over the subset seeds, a seed that never reaches 5/5 "
             "counted as the budget)\n\n" + markdown_table([{c: r.get(c, "") for c in cols} for r in summ], cols)
             + "\n\n")
    table += (f"Prior-guided replayed on the recorded sweeps (FE to 4/5 and 5/5 of the exhaustive top 5; None: "
             f"never within the budget); racing: the rule (see the script), subset seed 0, then mean / worst over "
             f"{args.seeds} subset seeds (never: counted as the budget)\n\n"
             + markdown_table([{h: r.get(h, "") for h in head} for r in records], head) + "\n")
    _load("replay_prior").emit(table, records, args.out)


if __name__ == "__main__":
    main()

"""Run outputs: ``heads.json``, ``scores.csv``, ``heatmap.png`` and ``report.md``.

Plots use matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

import numpy as np

from capsense.core.arch import HeadLayout
from capsense.core.files import atomic_write_text
from capsense.core.heads import Head, HeadsFile, write_heads_file
from capsense.core.precision import precision_name
from capsense.core.tables import format_percent
from capsense.localize.choice import accuracy_line, shortfall
from capsense.localize.config import LocateConfig
from capsense.localize.fit import LocateResult


def _name(i: int, n_heads: int) -> str:
    return str(Head.from_index(i, n_heads))


def _f(x: float, nd: int = 4) -> float | None:
    return None if not np.isfinite(x) else round(float(x), nd) + 0.0


def head_records(cfg: LocateConfig, result: LocateResult, layout: HeadLayout) -> list[dict[str, Any]]:
    """Per-head records, best first, in the heads-file schema plus effects."""
    s = result.scores
    recs = []
    for rank, i in enumerate(s.rank):
        i = int(i)
        effects = {c: _f(e[i]) for c, e in result.control_effects.items()}
        rec: dict[str, Any] = {
            "layer": i // layout.n_heads,
            "head": i % layout.n_heads,
            "rank": rank + 1,
            "importance": _f(s.importance[i]),
            "confidence": _f(s.confidence[i]),
            "target_effect": _f(result.target_effect[i]),
            "control_effect": max((v for v in effects.values() if v is not None), default=None),
        }
        if effects:
            rec["control_effects"] = effects
        if result.screen is not None and i in result.screen.worst:
            c, d = result.screen.worst[i]
            rec["worst_control"] = {"task": c, "effect": _f(d)}
            rec["collateral"] = i in result.screen.excluded
        if result.raw_scores is not None:
            rec["raw_importance"] = _f(result.raw_scores.importance[i])
        if result.estimates is not None:  # attribution's first-order estimate beside the measured effect
            rec["estimate"] = _f(result.estimates[cfg.task][i])
            if cfg.controls:
                rec["control_estimates"] = {c: _f(result.estimates[c][i]) for c in cfg.controls if c in result.estimates}
        recs.append(rec)
    return recs


def write_outputs(out: Path, cfg: LocateConfig, result: LocateResult, layout: HeadLayout, manifest: dict) -> Path:
    """Write heads.json, scores.csv, heatmap.png and report.md into the run folder."""
    recs = head_records(cfg, result, layout)
    meta = {
        "task": cfg.task,
        "controls": list(cfg.controls),
        "metric": cfg.metric,
        "control_metric": cfg.metric_for(cfg.controls[0]) if cfg.controls else None,
        "method": cfg.method,
        "revision": cfg.revision,  # the model's Hub revision; validate, evaluate, export load it by default
        "ablation": cfg.ablation,  # validate and export default to it
        "mean_reference": cfg.mean_reference,
        "design": cfg.design if cfg.method == "cs" else None,
        "solver": cfg.solver if cfg.method == "cs" else None,
        "selective": bool(cfg.controls),
        "n_evaluations": result.n_evaluations,
        "forward_equivalents": result.forward_equivalents,
        "heads_per_mask": manifest.get("heads_per_mask"),
        "layout": manifest.get("layout"),
        "base": result.base,
        "effects": "relative worsening of the metric when the head is knocked out (+0.1 = 10% worse); "
        "control_effect = the largest over the controls"
        + ("; estimate = gradient attribution's first-order estimate of the target effect (null effect: "
           "not knocked out alone)" if result.estimates is not None else ""),
    }
    n_heads = layout.n_heads
    if result.screen is not None:
        meta["screen"] = result.screen.as_dict(lambda i: _name(i, n_heads))
    if result.refinement is not None:
        meta["refine"] = result.refinement.as_dict(lambda i: _name(i, n_heads))
        if result.chosen_accuracy is not None:
            meta["refine"]["target_accuracy"] = result.chosen_accuracy
    if result.coverage is not None:
        meta["coverage"] = result.coverage.as_dict(lambda i: _name(i, n_heads))
    heads_path = write_heads_file(out / "heads.json", HeadsFile(model=cfg.model, heads=recs, meta=meta))
    cols = ["rank", "layer", "head", "importance", "confidence", "raw_importance", "target_effect", "control_effect", "estimate"]
    cols += [f"effect_{c}" for c in cfg.controls]
    table = io.StringIO(newline="")
    w = csv.writer(table)
    w.writerow(cols)
    for r in recs:
        w.writerow([r.get(c) for c in cols[:9]] + [r.get("control_effects", {}).get(c) for c in cfg.controls])
    atomic_write_text(out / "scores.csv", table.getvalue())
    heatmap(out / "heatmap.png", result.scores.importance, layout, f"{cfg.task}: importance ({cfg.method}"
            + (", selective" if cfg.controls else "") + ")",
            unmeasured=unpainted(cfg, result))
    atomic_write_text(out / "report.md", report_markdown(cfg, result, recs, manifest))
    return heads_path


def unpainted(cfg: LocateConfig, result: LocateResult) -> np.ndarray | None:
    """Heads the heatmap leaves grey: never measured alone (prior-guided) and set aside by the
    collateral screen, whose importance is a rank placeholder (below every clean head), not an
    effect: painted, it stretched the colour scale and washed out the real importances."""
    grey = np.isnan(result.target_effect) if cfg.method == "prior-guided" else np.zeros(len(result.target_effect), bool)
    if result.screen is not None or result.pool_singles:  # extra singles: measured after the fit, not ranked by it
        grey = grey.copy()
        grey[list(result.screen.excluded if result.screen is not None else []) + list(result.pool_singles)] = True
    return grey if grey.any() else None


def heatmap_grid(importance: np.ndarray, layout: HeadLayout, unmeasured: np.ndarray | None = None):
    """(layers x heads masked grid, colour limit): heads in ``unmeasured`` are masked (prior-guided
    ranks heads never measured alone below the measured ones with a sentinel, not an importance;
    painted, it read as a small negative importance) and left out of the colour scale."""
    grid = np.nan_to_num(np.asarray(importance, dtype=float), neginf=0).reshape(layout.n_layers, layout.n_heads)
    mask = np.zeros(grid.shape, dtype=bool) if unmeasured is None else np.asarray(unmeasured, bool).reshape(grid.shape)
    grid = np.ma.masked_array(grid, mask=mask)
    return grid, max(float(np.abs(grid).max()) if not mask.all() else 0.0, 1e-9)


def heatmap(path: Path, importance: np.ndarray, layout: HeadLayout, title: str, unmeasured: np.ndarray | None = None) -> None:
    """Layers (rows) x heads (columns) image of importance; ``unmeasured`` heads in grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid, lim = heatmap_grid(importance, layout, unmeasured)
    cmap = matplotlib.colormaps["RdBu_r"].with_extremes(bad="lightgrey")
    fig, ax = plt.subplots(figsize=(max(4, 0.35 * layout.n_heads + 2), max(3, 0.22 * layout.n_layers + 1.5)))
    im = ax.imshow(grid, cmap=cmap, vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="importance")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: How each method obtains a head's effect in the Top heads table (report.md says it).
EFFECT_SOURCES = {
    "cs": "a regression estimate from random multi-head masks (no head was measured alone)",
    "thompson": "a regression estimate from adaptively drawn multi-head masks (no head was measured alone)",
    "mine": "a regression estimate from the method's multi-head masks (no head was measured alone)",
    "exhaustive": "measured: every head was knocked out alone (the exhaustive sweep)",
    "greedy": "measured: single-head knockouts of the heads the greedy search reached",
    "attribution": "not measured: the estimate column is gradient attribution's first-order estimate",
    "prior-guided": ("measured single-head knockouts for the candidates that gradient attribution proposed "
                     "(blank where a head was not measured alone); the estimate column is the gradient estimate"),
}


def _precision_line(cfg: LocateConfig, result: LocateResult, args: dict) -> list[str]:
    """The search's precision, and measure-and-choose's where it differs (one line; none for a folder that lacks them)."""
    if "dtype_resolved" not in args:
        return []
    search = precision_name(args["dtype_resolved"], cfg.autocast, args.get("autocast_attention_resolved"))
    sets = args.get("refine_dtype_resolved")
    return [f"- precision: {search}" + (f"; sets measured in {sets}, against the clean model in it"
                                        if result.refinement is not None and sets and sets != search else "")]


def _time_line(timing: dict) -> list[str]:
    """Where this attempt's wall time went (one line; none for a folder from before round 40's phases)."""
    if "search_s" not in timing:
        return []
    parts = [f"load {timing['load_s']:.1f} s"] + [f"{name} {timing[key]:.1f} s" for key, name in
                                                  (("attribution_s", "attribution"), ("search_s", "search"),
                                                   ("refine_s", "measure-and-choose")) if timing.get(key)]
    checks = (f"; the scorers' self-checks took {timing['checks_s']:.1f} s of it (outside the forward-equivalents)"
              if timing.get("checks_s") else "")
    return [f"- wall time of this attempt: {', '.join(parts)}{checks}"]


def _clean_line(base: dict[str, dict], probes: dict[str, dict]) -> str:
    """The clean model's scores per task; no accuracy for a perplexity task's (its windows of text have no answer)."""
    def scores(t: str, v: dict) -> str:
        return f"{t} nll {v['nll']:.3f}" + ("" if "rolling_window" in probes.get(t, {}) else f", acc {v['acc']:.3f}")

    return "Clean model: " + "; ".join(scores(t, v) for t, v in base.items())


def report_markdown(cfg: LocateConfig, result: LocateResult, recs: list[dict], manifest: dict) -> str:
    """A short human-readable summary of the run."""
    lines = [
        f"# capsense locate: {cfg.task}",
        "",
        f"- model: `{cfg.model}` ({manifest.get('layout', {}).get('n_layers')} layers x "
        f"{manifest.get('layout', {}).get('n_heads')} heads)",
        f"- method: {cfg.method}" + (f", design {cfg.design}, solver {cfg.solver}, "
                                     f"{manifest.get('heads_per_mask')} heads per mask" if cfg.method == "cs" else ""),
        f"- metric: {cfg.metric}; controls: {', '.join(cfg.controls) or 'none (raw target score)'}"
        + (f" (scored by {cfg.metric_for(cfg.controls[0])})" if cfg.controls and cfg.metric_for(cfg.controls[0]) != cfg.metric else ""),
        f"- ablation: {cfg.ablation}" + (f" (head means over {cfg.mean_reference or 'capsense neutral prose'})"
                                         if cfg.ablation == "mean" else " (a knocked-out head's output is zeroed)"),
        f"- evaluations: {result.n_evaluations} masks, {result.seconds_per_mask:.3f} s per mask (each on the probes it was scored on); "
        f"cost {result.forward_equivalents:.1f} forward-equivalents (forward over the documents = 1, backward = 2, "
        "prefix-reused forward = its share of layers)",
        "- documents: " + ", ".join(f"{t} {len(p['doc_ids'])}" for t, p in manifest.get("probes", {}).items()),
        *_precision_line(cfg, result, manifest.get("args", {})),
        *_time_line(manifest.get("timing", {})),
        "",
        _clean_line(result.base, manifest.get("probes", {})),
        "",
        "## Top heads",
        "",
        "Effects: relative worsening of the metric when the head alone is knocked out, "
        + EFFECT_SOURCES.get(cfg.method, "as the method reports it") + ".",
        "",
    ]
    est = result.estimates is not None
    worst = result.screen is not None
    hdr = ("| rank | head | importance | confidence | target effect |" + (" estimate |" if est else "")
           + (" worst control |" if worst else "") + "".join(f" {c} effect |" for c in cfg.controls))
    lines += [hdr, "|" + "---|" * (5 + est + worst + len(cfg.controls))]
    for r in recs[:15]:
        row = f"| {r['rank']} | {Head(r['layer'], r['head'])} | {r['importance']} | {r['confidence']} | {_pct(r['target_effect'])} |"
        row += f" {_pct(r.get('estimate'))} |" if est else ""
        if worst:
            w = r.get("worst_control")
            row += f" {w['task']} {_pct(w['effect'])}{' (set aside)' if r.get('collateral') else ''} |" if w else " |"
        row += "".join(f" {_pct(r.get('control_effects', {}).get(c))} |" for c in cfg.controls)
        lines.append(row)
    if result.screen is not None:
        lines += ["", *_screen_lines(result.screen, manifest["layout"]["n_heads"])]
    if result.refinement is not None:
        lines += ["", *_refine_lines(result.refinement, cfg, manifest["layout"]["n_heads"])]
        if (acc := result.chosen_accuracy) is not None:
            line = accuracy_line(acc)
            lines += ["", (f"**{line[0].upper()}{line[1:]}.**" if acc["nll_only"] else f"{line[0].upper()}{line[1:]}.")]
    if result.coverage is not None:
        lines += ["", *_coverage_lines(result.coverage, manifest["layout"]["n_heads"])]
    if result.raw_scores is not None:
        raw_top = [_name(int(i), manifest["layout"]["n_heads"]) for i in result.raw_scores.rank[:10]]
        lines += ["", f"Raw target-score ranking (not selective), top 10: {', '.join(raw_top)}"]
    lines += ["", "![importance heatmap](heatmap.png)", ""]
    return "\n".join(lines)


def _refine_lines(ref, cfg: LocateConfig, n_heads: int) -> list[str]:
    def row(label: str, q, order=None) -> str:  # the chosen set in heads.json's order
        heads = ", ".join(_name(h, n_heads) for h in (q.heads if order is None else order))
        return (f"| {label} | {heads} | {_pct(q.target)} |" + "".join(f" {_pct(q.controls.get(c))} |" for c in cfg.controls)
                + f" {'yes' if q.feasible else 'no'} |")

    return [
        f"## Chosen top-{len(ref.heads)} set (measured on the run's documents)",
        "",
        "These figures are measured: each candidate set was knocked out together on the run's documents "
        "(not estimated from single heads); the set leads the ranking above and heads.json in this order.",
        "",
        f"{len(ref.measured)} candidate sets measured" + _search_phrase(ref)
        + "; a set is within tolerance when no control worsens by more "
        f"than {100 * ref.quality.tolerance:.1f}%" + _set_controls_phrase(ref) + ". Heads in order of how much the "
        "target misses each: " + ", ".join(_name(h, n_heads) for h in ref.heads) + ".",
        "",
        *_widening_lines(ref, n_heads),
        *([f"**{line[0].upper() + line[1:]}.**", ""] if (line := shortfall(ref)) else []),
        "| set | heads | target |" + "".join(f" {c} |" for c in cfg.controls) + " within tolerance |",
        "|" + "---|" * (4 + len(cfg.controls)),
        row("first set measured", ref.start),
        row("chosen", ref.quality, ref.heads),
    ]


def _set_controls_phrase(ref) -> str:
    """How the sets' controls were scored, where not every one was (``set_controls`` until-beyond)."""
    short = sum(not q.complete for q in ref.measured)
    if ref.set_controls == "all":
        return ""
    return (f" (each after the first scored on the controls cheapest first until the first beyond the tolerance or the worst control of "
            f"the best set scored on every control, whichever is larger: {short} of {len(ref.measured)} stopped there, a "
            "blank is a control not scored; the chosen set was scored on every control)")


def _search_phrase(ref) -> str:
    """What proposed the sets measured after the first, when the predicted search ran (else nothing)."""
    n_predicted, n_swaps = ref.found_by.count("prediction"), ref.found_by.count("swaps")
    if ref.search != "predicted" or not n_predicted + n_swaps:
        return ""
    if not n_predicted:
        return (f" (predicted search: no unmeasured set was predicted to beat the sets already measured, none within "
                f"tolerance; then {n_swaps} by the swap search)")
    then = f", then {n_swaps} by the swap search, the prediction having settled on a set beyond tolerance" if n_swaps else ""
    return (f" (predicted search: {n_predicted} set{'s' * (n_predicted > 1)} each the best predicted from the singles "
            f"and the sets before it{then})")


def _widening_lines(ref, n_heads: int) -> list[str]:
    """The heads measure-and-choose measured alone before its swaps, and why (none: no lines)."""
    w = ref.widening
    if w is None:
        return []
    names = lambda hs: ", ".join(_name(h, n_heads) for h in hs) or "none"  # noqa: E731
    return [
        f"Extra singles: the first set broke the tolerance and the search left {w.clean_before} clean heads measured "
        f"alone, fewer than K + {w.wanted - len(ref.heads)} = {w.wanted} (a round of swaps tries "
        f"{w.wanted - len(ref.heads)} candidates outside the set), so {len(w.heads)} more heads were knocked out "
        f"alone first (by attribution's estimated target effect, else the run's ranking; at most {w.cap}, what the budget leaves after one "
        f"full round of swaps), each one evaluation of measure-and-choose's budget and screened like the "
        f"search's: clean {names(w.clean)}; set aside {names([h for h in w.heads if h not in w.clean])}. "
        "Their effects are in heads.json (`refine.extra_singles`, and per head); the fitted ranking never saw them "
        "(grey in the heatmap).",
        "",
    ]


def _coverage_lines(cov, n_heads: int) -> list[str]:
    """The false-negative report: heads not measured alone and how much target effect could hide there."""
    name = lambda h: _name(h, n_heads)  # noqa: E731
    lines = ["## What the search did not measure", "", cov.summary(name) + "."]
    if not cov.not_measured:
        return lines
    lines += ["", "Bound: the smallest measured damage of a knockout containing the head, plus the effect of each head "
              "in it measured alone to help the target; it holds when head effects add up and no head left unmeasured "
              "helps the target (one that does, inside the same knockout, can hide more)."]
    misses = cov.possible_misses()[:10]
    if misses:
        lines += ["", "| head not measured alone | bound | estimate |", "|---|---|---|"]
        lines += [f"| {name(h)} | {_pct(cov.bound[h])} | {_pct(cov.estimate.get(h))} |" for h in misses]
    return lines


def _screen_lines(screen, n_heads: int) -> list[str]:
    """The collateral screen: its thresholds per control and the heads it set aside."""
    lines = [
        "## Collateral screen",
        "",
        f"A head measured alone is set aside (ranked after every clean head, never in the chosen set) when it "
        f"worsens any control by more than {screen.z:g} robust noises above the control's median single-head effect, "
        f"and by at least {100 * screen.floor:.2f}%."
        + (" Each single's controls were scored cheapest first until one was beyond its threshold: a head set aside "
           "was not scored on the controls after that one (blank above)." if screen.until_excluded else "")
        + (" The target took its place in that order by its own token share: a head a cheaper control set aside was "
           "not scored on the target (its target effect is blank)." if screen.target_after else ""),
        "",
        "| control | noise | threshold |",
        "|---|---|---|",
        *(f"| {c} | {_pct(screen.noise[c]) or 'unknown'} | {_pct(t)} |" for c, t in screen.threshold.items()),
        "",
    ]
    if not screen.excluded:
        return lines + ["No head measured alone crossed a threshold."]
    lines += ["| head set aside | control | its damage |", "|---|---|---|"]
    lines += [f"| {_name(h, n_heads)} | {c} | {_pct(d)} |" for h, (c, d) in sorted(screen.excluded.items(), key=lambda kv: -kv[1][1])]
    return lines


def _pct(x: float | None) -> str:
    return "" if x is None else format_percent(x)

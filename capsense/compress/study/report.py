"""Plots and a markdown report of a compression grid and its fits."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from capsense.compress.study.grid import grid_table
from capsense.core.files import atomic_write_text
from capsense.core.tables import markdown_table
from capsense.compress.study.predictors import CompactFit


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return Path(path)


def plot_pruning(fits: Mapping[str, Any], path: str | Path) -> Path | None:
    """dL vs density per capability, one panel per pruning method, with the fitted curves."""
    pr = {m: e for m, e in (fits.get("pruning") or {}).items() if any("points" in c for c in e["capabilities"].values())}
    if not pr:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(pr), figsize=(5 * len(pr), 4), squeeze=False)
    for ax, (method, m) in zip(axes[0], pr.items()):
        for i, (cap, e) in enumerate(m["capabilities"].items()):
            if "points" not in e:
                continue
            color = f"C{i}"
            pts = e["points"]
            d = np.array([p["density"] for p in pts])
            y = np.array([p["dL"] for p in pts])
            held = np.array([p["held_out"] for p in pts])
            ax.scatter(d[~held], y[~held], color=color, label=f"{cap} (fit)")
            ax.scatter(d[held], y[held], facecolors="none", edgecolors=color, label=f"{cap} (held out)")
            c = e["compact_half"]
            if c["features"]:  # several models: one curve per model state, not drawn
                continue
            fit = CompactFit(**{**c, "density_range": tuple(c["density_range"])})
            xs = np.linspace(*fit.density_range, 100)
            ax.plot(xs, fit.predict(xs), color=color, lw=1.5)
        ax.set_xlabel("retained density d")
        ax.set_ylabel("dL (nats/token)")
        ax.set_title(f"{method}: A*((1-d)/0.3)^gamma, fit on half the densities")
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_predicted_vs_measured(fits: Mapping[str, Any], path: str | Path) -> Path | None:
    """Held-out predictions vs measurements: compact relation (pruning), LOO stable-rank (low-rank)."""
    xs, ys, kinds = [], [], []
    for method, m in (fits.get("pruning") or {}).items():
        for e in m["capabilities"].values():
            for p in e.get("points", []):
                if p["held_out"]:
                    xs.append(p["pred_half"])
                    ys.append(p["dL"])
                    kinds.append(f"{method} (held-out density)")
    for name, g in (fits.get("lowrank") or {}).get("groups", {}).items():
        # per-method, per-target-set groups: one point per measurement
        if name.startswith("all|") or "|all-targets" in name or name.count("|") != 2 or "loo_pred" not in g:
            continue
        xs.extend(g["loo_pred"])
        ys.extend(g["y"])
        kinds.extend([f"{name.split('|')[2]} {name.split('|')[1]} (LOO)"] * len(g["y"]))
    for method, per_cap in (fits.get("quant") or {}).items():
        for g in per_cap.values():
            if "loo_pred" in g:
                xs.extend(g["loo_pred"])
                ys.extend(g["y"])
                kinds.extend([f"{method} (LOO)"] * len(g["y"]))
    if not xs:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 5))
    for i, k in enumerate(dict.fromkeys(kinds)):
        sel = [j for j, kk in enumerate(kinds) if kk == k]
        ax.scatter([xs[j] for j in sel], [ys[j] for j in sel], color=f"C{i}", label=k, s=18)
    lo, hi = min(xs + ys), max(xs + ys)
    ax.plot([lo, hi], [lo, hi], color="grey", lw=1, ls="--")
    ax.set_xlabel("predicted dL (nats/token)")
    ax.set_ylabel("measured dL (nats/token)")
    ax.set_title("out-of-sample predictions")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _pruning_table(pr: Mapping[str, Any]) -> str:
    cols = ("method", "capability", "gamma (half)", "A (half)", "MAE held-out densities (mean abs dL there)",
            "doc-split MAE compact (half densities)", "doc-split MAE per-density (all)")
    rows = []
    for method, m in pr.items():
        for cap, e in m["capabilities"].items():
            if "skipped" in e:
                rows.append(dict(zip(cols, (method, cap, e["skipped"], "", "", "", ""))))
                continue
            ds = e.get("doc_split", {})
            rows.append(dict(zip(cols, (
                method, cap, f"{e['compact_half']['gamma']:.2f}", f"{e['compact_half']['coef'][0]:.3f}",
                f"{_f(e['mae_heldout_densities'])} ({_f(e.get('mean_abs_dL_heldout'))})",
                _f(ds.get("mae_compact_half_densities")), _f(ds.get("mae_per_density_all_densities")),
            ))))
        rows.append(dict(zip(cols, (
            f"**{method}**", "**mean**", "", "", f"{_f(m['mae_heldout_densities'])} ({_f(m.get('mean_abs_dL_heldout'))})",
            _f(m["doc_split_mae_compact_half"]), _f(m["doc_split_mae_per_density_all"]),
        ))))
    return markdown_table(rows, cols)


def _lowrank_table(groups: Mapping[str, Any]) -> str:
    cols = ("capability / targets", "n", "slope", "LOO Pearson r", "LOO MAE")
    rows = [
        dict(zip(cols, (name, "", g["skipped"], "", ""))) if "skipped" in g
        else dict(zip(cols, (name, str(g["n"]), f"{g['slope']:.4f}", _f(g["loo_pearson"]), _f(g["loo_mae"]))))
        for name, g in groups.items()
    ]
    return markdown_table(rows, cols)


def fits_markdown(fits: Mapping[str, Any]) -> str:
    """Tables of the pruning, low-rank and bits fits."""
    lines = []
    pr = fits.get("pruning") or {}
    if pr:
        lines += ["### Pruning: compact relation vs per-density regression", "", _pruning_table(pr), ""]
    lr = (fits.get("lowrank") or {}).get("groups", {})
    if lr:
        lines += ["### Low-rank: stable-rank predictor dL ~ gamma * mean(rho_s)", "", _lowrank_table(lr), ""]
    cross = fits.get("cross_model")
    if cross:
        lines += _cross_model_markdown(cross)
    q = fits.get("quant") or {}
    if q:
        rows = [{"quantizer": m, "capability": cap, "n": str(g["n"]), "c": f"{g['slope']:.1f}", "LOO MAE": _f(g["loo_mae"])}
                for m, per_cap in q.items() for cap, g in per_cap.items() if "skipped" not in g]
        lines += ["### Quantization: dL ~ c * 4^-bits, per quantizer", "", markdown_table(rows), ""]
    return "\n".join(lines)


def _cross_model_markdown(cross: Mapping[str, Any]) -> list[str]:
    """Tables of :func:`capsense.compress.study.crossmodel.cross_model_fits`."""
    rows = []
    for method, m in cross["pruning"].items():
        for cap, e in m["capabilities"].items():
            if "skipped" in e:
                continue
            for model, p in e["per_model"].items():
                h = e["held_out_model"][model]
                rows.append({"method": method, "capability": cap, "model": model,
                             "gamma joint / own": f"{e['joint']['gamma']:.2f} / {p['gamma_own']:.2f}",
                             "MAE joint": _f(p["mae_joint"]), "MAE own": _f(p["mae_own"]),
                             "mean abs dL held-out densities": _f(p["mean_abs_dL"]),
                             "held out: plain MAE (mean abs dL)": f"{_f(h['mae_plain_transfer'])} ({_f(h['mean_abs_dL'])})",
                             "held out: gamma transfer, anchor d": f"{h['anchor_density']:g}",
                             "gamma transfer MAE (mean abs dL)":
                                 f"{_f(h['mae_gamma_transfer'])} ({_f(h['mean_abs_dL_gamma_transfer'])})"})
    lines = ["### Across models: pruning", "", "Joint (shared gamma, model-state features) and own fits on half the "
             "densities, scored on the others; a held-out model predicted from the others (plain) or from their "
             "gamma and one of its densities.", ""]
    lines += [markdown_table(rows) if rows else "(no model pair)", ""]
    l0 = [{"method": method, "held-out model": model, "capability": cap, "L0": f"{c['L0']:.3f}", "MAE": _f(c["mae"]),
           "mean abs dL": _f(c["mean_abs_dL"])}
          for method, m in cross["pruning"].items() for model, e in m["l0_across_capabilities"].items()
          if "skipped" not in e for cap, c in e["capabilities"].items()]
    if l0:
        lines += ["A = a0 + a1 L0 over the other models' capabilities (one gamma), held-out model predicted from its L0:",
                  "", markdown_table(l0), ""]
    lr = [{"capability / targets": key, "held-out model": model, "n train": str(e["n_train"]), "n": str(e["n"]),
           "MAE": _f(e["mae"]), "Pearson r": _f(e["pearson"]), "mean abs dL": _f(e["mean_abs_dL"])}
          for key, by in cross["lowrank"].items() for model, e in by.items() if "skipped" not in e]
    if lr:
        lines += ["### Across models: stable-rank line fitted on the other models", "", markdown_table(lr), ""]
    return lines


def _f(x: Any) -> str:
    return "-" if x is None or (isinstance(x, float) and not np.isfinite(x)) else f"{x:.3f}"


def write_report(
    records: Sequence[Mapping[str, Any]], fits: Mapping[str, Any], out_dir: str | Path,
    selections: Sequence[Mapping[str, Any]] = (), title: str = "capsense compression report",
) -> Path:
    """``report.md``, ``fits.json`` and the two plots in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "fits.json", json.dumps(fits, indent=1, default=float) + "\n")
    p1 = plot_pruning(fits, out / "pruning_fits.png")
    p2 = plot_predicted_vs_measured(fits, out / "predicted_vs_measured.png")
    base = [r for r in records if r["method"] == "none"]
    lines = [f"# {title}", ""]
    if base:
        lines += ["Reference loss L0 (nats/token) and accuracy: " + ", ".join(
            f"{r['capability']} {r['nll']:.3f} / {'-' if r['acc'] is None else format(r['acc'], '.2f')}" for r in base) + f" ({base[0].get('n_docs', '?')} probes each).", ""]
    lines += ["## Measured dL (nats/token) per setting", "", grid_table(records), "", "## Fits", "", fits_markdown(fits)]
    if p1:
        lines += [f"![pruning fits]({p1.name})", ""]
    if p2:
        lines += [f"![predicted vs measured]({p2.name})", ""]
    if selections:
        rows = [{"budget": f"{s['budget']:g}", "chosen (predicted)": s["chosen"], "best measured": s["best"],
                 "regret (nats/token)": f"{s['regret']:.3f}"} for s in selections]
        lines += ["## Budgeted selection", "", markdown_table(rows), ""]
    return atomic_write_text(out / "report.md", "\n".join(lines) + "\n")

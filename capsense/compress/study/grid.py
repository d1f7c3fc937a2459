"""A resumable grid of (method, setting) x capabilities, one JSONL line per measurement.

The model is loaded once; the target weights are saved on the CPU, each setting compresses
them in memory, every capability is measured, and the weights are restored. Each
measurement is appended (and flushed) as soon as it finishes; re-running the same grid
skips what the file already holds. The dense baseline is measured first (``method: none``).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from capsense.errors import CapsenseError
from capsense.compress.budget import BudgetError, method_family, normalize_setting, setting_label, uniform_budget
from capsense.compress.calibration import DEFAULT_CALIBRATION
from capsense.compress.measure import DEFAULT_CAPABILITIES, parse_capabilities, task_of
from capsense.compress.targets import parse_kinds

BASELINE = {"method": "none"}


class GridError(CapsenseError):
    """A grid spec or grid file that cannot be used."""


@dataclass
class GridSpec:
    """What a grid measures: one model, capabilities, probe count and the settings."""

    model: str
    capabilities: list[str] = field(default_factory=lambda: list(DEFAULT_CAPABILITIES))
    probes: int = 64
    dtype: str = "float32"
    calibration: str = DEFAULT_CALIBRATION
    calibration_samples: int = 64
    batch_size: int = 16
    train_tokens: float | None = None  # training tokens of the model state, for the fit's features
    settings: list[dict[str, Any]] = field(default_factory=list)  # normalized, each with "targets"

    def fingerprint(self) -> dict[str, Any]:
        """What must match for a grid file to be resumed."""
        return {k: getattr(self, k) for k in ("model", "probes", "dtype", "calibration", "calibration_samples")}


def expand_settings(entries: Iterable[Mapping[str, Any]], default_targets: str | None = None) -> list[dict[str, Any]]:
    """Expand list-valued fields (``method: [svd, asvd]``, ``density: [0.9, 0.8]``) into settings."""
    out: list[dict[str, Any]] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise GridError(f"settings entry {i} must be a mapping, got {entry!r}")
        keys = list(entry)
        values = [v if isinstance(v, list) else [v] for v in entry.values()]
        for combo in itertools.product(*values):
            raw = dict(zip(keys, combo))
            targets = raw.pop("targets", default_targets)
            try:
                s = normalize_setting(raw)
                kinds = parse_kinds(targets)
            except (BudgetError, ValueError) as e:
                raise GridError(f"settings entry {i} ({raw}): {e}") from None
            s["targets"] = ",".join(kinds)
            if s not in out:
                out.append(s)
    return out


def load_spec(path: str | Path, overrides: Mapping[str, Any] | None = None) -> GridSpec:
    """Read a grid YAML/JSON file; non-None ``overrides`` replace its top-level fields."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise GridError(f"grid spec {str(p)!r} not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise GridError(f"grid spec {str(p)!r} cannot be parsed: {e}") from None
    if not isinstance(data, dict):
        raise GridError(f"grid spec {str(p)!r} must be a mapping with model, capabilities and settings")
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return spec_from_dict(data)


def spec_from_dict(data: Mapping[str, Any]) -> GridSpec:
    allowed = {f for f in GridSpec.__dataclass_fields__} | {"targets"}
    unknown = set(data) - allowed
    if unknown:
        raise GridError(f"unknown grid field(s) {', '.join(sorted(unknown))}: valid fields are {', '.join(sorted(allowed))}")
    if not data.get("model"):
        raise GridError("the grid needs a model")
    caps = data.get("capabilities", list(DEFAULT_CAPABILITIES))
    settings = expand_settings(data.get("settings") or [], data.get("targets"))
    if not settings:
        raise GridError("the grid has no settings: list methods with their densities, bits or ratios")
    kw = {k: v for k, v in data.items() if k in GridSpec.__dataclass_fields__ and k not in ("settings", "capabilities")}
    if kw.get("train_tokens") is not None:
        try:
            kw["train_tokens"] = float(kw["train_tokens"])  # YAML reads 2.0e12 (no exponent sign) as a string
        except (TypeError, ValueError):
            raise GridError(f"train_tokens must be a number, got {kw['train_tokens']!r}") from None
    return GridSpec(capabilities=parse_capabilities(caps), settings=settings, **kw)


def record_key(setting: Mapping[str, Any], capability: str) -> str:
    if setting.get("method") == "none":
        return f"dense|{capability}"
    return f"{setting_label(setting)}|{setting['targets']}|{capability}"


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """All complete records of a grid file (a torn last line from a crash is ignored)."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    lines = p.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue
            raise GridError(f"{p}:{i + 1} is not valid JSON: the grid file is corrupt") from None
    return out


def _append(path: Path, record: Mapping[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record, default=float) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _repair_tail(path: Path) -> None:
    """Drop a torn last line (no trailing newline) so appends start on a fresh line."""
    if path.is_file() and path.stat().st_size:
        data = path.read_bytes()
        if not data.endswith(b"\n"):
            path.write_bytes(data[: data.rfind(b"\n") + 1])


def run_grid(
    spec: GridSpec,
    out: str | Path,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    model_and_tokenizer: tuple[Any, Any] | None = None,
) -> list[dict[str, Any]]:
    """Measure every (setting, capability) not yet in ``out``; return all records of the file."""
    from tqdm.auto import tqdm

    from capsense.compress.accounting import model_param_count
    from capsense.compress.apply import compress_model, mean_stable_rank, plan
    from capsense.compress.budget import CALIBRATED
    from capsense.compress.calibration import calibration_samples, collect_stats
    from capsense.compress.measure import build_probes, measure_probe
    from capsense.compress.targets import find_targets

    log = log or (lambda _m: None)
    out = Path(out)
    existing = read_records(out)
    fp = spec.fingerprint()
    for r in existing:
        if r.get("grid") != fp:
            raise GridError(
                f"{out} holds measurements of another grid ({r.get('grid')}); this grid is {fp}: use another --out"
            )
    done = {r["key"] for r in existing}
    _repair_tail(out)
    settings = [dict(BASELINE)] + spec.settings
    pending = [(s, c) for s in settings for c in spec.capabilities if record_key(s, c) not in done]
    if not pending:
        log(f"{out}: all {len(settings) * len(spec.capabilities)} measurements present")
        return existing
    if model_and_tokenizer is None:
        from capsense.core.models import load_model

        model, tokenizer = load_model(spec.model, dtype=spec.dtype)
    else:
        model, tokenizer = model_and_tokenizer
    # Validate every setting against the model before measuring anything.
    budgets = {}
    for s in spec.settings:
        b = uniform_budget({k: v for k, v in s.items() if k != "targets"}, s["targets"])
        plan(model, b)
        budgets[json.dumps(s, sort_keys=True)] = b
    probes = build_probes(tokenizer, spec.capabilities, spec.probes)
    targets = find_targets(model)
    saved = {t.name: t.module.weight.detach().clone().cpu() for t in targets}
    n_params = model_param_count(model)
    state = {"model": spec.model, "n_params": n_params, "log_params": math.log(n_params), "train_tokens": spec.train_tokens}
    baseline = {r["capability"]: r for r in existing if r["key"].startswith("dense|")}
    stats: dict[str, Any] = {}
    calib_info: list[dict[str, Any]] = []
    pending_methods = {s.get("method") for s, _ in pending}
    if pending_methods & CALIBRATED:
        samples, calib_info = calibration_samples(spec.calibration, tokenizer, spec.calibration_samples)
        log(f"calibrating on {spec.calibration} ({len(samples)} samples)")
        stats = collect_stats(model, targets, samples, gram="svd-llm" in pending_methods)
    # Stable ranks come from the original weights alone, once per target set.
    lowrank_targets = {s["targets"] for s, _ in pending if s["method"] != "none" and method_family(s["method"]) == "lowrank"}
    stable = {tg: mean_stable_rank(model, tg) for tg in sorted(lowrank_targets)}
    factor_cache: dict = {}
    bar = tqdm(total=len(pending), desc="grid", unit="meas", disable=not progress)
    records = list(existing)
    try:
        for s in settings:
            caps = [c for c in spec.capabilities if record_key(s, c) not in done]
            if not caps:
                continue
            t0 = time.time()
            summary: dict[str, Any] = {}
            extra: dict[str, Any] = {}
            if s["method"] != "none":
                b = budgets[json.dumps(s, sort_keys=True)]
                res = compress_model(model, b, stats, factor_cache=factor_cache)
                summary = res.summary
                if method_family(s["method"]) == "lowrank":
                    extra["stable_rank"] = stable[s["targets"]]
                extra["calibration"] = calib_info if s["method"] in CALIBRATED else []
            t_comp = time.time() - t0
            try:
                for c in caps:
                    t1 = time.time()
                    m = measure_probe(model, probes[c], c, spec.batch_size)
                    base = baseline.get(c)
                    rec = {
                        "key": record_key(s, c), "grid": fp, "model_state": state,
                        "setting": s, "label": "dense" if s["method"] == "none" else setting_label(s),
                        "method": s["method"], "family": "none" if s["method"] == "none" else method_family(s["method"]),
                        "targets": s.get("targets", ""), "capability": c, "task": task_of(c),
                        **m.to_dict(per_doc=True),
                        "nll0": base["nll"] if base else m.nll, "acc0": base["acc"] if base else m.acc,
                        "summary": summary, **extra,
                        "seconds": round(time.time() - t1 + t_comp / len(caps), 2),
                    }
                    rec["dL"] = rec["nll"] - rec["nll0"]
                    rec["dacc"] = rec["acc"] - rec["acc0"]
                    if s["method"] == "none":
                        baseline[c] = rec
                    _append(out, rec)
                    records.append(rec)
                    bar.update(1)
                    bar.set_postfix_str(f"{rec['label']} {c} dL={rec['dL']:+.3f}")
            finally:
                for t in targets:
                    t.module.weight.data.copy_(saved[t.name])
    finally:
        bar.close()
    return records


def grid_table(records: Sequence[Mapping[str, Any]]) -> str:
    """A markdown table of dL (nats/token) per setting and capability."""
    caps = list(dict.fromkeys(r["capability"] for r in records))
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        rows.setdefault((r["label"], r["targets"]), {})[r["capability"]] = r
    head = "| setting | targets | size | " + " | ".join(f"{c} dL" for c in caps) + " |"
    lines = [head, "|" + "---|" * (3 + len(caps))]
    for (label, targets), by_cap in rows.items():
        any_r = next(iter(by_cap.values()))
        size = any_r.get("summary", {}).get("size_ratio", 1.0)
        cells = []
        for c in caps:
            r = by_cap.get(c)
            cells.append(f"{r['dL']:+.3f}" if r else "")
        lines.append(f"| {label} | {targets or '-'} | {size:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

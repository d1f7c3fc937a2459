"""A resumable grid of (method, setting) x capabilities, one JSONL line per measurement.

The model is loaded once; the target weights are saved on the CPU, each setting compresses
them in memory, every capability is measured, and the weights are restored. Each
measurement is appended (and flushed) as soon as it finishes; re-running the same grid
skips what the file already holds. The dense baseline is measured first (``method: none``). What a grid measures
(its :class:`~capsense.compress.study.grid_spec.GridSpec`, from a file or lists) is :mod:`.grid_spec`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capsense.compress.budget import uniform_budget
from capsense.compress.capabilities import task_of
from capsense.compress.study.grid_spec import BASELINE, GridSpec, setting_of
from capsense.compress.targets import parse_kinds, restore, snapshot
from capsense.core.files import append_jsonl, read_jsonl, repair_jsonl_tail
from capsense.core.tables import markdown_table
from capsense.errors import CapsenseError


def record_key(setting: Mapping[str, Any], capability: str) -> str:
    if setting.get("method") == "none":
        return f"dense|{capability}"
    return f"{setting_of(setting).label}|{setting['targets']}|{capability}"


#: What every record ``capsense grid`` writes holds and fit and select read.
RECORD_FIELDS = ("model_state", "setting", "method", "capability", "dL", "summary")


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """All complete records of a grid file (a torn last line from a crash is ignored). A file of other records (a
    heads file, a bench's JSONL) is refused naming the first record's missing fields: fit and select failed on it
    with a KeyError traceback, and grid called it another grid's measurements."""
    records = read_jsonl(path)
    for i, r in enumerate(records, 1):
        missing = [k for k in RECORD_FIELDS if k not in r] if isinstance(r, dict) else list(RECORD_FIELDS)
        if missing:
            raise CapsenseError(f"{path} is not a grid file: its record {i} has no {', '.join(missing)} (give a JSONL "
                                "file `capsense grid` wrote)")
    return records


def _check_resumable(out: Path, existing: Sequence[Mapping[str, Any]], fp: Mapping[str, Any]) -> None:
    for r in existing:
        if r.get("grid") != fp:
            raise CapsenseError(
                f"{out} holds measurements of another grid ({r.get('grid')}); this grid is {fp}: use another `out`"
            )


@dataclass
class _Session:
    """What one grid run holds while it measures: the model, its saved weights, probes, statistics."""

    spec: GridSpec
    model: Any
    probes: dict[str, Any]
    targets: list
    saved: dict[str, Any]
    state: dict[str, Any]
    baseline: dict[str, Any]
    stats: dict[str, Any] = field(default_factory=dict)
    calib_info: list[dict[str, Any]] = field(default_factory=list)
    stable: dict[str, Any] = field(default_factory=dict)
    factor_cache: dict = field(default_factory=dict)

    def restore(self) -> None:
        restore(self.targets, self.saved)

    def compress(self, s: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Compress the model in place for grid entry ``s``: (summary, extra record fields)."""
        from capsense.compress.engine import compress_model

        if s["method"] == "none":
            return {}, {}
        setting = setting_of(s)
        budget = uniform_budget(setting.to_dict(), s["targets"])
        res = compress_model(self.model, budget, self.stats, factor_cache=self.factor_cache)
        extra: dict[str, Any] = {}
        if setting.family == "lowrank":
            extra["stable_rank"] = self.stable[s["targets"]]
        extra["calibration"] = self.calib_info if setting.calibrated else []
        return res.summary, extra

    def record(self, s: Mapping[str, Any], c: str, summary, extra, seconds: float) -> dict[str, Any]:
        from capsense.compress.capability_loss import measure_probe

        t1 = time.time()
        m = measure_probe(self.model, self.probes[c], c, self.spec.batch_size)
        base = self.baseline.get(c)
        dense = s["method"] == "none"
        rec = {
            "key": record_key(s, c), "grid": self.spec.fingerprint(), "model_state": self.state,
            "setting": s, "label": "dense" if dense else setting_of(s).label,
            "method": s["method"], "family": "none" if dense else setting_of(s).family,
            "targets": s.get("targets", ""), "capability": c, "task": task_of(c),
            **m.to_dict(per_doc=True),
            "nll0": base["nll"] if base else m.nll, "acc0": base["acc"] if base else m.acc,
            "summary": summary, **extra,
            "seconds": round(time.time() - t1 + seconds, 2),
        }
        rec["dL"] = rec["nll"] - rec["nll0"]
        rec["dacc"] = None if rec["acc"] is None else rec["acc"] - rec["acc0"]  # (a perplexity task: no accuracy)
        if dense:
            self.baseline[c] = rec
        return rec


def _open_session(spec: GridSpec, pending, existing, model_and_tokenizer, log, placed: Mapping[str, Any]) -> _Session:
    """Load the model (on ``placed``'s ``device`` or spread by its ``device_map``), validate every setting against
    it, build probes, calibrate what needs it."""
    from capsense.compress.accounting import model_param_count
    from capsense.compress.engine import mean_stable_rank, plan
    from capsense.compress.calibration import calibration_documents, calibration_samples, collect_stats
    from capsense.compress.capabilities import check_held_out
    from capsense.compress.capability_loss import build_probes
    from capsense.scoring.probe import model_max_length
    from capsense.compress.targets import find_targets

    if model_and_tokenizer is None:
        from capsense.core.models import load_model
        from capsense.core.placement import check_weights_in_memory

        model, tokenizer = load_model(spec.model, dtype=spec.dtype, revision=spec.revision, **placed)
        check_weights_in_memory(model, "a grid compresses every target weight in place and restores it")
    else:
        model, tokenizer = model_and_tokenizer
    for s in spec.settings:  # validate against the model before measuring anything
        plan(model, uniform_budget(setting_of(s).to_dict(), s["targets"]))
    # the kinds the settings name, not all: a mixture-of-experts model refuses MLP targets
    targets = find_targets(model, sorted({k for s in spec.settings for k in parse_kinds(s["targets"])}))
    n_params = model_param_count(model)
    sess = _Session(
        spec, model, build_probes(tokenizer, spec.capabilities, spec.probes, spec.include_path, model_max_length(model)),
        targets,
        snapshot(targets),
        {"model": spec.model, "n_params": n_params, "log_params": math.log(n_params), "train_tokens": spec.train_tokens},
        {r["capability"]: r for r in existing if r["key"].startswith("dense|")},
    )
    pending_settings = [setting_of(s) for s, _ in pending if s["method"] != "none"]
    if any(x.calibrated for x in pending_settings):
        check_held_out({c: (spec.probes, n) for c, n in calibration_documents(
            spec.capabilities, spec.calibration, spec.calibration_samples).items()},
            "lower `probes` or `calibration_samples`, or calibrate on other sources", spec.include_path)
        samples, sess.calib_info = calibration_samples(spec.calibration, tokenizer, spec.calibration_samples,
                                                       include_path=spec.include_path)
        log(f"calibrating on {spec.calibration} ({len(samples)} samples)")
        sess.stats = collect_stats(model, targets, samples, gram=any(x.needs_gram for x in pending_settings))
    # Stable ranks come from the original weights alone, once per target set.
    lowrank = {s["targets"] for s, _ in pending if s["method"] != "none" and setting_of(s).family == "lowrank"}
    sess.stable = {tg: mean_stable_rank(model, tg) for tg in sorted(lowrank)}
    return sess


def run_grid(
    spec: GridSpec,
    out: str | Path,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    model_and_tokenizer: tuple[Any, Any] | None = None,
    device: str = "cpu",
    device_map: str | dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Measure every (setting, capability) not yet in ``out``; return all records of the file. One writer per file
    (:class:`~capsense.core.lock.RunFolderLock`): a second grid on ``out`` is refused, naming the first.

    The model loads on ``device``, or spread by ``device_map`` (:func:`~capsense.core.models.load_model`; weights
    must stay in device memory, as for ``capsense compress``): calibration and probes run where the layers live, each
    matrix is compressed on the CPU and written back, and its original weights are kept in CPU memory for the
    restore between settings (:func:`~capsense.compress.targets.snapshot`), not beside the model on a GPU."""
    from capsense.core.lock import RunFolderLock

    out = Path(out)
    with RunFolderLock.for_file(out):
        return _run_grid(spec, out, progress, log or (lambda _m: None), model_and_tokenizer,
                         {"device": device, "device_map": device_map})


def _run_grid(spec: GridSpec, out: Path, progress: bool, log: Callable[[str], None],
              model_and_tokenizer: tuple[Any, Any] | None, placed: Mapping[str, Any]) -> list[dict[str, Any]]:
    from tqdm.auto import tqdm

    existing = read_records(out)
    _check_resumable(out, existing, spec.fingerprint())
    done = {r["key"] for r in existing}
    repair_jsonl_tail(out)
    settings = [dict(BASELINE)] + spec.settings
    pending = [(s, c) for s in settings for c in spec.capabilities if record_key(s, c) not in done]
    if not pending:
        log(f"{out}: all {len(settings) * len(spec.capabilities)} measurements present")
        return existing
    sess = _open_session(spec, pending, existing, model_and_tokenizer, log, placed)
    bar = tqdm(total=len(pending), desc="grid", unit="meas", disable=not progress)
    records = list(existing)
    try:
        for s in settings:
            caps = [c for c in spec.capabilities if record_key(s, c) not in done]
            if not caps:
                continue
            t0 = time.time()
            try:
                summary, extra = sess.compress(s)
                t_comp = (time.time() - t0) / len(caps)
                for c in caps:
                    rec = sess.record(s, c, summary, extra, t_comp)
                    append_jsonl(out, rec)
                    records.append(rec)
                    bar.update(1)
                    bar.set_postfix_str(f"{rec['label']} {c} dL={rec['dL']:+.3f}")
            finally:
                sess.restore()
    finally:
        bar.close()
    return records


def grid_table(records: Sequence[Mapping[str, Any]]) -> str:
    """A markdown table of dL (nats/token) per setting and capability."""
    caps = list(dict.fromkeys(r["capability"] for r in records))
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        rows.setdefault((r["label"], r["targets"]), {})[r["capability"]] = r
    table = []
    for (label, targets), by_cap in rows.items():
        size = next(iter(by_cap.values())).get("summary", {}).get("size_ratio", 1.0)
        row = {"setting": label, "targets": targets or "-", "size": f"{size:.3f}"}
        row.update({f"{c} dL": f"{by_cap[c]['dL']:+.3f}" if c in by_cap else "" for c in caps})
        table.append(row)
    return markdown_table(table)

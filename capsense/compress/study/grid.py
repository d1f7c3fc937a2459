"""A resumable grid of (method, setting) x capabilities, one JSONL line per measurement.

The model is loaded once; the target weights are saved on the CPU, each setting compresses
them in memory, every capability is measured, and the weights are restored. Each
measurement is appended (and flushed) as soon as it finishes; re-running the same grid
skips what the file already holds. The dense baseline is measured first (``method: none``).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from capsense.core.registry import Registry
from capsense.errors import CapsenseError
from capsense.compress.budget import normalize_setting, uniform_budget
from capsense.compress.methods import Setting, check_calibration_read, parse_setting
from capsense.core.tables import markdown_table
from capsense.core.files import append_jsonl, read_jsonl, repair_jsonl_tail
from capsense.compress.calibration import DEFAULT_CALIBRATION
from capsense.compress.capabilities import DEFAULT_CAPABILITIES, parse_capabilities, task_of
from capsense.compress.targets import parse_kinds, restore, snapshot

BASELINE = {"method": "none"}


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
    include_path: list[str] = field(default_factory=list)  # task YAML folders of capabilities and calibration (a user's)
    revision: str | None = None  # of a Hub model (None: its default branch)

    def fingerprint(self) -> dict[str, Any]:
        """What must match for a grid file to be resumed (the revision where one is named: files from before it
        resume as they were)."""
        keys = ("model", "probes", "dtype", "calibration", "calibration_samples") + (("revision",) if self.revision else ())
        return {k: getattr(self, k) for k in keys}


def expand_settings(entries: Iterable[Mapping[str, Any]], default_targets: str | None = None) -> list[dict[str, Any]]:
    """Expand list-valued fields (``method: [svd, asvd]``, ``density: [0.9, 0.8]``) into settings."""
    out: list[dict[str, Any]] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise CapsenseError(f"settings entry {i} must be a mapping, got {entry!r}")
        keys = list(entry)
        values = [v if isinstance(v, list) else [v] for v in entry.values()]
        for combo in itertools.product(*values):
            raw = dict(zip(keys, combo))
            targets = raw.pop("targets", default_targets)
            try:
                s = normalize_setting(raw)
                kinds = parse_kinds(targets)
            except CapsenseError as e:
                raise CapsenseError(f"settings entry {i} ({raw}): {e}") from None
            s["targets"] = ",".join(kinds)
            if s not in out:
                out.append(s)
    return out


# The value list that spans each family's axis in a grid: (setting key, name of the list).
#: Method family -> (setting key, the grid field listing its values).
GRID_AXES: Registry[tuple[str, str]] = Registry("family", "families", CapsenseError)
for _family, _axis in (("prune", ("density", "densities")), ("quant", ("bits", "bits")), ("lowrank", ("ratio", "ratios"))):
    GRID_AXES.register(_family, _axis)


def settings_from_lists(methods: Sequence[str], values: Mapping[str, Sequence[float] | None],
                        group_size: int | None = None) -> list[dict[str, Any]]:
    """Grid entries for ``methods``, each spanning its family's axis from ``values`` (keyed densities/bits/ratios)."""
    from capsense.compress.methods import METHODS

    out = []
    for m in methods:
        cls = METHODS.get(m)
        if cls is None:
            raise CapsenseError(METHODS.unknown_message(m))
        key, name = GRID_AXES[cls.family]
        if not values.get(name):
            raise CapsenseError(f"{m} needs a list of {name}")
        entry: dict[str, Any] = {"method": m, key: [int(v) for v in values[name]] if key == "bits" else list(values[name])}
        if cls.family == "quant":
            entry["group_size"] = group_size
        out.append(entry)
    return out


def load_spec(path: str | Path, overrides: Mapping[str, Any] | None = None) -> GridSpec:
    """Read a grid YAML/JSON file; non-None ``overrides`` replace its top-level fields."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise CapsenseError(f"grid spec {str(p)!r} not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise CapsenseError(f"grid spec {str(p)!r} cannot be parsed: {e}") from None
    if not isinstance(data, dict):
        raise CapsenseError(f"grid spec {str(p)!r} must be a mapping with model, capabilities and settings")
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return spec_from_dict(data)


def spec_from_dict(data: Mapping[str, Any]) -> GridSpec:
    """The checked :class:`GridSpec` of a grid file's mapping (fields of :class:`GridSpec`, ``settings``
    entries with list-valued fields expanded, a default ``targets``)."""
    allowed = {f for f in GridSpec.__dataclass_fields__} | {"targets"}
    unknown = set(data) - allowed
    if unknown:
        raise CapsenseError(f"unknown grid field(s) {', '.join(sorted(unknown))}: valid fields are {', '.join(sorted(allowed))}")
    if not data.get("model"):
        raise CapsenseError("the grid needs a model")
    caps = data.get("capabilities", list(DEFAULT_CAPABILITIES))
    settings = expand_settings(data.get("settings") or [], data.get("targets"))
    if not settings:
        raise CapsenseError("the grid has no settings: list methods with their densities, bits or ratios")
    kw = {k: v for k, v in data.items() if k in GridSpec.__dataclass_fields__ and k not in ("settings", "capabilities")}
    if kw.get("train_tokens") is not None:
        try:
            kw["train_tokens"] = float(kw["train_tokens"])  # YAML reads 2.0e12 (no exponent sign) as a string
        except (TypeError, ValueError):
            raise CapsenseError(f"train_tokens must be a number, got {kw['train_tokens']!r}") from None
    if isinstance(kw.get("include_path"), str):
        kw["include_path"] = [kw["include_path"]]
    return GridSpec(capabilities=parse_capabilities(caps, kw.get("include_path") or ()), settings=settings, **kw)


def grid_spec(spec_file: str | Path | None = None, methods: Sequence[str] = (),
              values: Mapping[str, Sequence[float] | None] | None = None, group_size: int | None = 128,
              **fields: Any) -> GridSpec:
    """The grid a caller asks for (``capsense grid``).

    With ``spec_file``, the file's grid, its fields replaced by the non-None ``fields`` (model,
    capabilities, probes, dtype, calibration, calibration_samples, targets, include_path, revision) and its settings by
    ``methods`` spanning ``values`` (keyed densities/bits/ratios) when those are given; without,
    ``fields`` and ``methods`` x ``values`` alone.
    """
    from capsense.compress.methods import METHODS

    settings = settings_from_lists(methods, values or {}, group_size)
    if spec_file:
        spec = load_spec(spec_file, fields)
        if settings:
            spec.settings = spec_from_dict({"model": spec.model, "settings": settings,
                                            "targets": fields.get("targets")}).settings
        return _check_calibration_read(spec, fields)
    if not fields.get("model"):
        raise CapsenseError("give `model` (or `spec_file` FILE)")
    if not settings:
        raise CapsenseError(
            f"give `methods` (from {', '.join(METHODS)}) with `densities`/`bits_list`/`ratios`, or `spec_file` FILE"
        )
    return _check_calibration_read(spec_from_dict({**{k: v for k, v in fields.items() if v is not None},
                                                   "settings": settings}), fields)


def _check_calibration_read(spec: GridSpec, fields: Mapping[str, Any]) -> GridSpec:
    """``spec``, unless the caller gave ``calibration`` or ``calibration_samples`` and no setting reads them (a grid of
    rtn, magnitude or svd alone): they were ignored, and still kept in the grid's fingerprint, so resuming with
    other values was refused as another grid."""
    check_calibration_read([k for k in ("calibration", "calibration_samples") if fields.get(k) is not None],
                           [_setting(s) for s in spec.settings], whose="this grid's ")
    return spec


def _setting(setting: Mapping[str, Any]) -> Setting:
    """The typed setting of a grid entry (its ``targets`` aside)."""
    return parse_setting({k: v for k, v in setting.items() if k != "targets"})


def record_key(setting: Mapping[str, Any], capability: str) -> str:
    if setting.get("method") == "none":
        return f"dense|{capability}"
    return f"{_setting(setting).label}|{setting['targets']}|{capability}"


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
        setting = _setting(s)
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
            "setting": s, "label": "dense" if dense else _setting(s).label,
            "method": s["method"], "family": "none" if dense else _setting(s).family,
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
        plan(model, uniform_budget(_setting(s).to_dict(), s["targets"]))
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
    pending_settings = [_setting(s) for s, _ in pending if s["method"] != "none"]
    if any(x.calibrated for x in pending_settings):
        check_held_out({c: (spec.probes, n) for c, n in calibration_documents(
            spec.capabilities, spec.calibration, spec.calibration_samples).items()},
            "lower `probes` or `calibration_samples`, or calibrate on other sources", spec.include_path)
        samples, sess.calib_info = calibration_samples(spec.calibration, tokenizer, spec.calibration_samples,
                                                       include_path=spec.include_path)
        log(f"calibrating on {spec.calibration} ({len(samples)} samples)")
        sess.stats = collect_stats(model, targets, samples, gram=any(x.needs_gram for x in pending_settings))
    # Stable ranks come from the original weights alone, once per target set.
    lowrank = {s["targets"] for s, _ in pending if s["method"] != "none" and _setting(s).family == "lowrank"}
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

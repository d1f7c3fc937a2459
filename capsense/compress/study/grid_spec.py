"""What a grid measures (:class:`GridSpec`): one model, its capabilities and the settings, from a grid file or from
``capsense grid``'s lists of methods and values, checked before anything loads (:mod:`.grid` runs it)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capsense.compress.budget import normalize_setting
from capsense.compress.calibration import DEFAULT_CALIBRATION
from capsense.compress.capabilities import DEFAULT_CAPABILITIES, parse_capabilities
from capsense.compress.methods import Setting, check_calibration_read, parse_setting
from capsense.compress.targets import parse_kinds
from capsense.core.registry import Registry
from capsense.errors import CapsenseError

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
    if isinstance(entries, (str, Mapping)) or not isinstance(entries, Iterable):
        raise CapsenseError(f"`settings` must be a list of settings (each a mapping such as {{method: magnitude, "
                            f"density: [0.9, 0.7]}}), got {entries!r}")  # (a string was read letter by letter)
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


#: The parameter of ``capsense grid`` (and :func:`grid_spec`) that gives each axis's list of values.
_AXIS_PARAMETERS = {"densities": "densities", "bits": "bits_list", "ratios": "ratios"}


def settings_from_lists(methods: Sequence[str], values: Mapping[str, Sequence[float] | None],
                        group_size: int | None = None) -> list[dict[str, Any]]:
    """Grid entries for ``methods``, each spanning its family's axis from ``values`` (keyed densities/bits/ratios), the
    quantizers' at ``group_size`` (None: 128). A list or a group size that no method of ``methods`` reads is an error,
    not ignored (until round 53 ``--methods magnitude --bits 4`` measured magnitude alone without a word)."""
    from capsense.compress.methods import METHODS

    out, read = [], set()
    for m in methods:
        cls = METHODS.get(m)
        if cls is None:
            raise CapsenseError(METHODS.unknown_message(m))
        key, name = GRID_AXES[cls.family]
        if not values.get(name):
            raise CapsenseError(f"{m} needs a list of {name}")
        entry: dict[str, Any] = {"method": m, key: [int(v) for v in values[name]] if key == "bits" else list(values[name])}
        if cls.family == "quant":
            entry["group_size"] = 128 if group_size is None else group_size
        out.append(entry)
        read |= {name, "group_size"} if cls.family == "quant" else {name}
    stray = [f"`{_AXIS_PARAMETERS.get(n, n)}`" for n in (*_AXIS_PARAMETERS, "group_size")
             if n not in read and (group_size is not None if n == "group_size" else values.get(n))]
    if stray:
        readers = {p: ", ".join(m for m in METHODS if GRID_AXES[METHODS[m].family][1] == a)
                   for a, p in _AXIS_PARAMETERS.items()}
        given = ", ".join(methods) or "none given: give `methods`"
        raise CapsenseError(
            f"{', '.join(stray)} not read by this grid's methods ({given}); "
            f"`densities` is read by {readers['densities']}, `bits_list` and `group_size` by {readers['bits_list']}, "
            f"`ratios` by {readers['ratios']}: leave {'it' if len(stray) == 1 else 'them'} out")
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
              values: Mapping[str, Sequence[float] | None] | None = None, group_size: int | None = None,
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
                           [setting_of(s) for s in spec.settings], whose="this grid's ")
    return spec


def setting_of(setting: Mapping[str, Any]) -> Setting:
    """The typed setting of a grid entry (its ``targets`` aside)."""
    return parse_setting({k: v for k, v in setting.items() if k != "targets"})

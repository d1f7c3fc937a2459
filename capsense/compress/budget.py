"""Compression budgets: one default setting, per-layer/per-matrix overrides, protected heads.

Settings are typed objects (:mod:`.methods`); in files a setting is a dict: ``{"method": "wanda", "density": 0.6, "scope": "row"}``,
``{"method": "rtn", "bits": 4, "group_size": 128}``, ``{"method": "svd-llm", "ratio": 0.8}``,
or ``{"skip": true}`` (leave the matrix dense). A budget file (YAML or JSON)::

    method: wanda
    density: 0.6
    targets: attn,mlp
    overrides:                 # applied in order; later entries win
      - layers: 0-3            # int, list, or "a-b"
        density: 0.9
      - matrices: [down_proj]  # short names (q_proj, down_proj) or kinds (attn, mlp)
        layers: [29]
        skip: true
      - match: "*.self_attn.o_proj"   # glob on the full module name
        density: 0.8
    protect:                   # keep these heads' input columns of the output projection
      heads: heads.json        # a heads file (relative to the budget file) or a spec L3H1+L5H0
      top_k: 8
      whole: false             # true: also their query rows and their KV group's key/value rows

Protected weights are kept dense and at full precision; pruning counts them toward the
density budget, RTN and low-rank compress the remaining block only.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capsense.compress.methods import METHODS, SETTING_KEYS, Setting, parse_setting, setting_label
from capsense.errors import BudgetError
from capsense.compress.protect import Protection, head_protection
from capsense.compress.targets import KINDS, Target, parse_kinds


__all__ = [
    "METHODS", "SETTING_KEYS", "Budget", "BudgetError", "Override", "load_budget",
    "normalize_setting", "protections", "setting_label", "uniform_budget",
]


def normalize_setting(setting: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a setting dict and fill in defaults; raise :class:`BudgetError` naming the problem."""
    s = parse_setting(setting)
    return {"skip": True} if s is None else s.to_dict()


def _parse_layers(value: Any) -> set[int]:
    if isinstance(value, bool):
        raise BudgetError(f"layers must be integers, a list or 'a-b', got {value!r}")
    if isinstance(value, int):
        return {value}
    if isinstance(value, str):
        out: set[int] = set()
        for part in value.split(","):
            part = part.strip()
            try:
                if "-" in part:
                    a, b = part.split("-")
                    out.update(range(int(a), int(b) + 1))
                elif part:
                    out.add(int(part))
            except ValueError:
                raise BudgetError(f"malformed layers {value!r}: use 3, [0, 1, 2] or '0-5'") from None
        return out
    if isinstance(value, Sequence):
        return set().union(*(_parse_layers(v) for v in value)) if value else set()
    raise BudgetError(f"malformed layers {value!r}: use 3, [0, 1, 2] or '0-5'")


@dataclass
class Override:
    """Settings for the matrices matching all given conditions."""

    layers: set[int] | None = None
    matrices: set[str] | None = None
    match: str | None = None
    setting: dict[str, Any] = field(default_factory=dict)

    def matches(self, t: Target) -> bool:
        if self.layers is not None and t.layer not in self.layers:
            return False
        if self.matrices is not None and t.short not in self.matrices and t.kind not in self.matrices:
            return False
        if self.match is not None and not fnmatch.fnmatch(t.name, self.match):
            return False
        return True

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], index: int) -> Override:
        if not isinstance(d, Mapping):
            raise BudgetError(f"override {index} must be a mapping, got {d!r}")
        conds = {"layers", "matrices", "match"}
        unknown = set(d) - conds - SETTING_KEYS
        if unknown:
            raise BudgetError(
                f"override {index}: unknown key(s) {', '.join(sorted(unknown))}; conditions are layers, matrices, "
                f"match and settings are {', '.join(sorted(SETTING_KEYS))}"
            )
        mats = d.get("matrices")
        if isinstance(mats, str):
            mats = [m.strip() for m in mats.split(",")]
        return cls(
            layers=_parse_layers(d["layers"]) if "layers" in d else None,
            matrices=set(mats) if mats is not None else None,
            match=d.get("match"),
            setting={k: v for k, v in d.items() if k in SETTING_KEYS},
        )


@dataclass
class Budget:
    """A default setting, the target kinds, ordered overrides and protected heads."""

    default: dict[str, Any]
    targets: tuple[str, ...] = KINDS
    overrides: list[Override] = field(default_factory=list)
    protect_heads: Any = None  # a HeadSet, resolved against the model by protections()
    source: dict[str, Any] = field(default_factory=dict)
    whole_heads: bool = False  # protect the heads' q rows and their group's k/v rows too

    def setting_for(self, t: Target) -> Setting | None:
        """The validated setting for one target, or None if it stays dense."""
        merged = dict(self.default)
        for o in self.overrides:
            if o.matches(t):
                if "method" in o.setting and o.setting["method"] != merged.get("method"):
                    merged = {}  # a new method starts from its own defaults
                if not o.setting.get("skip"):
                    merged.pop("skip", None)
                merged.update(o.setting)
        try:
            return parse_setting(merged)
        except BudgetError as e:
            raise BudgetError(f"{t.name}: {e}") from None

    def settings(self) -> list[Setting]:
        """The validated settings the budget can give a matrix: its default, and each override as it applies on top
        of the setting before it (the default, or an earlier override it stacks on; one naming another method starts
        from that method's defaults); skipped ones left out. For checks before a model loads; :meth:`setting_for` is
        exact per matrix.

        Why not each override alone: an override may name no method (``density: 0.9`` for the first layers) and
        change the settings of the method the matrix already has. Parsing it as a whole setting refused exactly that
        ("no method given"), so the repository's example budget (``recipes/compress_budget_example.yaml``) failed
        before the model loaded."""
        effective = [dict(self.default)]
        for o in self.overrides:
            errors = []
            for before in reversed(effective):  # the latest first; the default last, whose error is reported
                base = {} if o.setting.get("method", before.get("method")) != before.get("method") else before
                merged = {**{k: v for k, v in base.items() if k != "skip"}, **o.setting}
                try:
                    parse_setting(merged)
                except BudgetError as e:
                    errors.append(e)
                    continue
                effective.append(merged)
                break
            else:
                raise errors[-1]
        return [s for s in map(parse_setting, effective) if s is not None]

    def describe(self) -> dict[str, Any]:
        return {
            "default": self.default,
            "targets": list(self.targets),
            "overrides": [
                {
                    **({"layers": sorted(o.layers)} if o.layers is not None else {}),
                    **({"matrices": sorted(o.matrices)} if o.matrices is not None else {}),
                    **({"match": o.match} if o.match else {}),
                    **o.setting,
                }
                for o in self.overrides
            ],
            "protect_heads": str(self.protect_heads) if self.protect_heads is not None else None,
            **({"whole_heads": True} if self.whole_heads else {}),
            **self.source,
        }


def uniform_budget(setting: Mapping[str, Any], targets: str | Sequence[str] | None = None) -> Budget:
    """A budget applying one setting to every target matrix."""
    kinds = parse_kinds(targets)
    return Budget(default=normalize_setting(setting), targets=kinds)


def load_budget(path: str | Path, cli_setting: Mapping[str, Any] | None = None, targets: str | None = None) -> Budget:
    """Read a budget file; non-None ``cli_setting`` values override its default setting."""
    from capsense.core.heads import HeadSet
    from capsense.errors import HeadSpecError

    p = Path(path)
    if not p.is_file():
        raise BudgetError(f"budget file {str(p)!r} not found")
    text = p.read_text()
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # noqa: BLE001 - any parse error is the user's file
        raise BudgetError(f"budget file {str(p)!r} cannot be parsed: {e}") from None
    if not isinstance(data, dict):
        raise BudgetError(f"budget file {str(p)!r} must hold a mapping with method, settings, overrides, protect")
    allowed = SETTING_KEYS | {"targets", "overrides", "protect"}
    unknown = set(data) - allowed
    if unknown:
        raise BudgetError(f"budget file {str(p)!r}: unknown key(s) {', '.join(sorted(unknown))}; valid keys are {', '.join(sorted(allowed))}")
    default = {k: v for k, v in data.items() if k in SETTING_KEYS}
    if cli_setting:
        if cli_setting.get("method") and cli_setting["method"] != default.get("method"):
            default = {}
        default.update({k: v for k, v in cli_setting.items() if v is not None})
    kinds = parse_kinds(targets if targets is not None else data.get("targets"))
    overrides = [Override.from_dict(d, i) for i, d in enumerate(data.get("overrides") or [])]
    budget = Budget(default=normalize_setting(default), targets=kinds, overrides=overrides, source={"budget_file": str(p)})
    protect = data.get("protect")
    if protect is not None:
        if isinstance(protect, str):
            protect = {"heads": protect}
        if not isinstance(protect, Mapping) or "heads" not in protect:
            raise BudgetError("protect must be a mapping with 'heads' (a heads file or spec), optional 'top_k' and 'whole'")
        unknown = set(protect) - {"heads", "top_k", "whole"}
        if unknown:
            raise BudgetError(f"protect: unknown key(s) {', '.join(sorted(unknown))}; valid keys are heads, top_k, whole")
        spec = protect["heads"]
        if isinstance(spec, str) and (spec.endswith(".json") or (p.parent / spec).is_file()):
            spec = str(p.parent / spec) if not Path(spec).is_absolute() else spec
        try:
            budget.protect_heads = HeadSet.parse(spec, top_k=protect.get("top_k"))
        except HeadSpecError as e:
            raise BudgetError(f"protect: {e}") from None
        budget.whole_heads = bool(protect.get("whole", False))
        budget.source["protect"] = {"heads": str(protect["heads"]), "top_k": protect.get("top_k"),
                                    **({"whole": True} if budget.whole_heads else {})}
    budget.settings()  # fail now, not halfway through compressing: every override must yield a valid setting
    return budget


def protections(model, budget: Budget, targets: Sequence[Target]) -> dict[str, Protection]:
    """Protected rows/columns of each target holding a protected head (columns only unless ``whole_heads``)."""
    return head_protection(model, budget.protect_heads, targets, whole=budget.whole_heads)


def budget_document(budget: Budget) -> dict[str, Any]:
    """A budget file's content (YAML/JSON mapping) that reproduces ``budget``: :meth:`Budget.describe`
    in the file's layout (the default setting at the top level, ``targets`` as one string, ``protect``)."""
    d = budget.describe()
    doc: dict[str, Any] = {**d["default"], "targets": ",".join(d["targets"]), "overrides": d["overrides"]}
    if d["protect_heads"] is not None:
        doc["protect"] = {"heads": d["protect_heads"], "whole": bool(d.get("whole_heads"))}
    return doc


def write_budget_file(path, budget: Budget) -> None:
    """Write ``budget`` as a YAML budget file (``capsense compress --budget-file`` reproduces it)."""
    import yaml

    from capsense.core.files import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(budget_document(budget), sort_keys=False))

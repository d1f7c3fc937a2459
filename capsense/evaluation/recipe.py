"""Recipes: a YAML file that runs ``locate`` (one or more targets) and ``validate`` in one go.

    name: smollm2-induction
    hardware: 2 CPU cores            # what the recipe expects
    expected_time: 45 min
    model: smollm2-135m
    out: runs/smollm2-induction       # <out>/<target>/locate and <out>/<target>/validate
    locate:                           # any LocateConfig field; task may be a list of targets,
                                      # and a field may map targets to values (metric: {gsm8k: exact_match})
      task: capsense_induction
      controls: [default, capsense_arithmetic]   # default: the "default" control suite; [none]: no controls
      masks: 150
    validate:                         # optional; tasks default to the target, its controls and the held-out suite
      top_k: 5
      random: 3
      limit: 100
"""

from __future__ import annotations

from dataclasses import fields
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from capsense.errors import CapsenseError
from capsense.localize.config import LocateConfig


_LOCATE_FIELDS = {f.name for f in fields(LocateConfig)} - {"model", "out", "task"}
_VALIDATE_FIELDS = {"top_k", "tasks", "random", "limit", "seed", "batch_size", "device", "device_map", "dtype",
                    "include_path", "confirm_run_unsafe_code", "tolerance", "ablation", "mean_reference"}


def load_recipe(path: str | Path) -> dict[str, Any]:
    """Read and check a recipe; unknown keys are errors naming the valid ones."""
    p = Path(path)
    if not p.is_file():
        raise CapsenseError(f"recipe {str(p)!r} not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise CapsenseError(f"recipe {p} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise CapsenseError(f"recipe {p} must be a mapping with 'model' and 'locate' keys")
    for key in ("model", "locate"):
        if key not in data:
            raise CapsenseError(f"recipe {p}: missing '{key}'")
    loc = data["locate"]
    if not isinstance(loc, dict) or "task" not in loc:
        raise CapsenseError(f"recipe {p}: locate needs a 'task' (or a list of targets)")
    bad = set(loc) - _LOCATE_FIELDS - {"task"}
    if bad:
        raise CapsenseError(f"recipe {p}: unknown locate keys {sorted(bad)}; valid: {sorted(_LOCATE_FIELDS | {'task'})}")
    bad = set(data.get("validate") or {}) - _VALIDATE_FIELDS
    if bad:
        raise CapsenseError(f"recipe {p}: unknown validate keys {sorted(bad)}; valid: {sorted(_VALIDATE_FIELDS)}")
    data.setdefault("out", f"runs/{data.get('name', p.stem)}")
    return data


def recipe_steps(data: dict[str, Any], out: str | None = None) -> list[tuple[LocateConfig, dict[str, Any] | None]]:
    """One (locate config, validate settings) per target."""
    loc = dict(data["locate"])
    targets = loc.pop("task")
    targets = [targets] if isinstance(targets, str) else list(targets)
    root = Path(out or data["out"])
    per_target = {k: v for k, v in loc.items() if isinstance(v, dict)}
    for key, values in per_target.items():
        if set(values) - set(targets):
            raise CapsenseError(f"locate.{key} maps {sorted(set(values) - set(targets))}, which are not targets "
                              f"({', '.join(targets)})")
    steps = []
    for t in targets:
        run_dir = root / t if len(targets) > 1 else root
        kwargs = {"controls": ["default"], **{k: v for k, v in loc.items() if k not in per_target}}
        kwargs.update({k: v[t] for k, v in per_target.items() if t in v})
        try:
            cfg = LocateConfig(model=data["model"], task=t, out=str(run_dir / "locate"), **kwargs)
        except TypeError as e:
            raise CapsenseError(f"recipe locate section: {e}") from None
        val = data.get("validate")
        if val is not None:
            val = {"tasks": None, **val, "out": str(run_dir / "validate")}
        steps.append((cfg, val))
    return steps


def describe_steps(data: dict[str, Any], steps: list[tuple[LocateConfig, dict[str, Any] | None]], default_name: str,
                   render: Callable[[LocateConfig, dict[str, Any] | None], list[str]]) -> list[str]:
    """The lines ``capsense run`` prints before it starts: the recipe, its expectations, and ``render``'s lines for each
    step (the command layer's: the command lines that run it)."""
    lines = [f"Recipe {data.get('name', default_name)}: {len(steps)} target(s); expects "
             f"{data.get('hardware', 'unspecified hardware')}, {data.get('expected_time', 'unspecified time')}"]
    for cfg, val in steps:
        lines += render(cfg, val)
    return lines

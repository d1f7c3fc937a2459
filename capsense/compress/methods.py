"""The registry of compression methods: each name's typed setting class, parsing and labels.

:data:`METHODS` maps each method name to its class (:mod:`.settings`: pruning, RTN, low rank;
:mod:`.compensated`: GPTQ, SparseGPT); nothing dispatches on method names elsewhere. A setting
validates itself (:meth:`Setting.parse`, via :func:`parse_setting`), names itself (``label``),
states its exact size before touching a weight and applies itself to one matrix. As dicts
(``to_dict``) settings keep the file format of budget files, grid records and ``capsense.json``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from capsense.compress.compensated import GPTQSetting, SparseGPTSetting
from capsense.compress.settings import TYPICAL_SHAPE, Applied, LowRankSetting, PruneSetting, QuantSetting, Setting
from capsense.errors import BudgetError, CapsenseError
from capsense.core.registry import Registry

SETTING_KEYS = {"method", "density", "scope", "bits", "group_size", "ratio", "alpha", "damp", "act_order", "solve_on",
                "skip"}

METHODS: Registry[type[Setting]] = Registry("method", "methods", BudgetError)
for _name, _cls in (("magnitude", PruneSetting), ("wanda", PruneSetting), ("sparsegpt", SparseGPTSetting),
                    ("rtn", QuantSetting), ("gptq", GPTQSetting),
                    ("svd", LowRankSetting), ("asvd", LowRankSetting), ("svd-llm", LowRankSetting)):
    METHODS.register(_name, _cls)
FAMILY_KEYS = {"prune": ("density", "scope"), "quant": ("bits", "group_size"), "lowrank": ("ratio", "alpha")}
#: The methods that read calibration inputs, in the registry's order.
CALIBRATED = tuple(m for m, cls in METHODS.items() if m in cls.calibrated_methods)


def check_calibration_read(given: Sequence[str], settings: Sequence[Setting], whose: str = "") -> None:
    """Refuse the calibration parameters a caller gave (``given``: their names) where none of ``settings`` reads them
    (``whose``: what the settings belong to, for the message). Given to magnitude, rtn or svd they were ignored, and a
    grid kept them in its fingerprint, so resuming with other values was refused as another grid."""
    if given and not any(s.calibrated for s in settings):
        methods = ", ".join(dict.fromkeys(s.method for s in settings)) or "this budget"
        are, them = ("are", "them") if len(given) > 1 else ("is", "it")
        raise CapsenseError(f"{' and '.join(f'`{k}`' for k in given)} {are} read by the calibrated methods "
                            f"({', '.join(CALIBRATED)}); {whose}{methods} calibrate(s) on nothing: leave {them} out")


def parse_setting(setting: Mapping[str, Any]) -> Setting | None:
    """A validated setting from a dict (None for ``{"skip": true}``); :class:`BudgetError` naming the problem."""
    unknown = set(setting) - SETTING_KEYS
    if unknown:
        raise BudgetError(f"unknown setting key(s) {', '.join(sorted(unknown))}: valid keys are {', '.join(sorted(SETTING_KEYS))}")
    if setting.get("skip"):
        return None
    method = setting.get("method")
    if method is None:
        raise BudgetError(f"no method given: choose one of {', '.join(METHODS)}")
    cls = METHODS[str(method)]
    try:
        parsed = cls.parse(str(method), setting)
    except (TypeError, ValueError, CapsenseError) as e:  # int("x") / float("x") of a user's value, or its range
        raise BudgetError(str(e)) from None
    own = set(FAMILY_KEYS[cls.family]) | set(cls.fields)
    given = sorted(k for k in SETTING_KEYS - {"method", "skip"} if k not in own and setting.get(k) is not None)
    if given:
        raise BudgetError(f"{', '.join(dict.fromkeys(given))} does not apply to {method}")
    return parsed


def setting_label(setting: Mapping[str, Any]) -> str:
    """Short label of a setting dict: ``wanda@d0.6``, ``rtn@4b/g128``, ``svd-llm@r0.8``, ``dense``."""
    s = parse_setting(setting)
    return "dense" if s is None else s.label

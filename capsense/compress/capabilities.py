"""Capabilities: short names for capsense's offline lm-eval tasks, and which documents each use reads.

A capability (``math``, ``code``, ...) is one task of capsense; its documents serve two uses
that must never overlap: *probes* (:mod:`.capability_loss`) measure the capability on the
task's **first** documents, and *calibration* (:mod:`.calibration`: Wanda/ASVD/SVD-LLM
statistics, the Fisher sensitivity, measured sensitivity's allocation documents, distillation
text) reads its **last** ones. :func:`document_ids` is the one place that split is written.
"""

from __future__ import annotations

from collections.abc import Sequence

from capsense.errors import CapsenseError

CAPABILITIES: dict[str, str] = {
    "math": "capsense_math_problems",
    "code": "capsense_code",
    "qa": "capsense_qa",
    "arithmetic": "capsense_arithmetic",
    "addition": "capsense_addition",
    "induction": "capsense_induction",
    "prose": "capsense_prose",
    "antonyms": "capsense_antonyms",
}
DEFAULT_CAPABILITIES = ("math", "code", "qa")
USES = ("probe", "calibration")


class MeasureError(CapsenseError):
    """An unknown capability or an unusable probe request."""


def parse_capabilities(spec: str | Sequence[str]) -> list[str]:
    """``"math,code,qa"`` -> validated list; names are aliases above or ``capsense_*`` task names."""
    items = [c.strip() for c in (spec.split(",") if isinstance(spec, str) else spec) if c.strip()]
    if not items:
        raise MeasureError(f"no capability given: choose from {', '.join(CAPABILITIES)}")
    task_names = set(CAPABILITIES.values())
    bad = [c for c in items if c not in CAPABILITIES and c not in task_names]
    if bad:
        raise MeasureError(
            f"unknown capability {', '.join(repr(b) for b in bad)}: valid capabilities are {', '.join(CAPABILITIES)}"
        )
    return list(dict.fromkeys(items))


def task_of(capability: str) -> str:
    """The lm-eval task name of a capability (a task name is returned as it is)."""
    return CAPABILITIES.get(capability, capability)


def document_ids(n_docs: int, n: int, use: str) -> list[int]:
    """Ids (ascending) of the ``n`` documents of a task of ``n_docs`` that ``use`` reads.

    ``probe``: the first ``n``; ``calibration``: the last ``n``. The two are disjoint while
    ``n_probe + n_calibration <= n_docs``; all documents when ``n >= n_docs``.
    """
    if use not in USES:
        raise ValueError(f"use must be one of {USES}, got {use!r}")  # a programming error, not user input
    n = max(min(n, n_docs), 0)
    return list(range(n)) if use == "probe" else list(range(n_docs - n, n_docs))

"""Capabilities: short names for capsense's offline lm-eval tasks, and which documents each use reads.

A capability (``math``, ``code``, ...) is one task of capsense; its documents serve two uses
that must never overlap: *probes* (:mod:`.capability_loss`) measure the capability on the
task's **first** documents, and *calibration* (:mod:`.calibration`: Wanda/ASVD/SVD-LLM
statistics, the Fisher sensitivity, measured sensitivity's allocation documents, distillation
text) reads its **last** ones. :func:`document_ids` is the one place that split is written.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path

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


def parse_capabilities(spec: str | Sequence[str]) -> list[str]:
    """``"math,code,qa"`` -> validated list; names are aliases above or ``capsense_*`` task names."""
    items = [c.strip() for c in (spec.split(",") if isinstance(spec, str) else spec) if c.strip()]
    if not items:
        raise CapsenseError(f"no capability given: choose from {', '.join(CAPABILITIES)}")
    task_names = set(CAPABILITIES.values())
    bad = [c for c in items if c not in CAPABILITIES and c not in task_names]
    if bad:
        raise CapsenseError(
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


def looks_like_task(source: str) -> bool:
    """A calibration source that may name a capability or task (one word), not literal text."""
    return source in CAPABILITIES or (" " not in source and "\n" not in source and len(source) < 80)


def close_capability(source: str) -> str:
    """`` (did you mean math?)`` when ``source`` is a near miss of a capability name, else ``""``."""
    close = difflib.get_close_matches(source, list(CAPABILITIES), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close and source not in CAPABILITIES else ""


def misspelt_task_message(source: str) -> str:
    """The error for a one-word calibration source that is a misspelt capsense task (``capsense_mathh``),
    ``""`` for anything else; cheap (capsense's task YAMLs, no lm-eval import). Without it the typo
    was read as literal calibration text."""
    from capsense.tasks import check_task_names
    from capsense.errors import UnknownTaskError

    if Path(source).is_file() or not looks_like_task(source) or source in CAPABILITIES:
        return ""
    try:
        check_task_names([source])
    except UnknownTaskError as e:
        return f"calibration source {source!r}: {e}"
    return ""


def check_calibration_spec(spec: str) -> None:
    """Every comma-separated source of a ``calibration`` spec spelt right, before a model loads."""
    if Path(spec).is_file():
        return
    for source in (s.strip() for s in spec.split(",")):
        if source and misspelt_task_message(source):
            raise CapsenseError(misspelt_task_message(source))


def check_measure(model: str, reference: str | None, probes: int, out: str | Path | None = None,
                  capabilities: str | Sequence[str] = DEFAULT_CAPABILITIES) -> None:
    """Refuse a measurement request before torch loads: ``probes`` below 1, an ``out`` file that
    cannot be written, a ``model`` or ``reference`` that names no model, an unknown capability."""
    from capsense.core.files import check_output_file
    from capsense.core.models import check_model

    if probes < 1:
        raise CapsenseError(f"`probes` must be at least 1, got {probes}")
    check_output_file(out)
    for name in (model, reference):
        if name:
            check_model(name)
    parse_capabilities(capabilities)

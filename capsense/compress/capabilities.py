"""Capabilities: the lm-eval tasks a compression keeps or measures, and which documents each use reads.

A capability is one lm-eval task: a short name of capsense's offline tasks (``math``, ``code``, ``text``, ...),
or a task's own name: any of capsense's, one an ``include_path`` folder declares (a user's task), or one of
lm-eval's (``wikitext``, where its data can be reached). Log-likelihood, multiple-choice and perplexity tasks
(``loglikelihood_rolling``: nats per token of whole texts, cut into windows of the model's length as lm-eval
cuts them) all give a loss in nats/token; a generation task gives its reference answers' (GSM8K's kind). Its
documents serve two uses
that must never overlap: *probes* (:mod:`.capability_loss`) measure the capability on the
task's **first** documents, and *calibration* (:mod:`.calibration`: Wanda/ASVD/SVD-LLM
statistics, the Fisher sensitivity, measured sensitivity's allocation documents, distillation
text) reads its **last** ones. :func:`document_ids` is the one place that split is written.
"""

from __future__ import annotations

import difflib
import functools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from capsense.errors import CapsenseError, UnknownTaskError

CAPABILITIES: dict[str, str] = {
    "math": "capsense_math_problems",
    "code": "capsense_code",
    "qa": "capsense_qa",
    "arithmetic": "capsense_arithmetic",
    "addition": "capsense_addition",
    "induction": "capsense_induction",
    "prose": "capsense_prose",
    "antonyms": "capsense_antonyms",
    "text": "capsense_text",
}
DEFAULT_CAPABILITIES = ("math", "code", "qa")
#: Where a distillation's training texts come from by default (each source's last documents).
DISTILL_SOURCES = "prose,math,code,qa,arithmetic,induction"
USES = ("probe", "calibration")


def parse_capabilities(spec: str | Sequence[str], include_path: Sequence[str | os.PathLike] = ()) -> list[str]:
    """``"math,code,qa"`` -> the validated list, each once, in order.

    A name is a short name above or an lm-eval task: capsense's or an ``include_path`` folder's (checked
    from their YAMLs, no lm-eval import) or lm-eval's own, which only lm-eval's task index confirms (it is
    built, some seconds, only when such a name is given). A misspelt ``capsense_`` task or short name, a
    tag (a group of tasks, not one loss) and a name no index holds are errors naming what is valid.
    """
    from capsense.tasks import check_task_names, local_task_names

    items = [c.strip() for c in (spec.split(",") if isinstance(spec, str) else spec) if c.strip()]
    if not items:
        raise CapsenseError(f"no capability given: choose from {', '.join(CAPABILITIES)} or name an lm-eval task")
    short = f"the short names are {', '.join(CAPABILITIES)}"
    paths = [str(p) for p in include_path]
    tasks = local_task_names(paths, tags=False)
    tags = local_task_names(paths) - tasks
    for c in items:
        if c in tags:
            raise CapsenseError(f"capability {c!r} is a tag (a group of tasks), not one task: name its tasks; {short}")
        if c not in CAPABILITIES and c not in tasks and close_capability(c):
            raise CapsenseError(f"unknown capability {c!r}{close_capability(c)}: {short}, or an lm-eval task's name")
    unconfirmed = tuple(c for c in items if c not in CAPABILITIES and c not in tasks)
    if unconfirmed:
        try:
            check_task_names(unconfirmed, paths)  # a misspelt capsense_ task: at once
            _confirm_by_lm_eval(tuple(paths), unconfirmed)
        except UnknownTaskError as e:
            raise CapsenseError(f"unknown capability: {e}; {short}") from None
    return list(dict.fromkeys(items))


@functools.lru_cache(maxsize=16)
def _confirm_by_lm_eval(include_path: tuple[str, ...], tasks: tuple[str, ...]) -> None:
    """Names lm-eval's own index holds (UnknownTaskError otherwise); once per process and names: a run
    parses its capabilities at several steps, and the index takes seconds to build."""
    from capsense.tasks import task_manager

    task_manager(list(include_path), list(tasks))


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


def check_held_out(uses: Mapping[str, tuple[int, int]], fix: str, include_path: Sequence[str | os.PathLike] = ()) -> None:
    """Refuse a run in which a capability's probe documents (its first ``n_probe``: what the run reports it by) and its
    calibration documents (its last ``n_calibration``: what the run fits or chooses on) would share documents.

    ``uses``: capability -> (n_probe, n_calibration); ``fix``: which of the run's parameters to lower. A task of few
    documents (capsense_text's 40, a user's) read by the defaults (32 probes, 64 calibration texts) gave a dL on
    documents the run had fitted to, reported as held out, without a word; only a task of fewer documents than the
    two together does, so the check loads each such task (no model)."""
    from capsense.scoring.requests import load_task

    for cap, (first, last) in uses.items():
        if first < 1 or last < 1:
            continue
        n_docs = len(load_task(task_of(cap), include_path).eval_docs)
        first, last = min(first, n_docs), min(last, n_docs)
        shared = first + last - n_docs
        if shared > 0:
            raise CapsenseError(
                f"capability {cap!r} has {n_docs} documents: its first {first} measure it and its last {last} "
                f"calibrate the run, so {shared} would do both and its measurement would not be held out; beside "
                f"{first} probe documents it can calibrate on at most {n_docs - first}: {fix}")


def looks_like_task(source: str) -> bool:
    """A calibration source that may name a capability or task (one word), not literal text."""
    return source in CAPABILITIES or (" " not in source and "\n" not in source and len(source) < 80)


def close_capability(source: str) -> str:
    """`` (did you mean math?)`` when ``source`` is a near miss of a capability name, else ``""``."""
    close = difflib.get_close_matches(source, list(CAPABILITIES), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close and source not in CAPABILITIES else ""


def check_calibration_source(source: str, include_path: Sequence[str | os.PathLike] = ()) -> None:
    """A one-word calibration source (no space, under 80 characters) that is not a file must name a task as a
    capability does (:func:`parse_capabilities`; ``include_path``: folders of task YAMLs); longer text is literal.

    Why: a one-word source that named no task was read as one calibration text of that word. That made a misspelt
    task (``capsense_mathh``), and a user's task given without its folder, calibrate on the name itself, silently."""
    if Path(source).is_file() or not looks_like_task(source):
        return
    try:
        parse_capabilities([source], include_path)
    except CapsenseError as e:
        raise CapsenseError(f"calibration source {source!r}: {e}; literal calibration text has more than one word "
                            "(or give a file)") from None


def check_calibration_spec(spec: str, include_path: Sequence[str | os.PathLike] = ()) -> None:
    """Every comma-separated source of a ``calibration`` spec a file, literal text or a known task, before a model loads."""
    if Path(spec).is_file():
        return
    for source in (s.strip() for s in spec.split(",")):
        if source:
            check_calibration_source(source, include_path)


def check_measure(model: str, reference: str | None, probes: int, out: str | Path | None = None,
                  capabilities: str | Sequence[str] = DEFAULT_CAPABILITIES,
                  include_path: Sequence[str | os.PathLike] = (), device: str = "cpu",
                  device_map: str | None = None, revision: str | None = None,
                  reference_revision: str | None = None) -> None:
    """Refuse a measurement request before a model loads: ``probes`` below 1, an ``out`` file that
    cannot be written, a ``model`` or ``reference`` that names no model, an unknown capability
    (``include_path``: folders of task YAMLs that may declare it), a device or device map this machine lacks."""
    from capsense.core.files import check_output_file
    from capsense.core.models import check_model
    from capsense.core.placement import check_placement

    check_placement(device, device_map)
    if probes < 1:
        raise CapsenseError(f"`probes` must be at least 1, got {probes}")
    check_output_file(out, (model, reference, *include_path))
    check_model(model, revision)
    if reference_revision and not reference:
        raise CapsenseError("`reference_revision` is the revision of `reference`: give both, or neither")
    if reference:
        check_model(reference, reference_revision)
    parse_capabilities(capabilities, include_path)

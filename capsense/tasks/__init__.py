"""Offline capability tasks: deterministic data built in code, served to lm-eval.

The YAML configs live in the repository's ``lm_eval_tasks/`` (shipped inside the wheel as
``capsense/lm_eval_tasks``); each names a builder from this package through
``custom_dataset: !function capsense_tasks.<name>``.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from capsense.errors import UnknownTaskError

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

PREFIX = "capsense_"
#: capsense tasks whose lm-eval ``acc`` (greedy exact match of the whole continuation) is no
#: accuracy: prose continues with whole sentences that no model reproduces token for token, so
#: it reads 0 for every model and head set; validation tables leave it out.
WITHOUT_ACCURACY = frozenset({"capsense_prose"})
_TASK_LINE = re.compile(r"^(?:task|tag):\s*['\"]?([A-Za-z0-9_.\-]+)", re.MULTILINE)
_TASK_ONLY_LINE = re.compile(r"^task:\s*['\"]?([A-Za-z0-9_.\-]+)", re.MULTILINE)


def tasks_dir() -> Path:
    """The folder to pass to lm-eval's ``--include_path`` for capsense's offline tasks."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "lm_eval_tasks", here.parent / "lm_eval_tasks"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError("capsense's lm_eval_tasks folder is missing from this installation")


def local_task_names(include_path: Sequence[str] = (), tags: bool = True) -> set[str]:
    """Task and (with ``tags``) tag names declared in capsense's task YAMLs and the ``include_path`` folders
    (no lm-eval import)."""
    names: set[str] = set()
    pattern = _TASK_LINE if tags else _TASK_ONLY_LINE
    for folder in [tasks_dir(), *map(Path, include_path)]:
        for f in sorted(folder.rglob("*.yaml")) + sorted(folder.rglob("*.yml")):
            try:
                names.update(pattern.findall(f.read_text(errors="replace")))
            except OSError:
                continue
    return names


def _did_you_mean(name: str, known: Sequence[str]) -> str:
    # a name that the typed one starts (all but its last character) comes first: difflib alone
    # suggests capsense_qa for capsense_mathh (the shared prefix outweighs the stem)
    stem = sorted(k for k in known if len(os.path.commonprefix([k, name])) >= max(len(name) - 1, len(PREFIX) + 3))
    close = stem[:1] or difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def check_task_names(tasks: Sequence[str], include_path: Sequence[str] = ()) -> list[str]:
    """Check ``tasks`` cheaply, before lm-eval is imported; return the names only lm-eval can confirm.

    A name that ``include_path`` or capsense declares is fine; a ``capsense_`` name that capsense
    does not declare is an error with a close-match suggestion. Other names are returned, for
    :func:`task_manager` to check against lm-eval's own index (slow to build).
    """
    if not tasks:
        raise UnknownTaskError("no tasks given: name at least one lm-eval task, e.g. capsense_induction")
    local = local_task_names(include_path)
    ours = sorted(t for t in local if t.startswith(PREFIX))
    for t in tasks:
        if t not in local and (t.startswith(PREFIX) or t.startswith("capsense")):
            raise UnknownTaskError(
                f"unknown task {t!r}{_did_you_mean(t, ours)}: it is not a capsense task; capsense's tasks are "
                + ", ".join(ours)
            )
    return [t for t in tasks if t not in local]


class _DropCustomKwargsHint:
    """Drops lm-eval's per-task "Custom kwargs can be passed to `--metadata`" hint: capsense passes metadata itself."""

    def filter(self, record: "logging.LogRecord") -> bool:
        return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


def quiet_lm_eval_hints() -> None:
    """Silence lm-eval's repeated hint for capsense's own calls (idempotent)."""
    logger = logging.getLogger("lm_eval.api.task")
    if not any(isinstance(f, _DropCustomKwargsHint) for f in logger.filters):
        logger.addFilter(_DropCustomKwargsHint())


@contextmanager
def lm_eval_warnings_only() -> Iterator[None]:
    """lm-eval's loggers at WARNING (or ``LMEVAL_LOG_LEVEL``) for capsense's own ``simple_evaluate`` calls, restored after.

    Passing ``verbosity`` to ``simple_evaluate`` instead makes lm-eval add its own handler once per process, on
    ``sys.stderr`` as it is at that first call. Where that stream is borrowed (a notebook cell's capture,
    ``contextlib.redirect_stderr``, click's test runner), every lm-eval warning after it goes to that stream, not
    to the process's handlers (lm-eval also stops propagation), and where the stream was closed it is a "--- Logging
    error ---" traceback on the stderr of that moment. So capsense passes ``verbosity=None`` and sets the level
    here: records go to the process's own handlers, or to Python's last-resort handler, which writes to
    ``sys.stderr`` as it is when the record is emitted.
    """
    env = logging.getLevelName(os.environ.get("LMEVAL_LOG_LEVEL", "").upper() or "WARNING")
    with logger_level("lm_eval", env if isinstance(env, int) else logging.WARNING):
        yield


@contextmanager
def task_data_errors(tasks: Sequence[str]) -> Iterator[None]:
    """A task's data that cannot be loaded (no network, HF_HUB_OFFLINE, a dataset gone) as one
    :class:`~capsense.errors.CapsenseError` naming ``tasks`` and the cause, not a traceback from inside ``datasets``
    (its ``DatasetNotFoundError`` is a ``FileNotFoundError``). Around task building (:func:`load_task`) and lm-eval's
    ``simple_evaluate``, which builds the tasks it is given."""
    from capsense.errors import CapsenseError

    try:
        yield
    except (ConnectionError, FileNotFoundError) as e:
        offline = (" HF_HUB_OFFLINE is set: capsense's tasks build their data in code, lm-eval's download theirs"
                   if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") else "")
        named = ", ".join(repr(t) for t in tasks)
        named = f"task {named}" if len(tasks) == 1 else f"one of the tasks {named}"
        raise CapsenseError(f"{named}: its data could not be loaded ({type(e).__name__}: {e}).{offline}") from None


@contextmanager
def logger_level(name: str, level: int | None) -> Iterator[None]:
    """The logger ``name`` at ``level`` within the block (None: as it is), its own level restored after."""
    logger = logging.getLogger(name)
    before = logger.level
    if level is not None:
        logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


def task_manager(include_path: Sequence[str] = (), tasks: Sequence[str] = (), metadata: dict | None = None):
    """An lm-eval TaskManager with capsense's tasks; skips indexing lm-eval's own when unneeded.

    ``metadata`` reaches ``custom_dataset`` builders (capsense tasks count continuation
    tokens with ``metadata["tokenizer"]``); a loaded tokenizer there is passed as a
    :class:`capsense.tasks.common.SharedTokenizer`, which lm-eval's copies of the task config share.
    """
    from lm_eval.tasks import TaskManager

    from capsense.tasks.common import SharedTokenizer

    tok = (metadata or {}).get("tokenizer")
    if tok is not None and not isinstance(tok, (str, SharedTokenizer)):
        metadata = {**metadata, "tokenizer": SharedTokenizer(tok)}
    quiet_lm_eval_hints()
    paths = [str(tasks_dir()), *map(str, include_path)]
    quick = TaskManager(include_path=paths, include_defaults=False, metadata=metadata)
    if all(t in quick.all_tasks for t in tasks):
        return quick
    full = _full_manager(tuple(paths), metadata)
    missing = [t for t in tasks if t not in full.all_tasks]
    if missing:
        hints = "".join(_did_you_mean(t, full.all_tasks) for t in missing)
        raise UnknownTaskError(
            f"unknown task(s) {', '.join(missing)}{hints}: use lm-eval task names or add YAMLs with "
            "`include_path`; capsense's own tasks are "
            + ", ".join(sorted(t for t in quick.all_tasks if t.startswith(PREFIX)))
        )
    return full


def _full_manager(paths: tuple[str, ...], metadata: dict | None):
    """A TaskManager over lm-eval's own tasks and ``paths``, its index built once per process and folders.

    Why: building lm-eval's index reads its ~15k task entries (about 6 s on a 2-core CPU, lm-eval 0.4.13), and one
    command asked for it several times: ``capsense measure --capabilities wikitext`` checked the name, checked
    its documents against the calibration's and loaded it to measure, a validation checked its tasks and then
    loaded them. The index is shared; each manager gets its own task factory carrying ``metadata`` (the factory
    holds nothing else). Where lm-eval's manager has no such factory (another version) it is built anew, as
    before. The key holds the user's YAML files and their modification times, so an edited folder is read again."""
    base = _lm_eval_index(paths, _yaml_signature(paths[1:]))
    factory = getattr(base, "_factory", None)
    if factory is None or not hasattr(base, "metadata"):
        from lm_eval.tasks import TaskManager

        return TaskManager(include_path=list(paths), metadata=metadata)
    import copy

    manager = copy.copy(base)
    manager.metadata, manager._factory = metadata, type(factory)(meta=metadata)
    return manager


@functools.lru_cache(maxsize=8)
def _lm_eval_index(paths: tuple[str, ...], signature: tuple) -> "TaskManager":
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(paths))


def _yaml_signature(folders: Sequence[str]) -> tuple:
    """Each task YAML under ``folders`` with its size and modification time."""
    out = []
    for folder in map(Path, folders):
        for f in sorted(folder.rglob("*.y*ml")) if folder.is_dir() else [folder]:
            try:
                st = f.stat()
            except OSError:
                continue
            out.append((str(f), st.st_size, st.st_mtime_ns))
    return tuple(out)

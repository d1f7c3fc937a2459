"""Files written safely: atomic output folders and files, durable JSONL logs.

Use :func:`atomic_output_dir` for any command that writes a folder (exports, reports)::

    with atomic_output_dir(out, overwrite=False) as tmp:
        write_files(tmp)          # on any exception tmp is removed and ``out`` is untouched
    # here ``out`` holds exactly what was written to tmp

The temporary folder is a hidden sibling of ``out`` (same file system, so the final rename
is atomic). An existing non-empty ``out`` is refused unless ``overwrite``; with
``overwrite`` the old folder is swapped out and deleted only after the new one is in place.
Files left private (0600) by ``mkstemp``-based writers get the umask's permissions.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from capsense.errors import CapsenseError, OutputExistsError


def cache_dir() -> Path:
    """Where capsense keeps converted models and other derived files (``$CAPSENSE_CACHE``, else ``~/.cache/capsense``)."""
    return Path(os.environ.get("CAPSENSE_CACHE", Path.home() / ".cache" / "capsense"))


def check_output_dir(out: str | os.PathLike, overwrite: bool = False, inputs: Iterable[Any] = ()) -> Path:
    """Raise a clear error if ``out`` cannot be written; return it as a :class:`Path`.

    Call it before slow work so a bad destination fails fast. ``inputs``: what the run reads (model folders, heads and
    budget files; entries that are not paths of this machine are skipped). With ``overwrite`` an existing ``out`` is
    deleted once the new one is in place, so an ``out`` that is or holds one of them is refused: until round 53
    ``capsense compress ./proj/model --out ./proj --overwrite`` deleted the model it read with the folder.
    """
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise OutputExistsError(f"output path {str(p)!r} exists and is not a folder")
    if p.is_dir() and any(p.iterdir()) and not overwrite:
        raise OutputExistsError(
            f"output folder {str(p)!r} exists and is not empty: choose another folder or pass `overwrite`"
        )
    if p.is_dir() and (hit := _input_at(p, inputs, holds=True)):
        raise OutputExistsError(f"output folder {str(p)!r} holds {str(hit[0])!r}, which this run reads: "
                                "`overwrite` would delete it with the folder; choose another folder")
    return p


def _input_at(out: Path, inputs: Iterable[Any], holds: bool) -> tuple[Any, bool] | None:
    """The first of ``inputs`` (paths of this machine; others skipped) that is ``out``, or that ``out`` holds
    (``holds``: ``out`` a folder) or that holds ``out`` (``out`` a file in an input folder), and whether it is
    ``out``."""
    here = out.resolve()
    for x in inputs:
        if isinstance(x, (str, os.PathLike)) and str(x) and Path(x).exists():
            r = Path(x).resolve()
            if r == here or (here in r.parents if holds else r in here.parents):
                return x, r == here
    return None


def check_output_file(out: str | os.PathLike | None, inputs: Iterable[Any] = ()) -> None:
    """``out`` can be written as a file: not a folder, no file where its folder should be, and not a file the run reads
    (``inputs``: files, or folders whose files it reads, such as a model's; others are skipped): writing the table over
    the heads file it was computed from lost the set (``capsense evaluate M --heads run/heads.json --out
    run/heads.json`` until round 53)."""
    if out is None:
        return
    p = Path(out)
    if p.is_dir():
        raise CapsenseError(f"`out` {str(p)!r} is a folder: give a file name, e.g. {str(p / 'table.json')!r}")
    if p.is_file() and (hit := _input_at(p, inputs, holds=False)):
        raise CapsenseError(f"`out` {str(p)!r} is {'' if hit[1] else 'in '}{str(hit[0])!r}, which this run reads: "
                            "writing it would replace it; give another file")
    for parent in p.parents:
        if parent.exists() and not parent.is_dir():
            raise CapsenseError(f"`out` {str(p)!r} cannot be written: {str(parent)!r} is a file, not a folder")


def _relax_private_files(folder: Path, umask: int) -> None:
    # Writers that go through mkstemp (safetensors among them) leave 0600 files; give them
    # the permissions the umask would have given a plain open().
    for p in folder.rglob("*"):
        if p.is_file() and not p.is_symlink() and (p.stat().st_mode & 0o777) == 0o600:
            os.chmod(p, 0o666 & ~umask)


@contextmanager
def atomic_output_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder next to ``out``; rename it to ``out`` if the block succeeds.

    On failure (any exception, including ``KeyboardInterrupt``) the temporary folder is
    removed and ``out`` is left as it was.
    """
    out = check_output_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result should not be
    try:
        yield tmp
        _relax_private_files(tmp, umask)
        check_output_dir(out, overwrite)  # something may have appeared there meanwhile
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rmdir(old)
            os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            if old is not None:
                os.rename(old, out)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` via a temporary file in the same folder and a rename.

    A reader sees the old file or the new one, never a torn one. The file gets the umask's
    permissions (0644 usually), like a plain ``open()``, not mkstemp's private 0600.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    """:func:`atomic_write_text` of ``obj`` as indented JSON with a final newline."""
    return atomic_write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def append_jsonl(path: str | os.PathLike, record: Mapping[str, Any] | str) -> None:
    """Append one JSON line durably (write, flush, fsync) before returning.

    ``record`` is a mapping (serialised here) or an already serialised line.
    """
    line = record if isinstance(record, str) else json.dumps(record, default=float)
    with Path(path).open("a") as f:
        f.write(line.rstrip("\n") + "\n")
        f.flush()
        os.fsync(f.fileno())


def repair_jsonl_tail(path: str | os.PathLike) -> bool:
    """Drop a torn last line (no trailing newline, left by a killed writer); True if one was dropped."""
    p = Path(path)
    if p.is_file() and p.stat().st_size:
        data = p.read_bytes()
        if not data.endswith(b"\n"):
            p.write_bytes(data[: data.rfind(b"\n") + 1])
            return True
    return False


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a JSONL file ([] if it does not exist).

    A last line that does not parse is a write torn by a kill and is skipped (call
    :func:`repair_jsonl_tail` before appending again); a bad line elsewhere raises
    :class:`CapsenseError`.
    """
    p = Path(path)
    if not p.is_file():
        return []
    lines = p.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue
            raise CapsenseError(f"{p}:{i + 1} is not valid JSON: the file is damaged") from None
    return out

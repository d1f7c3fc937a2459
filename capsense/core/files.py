"""Atomic output folders: build next to the destination, rename into place on success.

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

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class OutputExistsError(FileExistsError):
    """The output folder exists and is not empty, and overwriting was not asked for."""


def check_output_dir(out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Raise a clear error if ``out`` cannot be written; return it as a :class:`Path`.

    Call it before slow work so a bad destination fails fast.
    """
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise OutputExistsError(f"output path {str(p)!r} exists and is not a folder")
    if p.is_dir() and any(p.iterdir()) and not overwrite:
        raise OutputExistsError(
            f"output folder {str(p)!r} exists and is not empty: choose another folder or pass --overwrite"
        )
    return p


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

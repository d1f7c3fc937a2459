"""One writer per run folder: an advisory ``flock`` on ``<run>/.capsense.lock`` (a run that writes a file, as a grid
does, locks ``.<file name>.lock`` beside it, so that two grids in one folder do not exclude each other).

Held by every resumable writer: locate's run folder, validate's conditions, a grid's JSONL file, distillation's
``.partial`` folder (grid and distillation had none until round 51: nothing stopped two of them on one output, where
both would append the same measurements, or train one state).

The kernel drops a ``flock`` when its holder's file descriptor closes, so a holder killed
with SIGKILL leaves nothing stuck: the next run takes the lock at once, without cleanup.
The lock file keeps the holder's pid and start time so that a refused run can say who
holds the folder. The processes of one ``accelerate launch`` are one run: only the main
process takes the lock (see :mod:`capsense.core.distributed`).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from capsense.errors import RunFolderBusyError

LOCK_FILE = ".capsense.lock"


class RunFolderLock:
    """Hold the one-writer lock of ``folder`` (created if missing) until :meth:`release`; ``name``: the lock file's."""

    def __init__(self, folder: str | os.PathLike, name: str = LOCK_FILE) -> None:
        self.folder = Path(folder)
        self.name = name
        self.subject = f"run folder {str(self.folder)!r}"  # what a refusal names
        self._fd: int | None = None
        self._made = False

    @classmethod
    def for_file(cls, path: str | os.PathLike) -> RunFolderLock:
        """The lock of one output file (``.<name>.lock`` beside it)."""
        path = Path(path)
        lock = cls(path.parent, f".{path.name}.lock")
        lock.subject = repr(str(path))
        return lock

    @property
    def path(self) -> Path:
        return self.folder / self.name

    def acquire(self) -> RunFolderLock:
        """Take the lock without waiting; raise :class:`RunFolderBusyError` if another process has it."""
        self._made = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunFolderBusyError(
                f"{self.subject} is being written by another capsense run ({holder(self.folder, self.name)}); "
                "wait for it to finish (rerunning the same command then resumes it), or choose another output folder"
            ) from None
        os.ftruncate(fd, 0)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.write(fd, (json.dumps(info) + "\n").encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (the file stays: removing it would race with a waiting locker). A folder the lock made that
        holds nothing else is removed, while still held: a run refused after taking it (a distillation's bad input)
        left an empty ``.partial`` folder behind."""
        if self._fd is not None:
            if self._made and self.folder.is_dir() and [p.name for p in self.folder.iterdir()] == [self.name]:
                self.path.unlink()  # (a finished distillation removed the folder itself)
                self.folder.rmdir()
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> RunFolderLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder(folder: str | os.PathLike, name: str = LOCK_FILE) -> str:
    """Who holds the lock of ``folder``, as the lock file says ("pid 123 on host since ...")."""
    try:
        info = json.loads((Path(folder) / name).read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        info = {}
    if "pid" not in info:
        return "holder unknown"
    return f"pid {info['pid']} on {info.get('host', '?')}, since {info.get('since', '?')}"

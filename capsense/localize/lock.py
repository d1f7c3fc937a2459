"""One writer per run folder: an advisory ``flock`` on ``<run>/.capsense.lock``.

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
    """Hold the one-writer lock of ``folder`` (created if missing) until :meth:`release`."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self._fd: int | None = None

    @property
    def path(self) -> Path:
        return self.folder / LOCK_FILE

    def acquire(self) -> RunFolderLock:
        """Take the lock without waiting; raise :class:`RunFolderBusyError` if another process has it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunFolderBusyError(
                f"run folder {str(self.folder)!r} is being written by another capsense run ({holder(self.folder)}); "
                "wait for it to finish (rerunning the same command then resumes it), or choose another output folder"
            ) from None
        os.ftruncate(fd, 0)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.write(fd, (json.dumps(info) + "\n").encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (the file stays: removing it would race with a waiting locker)."""
        if self._fd is not None:
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


def holder(folder: str | os.PathLike) -> str:
    """Who holds the lock of ``folder``, as the lock file says ("pid 123 on host since ...")."""
    try:
        info = json.loads((Path(folder) / LOCK_FILE).read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        info = {}
    if "pid" not in info:
        return "holder unknown"
    return f"pid {info['pid']} on {info.get('host', '?')}, since {info.get('since', '?')}"

"""One writer per run folder: a second locker is refused with the holder named; a killed holder frees it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from capsense.localize.lock import LOCK_FILE, RunFolderLock
from capsense.errors import RunFolderBusyError

HOLD = "import sys, time; from capsense.localize.lock import RunFolderLock; RunFolderLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)"


def test_second_locker_is_refused_and_named(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderBusyError, match=rf"{tmp_path}.*being written by another capsense run \(pid {proc.pid} on"):
            RunFolderLock(tmp_path).acquire()
        os.kill(proc.pid, signal.SIGKILL)  # the holder dies without any cleanup
        proc.wait()
        with RunFolderLock(tmp_path) as lock:  # free at once: the kernel dropped the flock
            assert lock.held
            assert f'"pid": {os.getpid()}' in (tmp_path / LOCK_FILE).read_text()
    finally:
        proc.kill()
        proc.wait()


def test_release_lets_the_next_run_in(tmp_path):
    first = RunFolderLock(tmp_path).acquire()
    with pytest.raises(RunFolderBusyError):
        RunFolderLock(tmp_path).acquire()  # another open file description: refused even in one process
    first.release()
    RunFolderLock(tmp_path).acquire().release()

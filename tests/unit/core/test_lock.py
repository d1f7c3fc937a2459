"""One writer per run folder: a second locker is refused with the holder named; a killed holder frees it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from capsense.core.lock import LOCK_FILE, RunFolderLock
from capsense.errors import RunFolderBusyError

HOLD = "import sys, time; from capsense.core.lock import RunFolderLock; RunFolderLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)"


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


def test_a_grid_file_and_a_distillation_have_one_writer(tmp_path, tiny_model_dir):
    """Grid and distillation resume from what their output holds, and had no lock: two grids on one file appended the
    same measurements twice, two distillations trained one state. The second is refused before its model loads,
    naming the first; two grid files in one folder do not exclude each other."""
    from click.testing import CliRunner

    from capsense.cli import main
    from capsense.compress.distill import DistillConfig, run_distill

    grid = tmp_path / "g.jsonl"
    with RunFolderLock.for_file(grid) as lock:
        assert lock.path == tmp_path / ".g.jsonl.lock"
        r = CliRunner().invoke(main, ["grid", str(tiny_model_dir), "--methods", "magnitude", "--densities", "0.5",
                                      "--capabilities", "qa", "--probes", "2", "--out", str(grid)])
        assert r.exit_code == 1 and f"'{grid}' is being written by another capsense run (pid {os.getpid()}" in r.output
        assert not grid.exists()
        RunFolderLock.for_file(tmp_path / "other.jsonl").acquire().release()  # another file of the folder: free
    out = tmp_path / "student-kd"
    cfg = DistillConfig(student="no-such-student", teacher="no-such-teacher", sources="prose", n_texts=2)
    with RunFolderLock(tmp_path / "student-kd.partial"):
        with pytest.raises(RunFolderBusyError, match="student-kd.partial' is being written by another capsense run"):
            run_distill(cfg, out, None, progress=False)
    assert not (tmp_path / "student-kd.partial").exists()  # a folder the lock made, holding nothing else, goes with it
    (tmp_path / "kept").mkdir()
    RunFolderLock(tmp_path / "kept").acquire().release()  # a folder that was there stays
    assert (tmp_path / "kept" / LOCK_FILE).is_file()

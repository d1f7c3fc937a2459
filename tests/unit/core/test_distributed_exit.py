"""A process group that capsense joined is destroyed at exit, before interpreter shutdown."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

SNIPPET = """
import atexit, os, pathlib, sys
import torch.distributed as dist
out = pathlib.Path(sys.argv[1]) / ("rank" + os.environ["RANK"])  # one file per process: their stdout interleaves
seen = {}
atexit.register(lambda: out.write_text(f"world {seen['world']}, joined at exit: {dist.is_initialized()}"))  # after capsense's
from capsense.core.distributed import context
seen["world"] = context().world
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_leave_the_group_before_exit(tmp_path):
    script = tmp_path / "join.py"
    script.write_text(SNIPPET)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CAPSENSE_DIST_BACKEND": "gloo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(_free_port()), str(script), str(tmp_path)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [(tmp_path / f"rank{i}").read_text() for i in range(2)] == ["world 2, joined at exit: False"] * 2


FINISH = """
import atexit, os, pathlib, sys
out = pathlib.Path(sys.argv[1])
atexit.register(lambda: (out / ("atexit" + os.environ["RANK"])).write_text("ran"))
from capsense.core.distributed import context, finish
ctx = context()
sys.stdout.write(f"rank {ctx.rank} done")  # no newline, no flush: finish must flush it
finish(int(sys.argv[2]))
(out / ("after" + os.environ["RANK"])).write_text("finish returned")
"""


def _run_finish(tmp_path, code: int) -> subprocess.CompletedProcess:
    script = tmp_path / "finish.py"
    script.write_text(FINISH)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CAPSENSE_DIST_BACKEND": "gloo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(_free_port()), str(script), str(tmp_path), str(code)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_finish_ends_each_process_with_its_output_and_without_interpreter_shutdown(tmp_path):
    r = _run_finish(tmp_path, 0)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "rank 0 done" in r.stdout and "rank 1 done" in r.stdout
    # os._exit: neither the code after finish nor any atexit handler (nor native teardown) ran
    assert sorted(p.name for p in tmp_path.iterdir()) == ["finish.py"]


def test_finish_passes_a_failure_on_to_the_launcher(tmp_path):
    r = _run_finish(tmp_path, 3)
    assert r.returncode != 0
    assert "exitcode  : 3" in r.stderr
    assert not list(tmp_path.glob("after*"))


def test_finish_returns_in_a_single_process(tmp_path):
    script = tmp_path / "single.py"
    script.write_text(FINISH)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")} | {"RANK": "0"}
    r = subprocess.run([sys.executable, str(script), str(tmp_path), "0"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "after0").read_text() == "finish returned" and (tmp_path / "atexit0").read_text() == "ran"

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

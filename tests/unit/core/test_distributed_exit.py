"""A process group that capsense joined is destroyed at exit, before interpreter shutdown."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

SNIPPET = """
import atexit
import torch.distributed as dist
atexit.register(lambda: print("joined at exit:", dist.is_initialized(), flush=True))  # runs after capsense's
from capsense.core.distributed import context
ctx = context()
print("world", ctx.world, flush=True)
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
           "--master_port", str(_free_port()), str(script)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("world 2") == 2
    assert r.stdout.count("joined at exit: False") == 2, r.stdout

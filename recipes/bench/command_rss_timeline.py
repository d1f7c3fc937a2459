"""Peak resident memory of a command by phase: runs it, samples its VmRSS every 0.5 s, and splits the samples at
the log lines that start each phase (a guided ``capsense compress``: calibration, the Fisher, pricing, the candidates,
writing). What round 20 compared with the guided memory check's count (recipes/results/RESULTS-compress.md)::

    PYTHONPATH=. OMP_NUM_THREADS=1 python recipes/bench/command_rss_timeline.py OUT.jsonl -- \\
        python -m capsense compress smollm2-135m --method gptq --bits 4 --group-size 64 --keep math \\
        --calibration-samples 16 --out DIR

Linux only (/proc). Writes one JSON line per sample (seconds, RSS bytes, phase) and prints each phase's peak and the
command's VmHWM (the kernel's peak, what ``/usr/bin/time`` reports)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

#: A line starting with one of these starts the phase named (the guided run's log, capsense.compress.pipeline).
PHASES = (("calibrating", "calibration"), ("sensitivity:", "Fisher"), ("pricing", "pricing"),
          ("measuring", "probes"), ("compressing with", "candidates"), ("gptq@", "writing"), ("Wrote", "writing"))


def _status(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(key)), None)
    except OSError:
        return None


def main(out: str, command: list[str]) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    t0, phase, samples, hwm = time.time(), ["loading"], [], [0]

    def sample() -> None:
        while proc.poll() is None:
            rss = _status(proc.pid, "VmRSS")
            hwm[0] = max(hwm[0], _status(proc.pid, "VmHWM") or 0)
            if rss:
                samples.append((round(time.time() - t0, 1), rss, phase[0]))
            time.sleep(0.5)

    threading.Thread(target=sample, daemon=True).start()
    for line in proc.stdout:
        print(f"[{time.time() - t0:7.1f}s] {line}", end="", flush=True)
        phase[0] = next((name for start, name in PHASES if line.startswith(start)), phase[0])
    proc.wait()
    with open(out, "w") as f:
        for s, rss, p in samples:
            f.write(json.dumps({"s": s, "rss": rss, "phase": p}) + "\n")
    peaks: dict[str, tuple[int, float]] = {}
    for s, rss, p in samples:
        if rss > peaks.get(p, (0, 0.0))[0]:
            peaks[p] = (rss, s)
    for p, (rss, s) in peaks.items():
        print(f"{p}: peak RSS {rss / 2**30:.3f} GiB at {s:.0f} s")
    print(f"VmHWM {hwm[0] / 2**30:.3f} GiB ({hwm[0] // 1024} kB); exit {proc.returncode}; {time.time() - t0:.0f} s")
    sys.exit(proc.returncode)


if __name__ == "__main__":
    sep = sys.argv.index("--")
    main(sys.argv[1], sys.argv[sep + 1:])

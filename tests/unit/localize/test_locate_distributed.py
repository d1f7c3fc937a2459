"""Several processes on one run folder (CPU, gloo, the real ``accelerate launch``): the same results
as one process, resume after a kill with another number of processes, one writer per folder."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from capsense.cli import main
from _toy_task import TOY_CONTROL, TOY_MC, TOY_TASK, make_toy_setup

MASKS = 150  # enough that a run is still going when the test kills it
ACCELERATE = Path(sys.executable).parent / "accelerate"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.skipif(not ACCELERATE.is_file(), reason="accelerate's launcher is not installed")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_setup(tmp_path_factory.mktemp("toy"))


def _args(toy, out, masks=MASKS):
    model, tasks = toy
    return ["locate", str(model), "--task", TOY_TASK, "--controls", TOY_CONTROL, "--include-path", str(tasks),
            "--limit", "40", "--method", "cs", "--heads-per-mask", "2", "--masks", str(masks), "--no-progress", "--out", str(out)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(n: int, args: list[str]) -> list[str]:
    """``accelerate launch`` of ``n`` CPU processes (``--multi_gpu`` is what makes accelerate start several)."""
    return [str(ACCELERATE), "launch", "--multi_gpu", "--num_processes", str(n), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
            "-m", "capsense", *args]


def _single(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "capsense", *args]


def _evaluations(run: Path) -> list[tuple]:
    lines = [json.loads(x) for x in (run / "evaluations.jsonl").read_text().splitlines()]
    return [(e["i"], e["round"], e["heads"], e["scores"]) for e in lines]


def _wait_lines(path: Path, n: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if path.is_file() and path.read_text().count("\n") >= n:
            return
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before the test could act: raise MASKS"


@pytest.fixture(scope="module")
def reference(toy, tmp_path_factory):
    """One process, the same seed and settings: what every other run must reproduce."""
    out = tmp_path_factory.mktemp("ref") / "run"
    subprocess.run(_single(_args(toy, out)), env=ENV, check=True, capture_output=True)
    return out


def test_two_processes_give_the_same_run_as_one(toy, reference, tmp_path):
    out = tmp_path / "two"
    r = subprocess.run(_launch(2, _args(toy, out)), env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _evaluations(out) == _evaluations(reference)  # same masks, same order, scores equal to the bit
    assert json.loads((out / "heads.json").read_text()) == json.loads((reference / "heads.json").read_text())
    assert not list(out.glob("evaluations.rank*"))  # shards merged into evaluations.jsonl
    assert json.loads((out / "manifest.json").read_text())["timing"]["processes"] == 2
    assert r.stdout.count("top heads:") == 1  # the main process reports, once


def _guided_args(toy, out):
    model, tasks = toy
    return ["locate", str(model), "--task", TOY_TASK, "--controls", TOY_CONTROL, "--include-path", str(tasks),
            "--limit", "40", "--batch-size", "8", "--method", "prior-guided", "--top-m", "4", "--no-progress", "--out", str(out)]


def test_attribution_split_across_two_processes_equals_one(toy, tmp_path):
    """The gradient attribution's batches (5 per task here) split over 2 processes: the same
    attribution.json to the byte, the same knockouts and heads.json; a rerun reuses the file."""
    one, two = tmp_path / "one", tmp_path / "two"
    subprocess.run(_single(_guided_args(toy, one)), env=ENV, check=True, capture_output=True)
    r = subprocess.run(_launch(2, _guided_args(toy, two)), env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    att_one, att_two = (json.loads((d / "attribution.json").read_text()) for d in (one, two))
    # one process runs no second clean forward (the attribution's stands in); two processes each see only
    # their share of its batches, so theirs runs: the one difference, and it is exactly the cost
    assert (att_one.pop("clean_forward_folded"), att_two.pop("clean_forward_folded")) == (1.0, 0.0)
    assert att_two == att_one
    assert _evaluations(two) == _evaluations(one)  # the clean scores too, to the bit
    heads_one, heads_two = (json.loads((d / "heads.json").read_text()) for d in (one, two))
    fe_one, fe_two = heads_one.pop("forward_equivalents"), heads_two.pop("forward_equivalents")
    assert heads_two == heads_one and fe_two == pytest.approx(fe_one + 1)
    manifest = json.loads((two / "manifest.json").read_text())
    assert manifest["forward_equivalents"] == fe_two
    stamp = (two / "attribution.json").stat().st_mtime_ns
    r = subprocess.run(_single(_guided_args(toy, two)), env=ENV, capture_output=True, text=True)  # resume, 1 process
    assert r.returncode == 0 and "masks already evaluated" in r.stderr, r.stderr[-3000:]
    assert (two / "attribution.json").stat().st_mtime_ns == stamp  # read back, not computed again


def test_multiple_choice_prefix_reuse_split_across_two_processes_equals_one(toy, tmp_path):
    """A multiple-choice control replays its knockouts from their first layer in each process
    (each holds its own clean record): two processes give one process's evaluations to the bit."""
    model, tasks = toy
    args = ["locate", str(model), "--task", TOY_TASK, "--controls", f"{TOY_CONTROL},{TOY_MC}", "--include-path",
            str(tasks), "--limit", "16", "--method", "cs", "--heads-per-mask", "2", "--masks", "8", "--no-progress"]
    one, two = tmp_path / "one", tmp_path / "two"
    subprocess.run(_single([*args, "--out", str(one)]), env=ENV, check=True, capture_output=True)
    r = subprocess.run(_launch(2, [*args, "--out", str(two)]), env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _evaluations(two) == _evaluations(one)
    for run in (one, two):  # both probe kinds reused their prefix
        assert json.loads((run / "manifest.json").read_text())["cost_model"]["reuse_share"] == 1.0


def _rank_pid(launcher: psutil.Process, rank: int) -> int:
    for child in launcher.children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank):
                return child.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise AssertionError(f"no process of rank {rank} under the launcher")


def test_kill_one_process_then_resume_with_one(toy, reference, tmp_path):
    out = tmp_path / "killed"
    proc = subprocess.Popen(_launch(2, _args(toy, out)), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_lines(out / "evaluations.rank1.jsonl", 5, proc)
        os.kill(_rank_pid(psutil.Process(proc.pid), 1), signal.SIGKILL)
        assert proc.wait(timeout=120) != 0  # the launcher takes the other process down too
    finally:
        proc.kill()
    assert not (out / "heads.json").exists()
    assert (out / "evaluations.rank1.jsonl").read_text().count("\n") >= 5  # rank 1's share survived in its shard
    r = subprocess.run(_single(_args(toy, out)), env=ENV, capture_output=True, text=True)  # 1 process now
    assert r.returncode == 0, r.stderr[-3000:]
    assert "masks already evaluated" in r.stderr
    evals = _evaluations(out)
    assert [e[0] for e in evals] == list(range(len(evals)))  # nothing lost, nothing twice
    assert evals == _evaluations(reference)
    assert json.loads((out / "heads.json").read_text()) == json.loads((reference / "heads.json").read_text())
    assert not list(out.glob("evaluations.rank*"))


def test_a_second_run_on_a_busy_folder_is_refused(toy, reference, tmp_path):
    out = tmp_path / "busy"
    first = subprocess.Popen(_single(_args(toy, out)), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_lines(out / "evaluations.jsonl", 5, first)
        second = subprocess.run(_single(_args(toy, out)), env=ENV, capture_output=True, text=True)
        assert second.returncode != 0
        assert f"run folder {str(out)!r} is being written by another capsense run (pid {first.pid} on" in second.stderr
        assert "Traceback" not in second.stderr
        _, err = first.communicate(timeout=300)
        assert first.returncode == 0, err[-3000:]
    finally:
        first.kill()
    assert _evaluations(out) == _evaluations(reference)  # complete, nothing written twice


def test_rerun_after_sigkill_of_the_holder_resumes(toy, reference, tmp_path):
    out = tmp_path / "holder"
    proc = subprocess.Popen(_single(_args(toy, out)), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_lines(out / "evaluations.jsonl", 5, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (out / ".capsense.lock").is_file()  # left behind, and it must not matter
    r = subprocess.run(_single(_args(toy, out)), env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "masks already evaluated" in r.stderr
    assert _evaluations(out) == _evaluations(reference)


@pytest.mark.parametrize("extra, message", [
    (["--device-map", '{"": "cuda:3"}'], "device 'cuda:3' does not exist on this machine: available devices are cpu"),
    (["--device", "cuda:1"], "device 'cuda:1' does not exist on this machine"),
    (["--device-map", "{bad"], "device_map is not valid JSON"),
])
def test_bad_device_is_one_message_and_writes_nothing(toy, tmp_path, extra, message):
    out = tmp_path / "run"
    r = CliRunner().invoke(main, [*_args(toy, out, 4), *extra])
    assert r.exit_code != 0 and message in r.output and "Traceback" not in r.output
    assert not out.exists()


def test_more_processes_than_masks_is_one_message_and_writes_nothing(toy, tmp_path):
    out = tmp_path / "run"
    r = subprocess.run(_launch(3, _args(toy, out, 2)), env=ENV, capture_output=True, text=True)
    assert r.returncode != 0
    assert r.stderr.count("3 processes for 2 masks: at most one process per mask can have work") == 1
    assert "capsense/localize" not in r.stderr  # no traceback of ours (the launcher prints its own)
    assert not out.exists()

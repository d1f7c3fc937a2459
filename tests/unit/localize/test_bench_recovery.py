"""recipes/bench/bench_locate_recovery.py and record_sweeps.py on a tiny model: the model is a
parameter (layout from the run manifest), a finished sweep is recorded, and the analysis reruns
from the recorded sweep once the sweep folder is gone."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import load_bench_script

TASK = "capsense_induction"


def test_recovery_bench_runs_any_model_and_reuses_the_recorded_sweep(tiny_model_dir, tmp_path):
    bench = load_bench_script("bench_locate_recovery")
    common = ["--model", str(tiny_model_dir), "--root", str(tmp_path / "runs"), "--tasks", TASK, "--budget", "8",
              "--top-m", "4", "--group-size", "4", "--cs-masks", "12", "--sweeps-json", str(tmp_path / "sweeps.json"),
              "--results", str(tmp_path / "recovery")]
    bench.main(common)
    sweeps = json.loads((tmp_path / "sweeps.json").read_text())[TASK]
    assert (sweeps["n_layers"], sweeps["n_heads"]) == (3, 4) and len(sweeps["effects"]) == 12
    assert sweeps["model"] == str(tiny_model_dir) and sweeps["dtype"] == "float32"
    res = json.loads((tmp_path / "recovery.json").read_text())
    assert [r["task"] for r in res] == [TASK] and res[0]["n_heads"] == 12
    r = res[0]
    assert r["exhaustive_fe"] == round(sweeps["forward_equivalents"], 1)
    assert [h["head"] for h in r["exhaustive_top5"]] == sweeps["top5"]
    assert r["prior_guided"]["curve"] and r["cs"]["curve"][0]["masks"] == 10  # the first cs checkpoint
    assert all(h.startswith("L") and int(h[1:].split("H")[0]) < 3 for h in r["attribution"]["top5"])
    table = (tmp_path / "recovery.md").read_text()
    assert "prior <= 10 FE" in table and "FE to 5/5 (prior)" in table and TASK in table

    # the sweep folder gone: the analysis uses the recorded effects and gives the same result
    shutil.rmtree(tmp_path / "runs" / f"sweep-{TASK}")
    bench.main([*common, "--stages", "none"])
    again = json.loads((tmp_path / "recovery.json").read_text())[0]
    assert again["exhaustive_top5"] == r["exhaustive_top5"] and again["exhaustive_fe"] == r["exhaustive_fe"]
    assert again["prior_guided"]["curve"] == r["prior_guided"]["curve"] and again["attribution"] == r["attribution"]


def test_bad_stage_and_task_are_named(capsys):
    bench = load_bench_script("bench_locate_recovery")
    for argv, word in ((["--stages", "sweep,fit"], "fit"), (["--tasks", "capsense_prose"], "capsense_prose")):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert word in capsys.readouterr().err


def test_result_files_are_named_for_the_model():
    bench = load_bench_script("bench_locate_recovery")
    assert bench.parse_args(["--model", "gemma3-270m"]).results.endswith("locate_recovery_gemma3")
    assert bench.parse_args([]).results.endswith("locate_recovery")  # SmolLM2's table predates the parameter
    assert bench.parse_args(["--model", "gemma3-270m"]).sweeps_json.name == "locate_gemma3_sweeps.json"
    mean = bench.parse_args(["--ablation", "mean"])  # a mean-ablated table beside the zero one, never over it
    assert mean.results.endswith("locate_recovery_mean") and mean.sweeps_json.name == "locate_smollm2_sweeps_mean.json"
    assert mean.root == "runs/bench-recovery-smollm2-mean"


def test_search_settings_default_to_the_library_defaults():
    """The recovery table measures the shipped search: the bench's defaults are prior-guided's own
    (they had stayed at round 5's top-m 24 / group 8 after the library moved to 32 / 16)."""
    from capsense.localize.prior import DEFAULT_BUDGET, DEFAULT_GROUP_SIZE, DEFAULT_TOP_M

    args = load_bench_script("bench_locate_recovery").parse_args(["--model", "gemma3-270m"])
    assert (args.top_m, args.group_size, args.budget) == (DEFAULT_TOP_M, DEFAULT_GROUP_SIZE, DEFAULT_BUDGET)
    assert load_bench_script("bench_locate_recovery").parse_args(["--top-m", "8"]).top_m == 8

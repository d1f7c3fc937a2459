"""recipes/bench/bench_bf16_rankings.py --against: the singles two run folders of different precisions share."""

from __future__ import annotations

import json

import pytest

from conftest import load_bench_script


def _run(folder, dtype, effects, pool_single=None, autocast=None):
    """A run folder with a clean evaluation and one single knockout per head: ``effects`` is head -> (target nll,
    control nll), against a clean 2.0 and 1.0; ``pool_single`` a single measure-and-choose made (round -2)."""
    folder.mkdir()
    lines = [{"i": 0, "round": 0, "heads": [], "scores": {"t": {"nll": 2.0}, "c": {"nll": 1.0}}}]
    for i, (head, (t, c)) in enumerate(effects.items(), start=1):
        lines.append({"i": i, "round": 0, "heads": [head], "scores": {"t": {"nll": t}, "c": {"nll": c}}})
    if pool_single:
        lines.append({"i": len(lines), "round": -2, "heads": [pool_single], "scores": {"t": {"nll": 9.0}, "c": {"nll": 9.0}}})
    (folder / "evaluations.jsonl").write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    manifest = {"task": "t", "layout": {"n_layers": 2, "n_heads": 2}, "args": {"dtype_resolved": dtype, "autocast": autocast}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    refine = {"heads": ["L0H0"], "n_evaluations": 1 if dtype == "float32" else 3, "start": {"heads": ["L0H1"]}}
    (folder / "heads.json").write_text(json.dumps({"forward_equivalents": 4.5, "refine": refine, "heads": []}))
    return folder


def test_singles_of_two_precisions_are_compared_per_task_and_pool_singles_left_out(tmp_path):
    mod = load_bench_script("bench_bf16_rankings")
    bf16 = _run(tmp_path / "bf16", "bfloat16", {"L0H0": (3.0, 1.02), "L0H1": (2.2, 1.05)}, pool_single="L1H0")
    fp32 = _run(tmp_path / "fp32", "float32", {"L0H0": (3.1, 1.0), "L1H1": (2.0, 1.0), "L0H1": (2.2, 1.01)},
                pool_single="L1H0")
    result = mod.compare_singles(bf16, fp32)
    rows = {r["task"]: r for r in result["tasks"]}
    assert rows["t"]["heads"] == rows["c"]["heads"] == 2  # L0H0 and L0H1; L1H0 (a pool single) and L1H1 are not shared
    assert rows["t"]["max_abs_delta_pp"] == pytest.approx(5.0) and rows["t"]["worst_head"] == "L0H0"
    assert rows["c"]["mean_abs_delta_pp"] == pytest.approx(3.0) and rows["c"]["worst_head"] == "L0H1"
    assert [r["dtype"] for r in result["runs"]] == ["bfloat16", "float32"] and result["runs"][0]["sets_measured"] == 3
    text = mod._write_singles(result, tmp_path / "out")
    assert "| bf16 | bfloat16 | 4.5 | L0H1 | 3 | L0H0 |" in text and (tmp_path / "out.json").is_file()


def test_a_sweeps_effects_are_its_singles_on_the_target(tmp_path):
    mod = load_bench_script("bench_bf16_rankings")
    run = _run(tmp_path / "fp32", "float32", {"L0H0": (3.1, 1.0), "L0H1": (2.2, 1.01)}, pool_single="L1H0")
    task, nll, effects = mod.sweep_effects(run)
    assert (task, nll) == ("t", 2.0) and effects == pytest.approx({"L0H0": 0.55, "L0H1": 0.1})


def test_a_run_under_autocast_is_named_by_its_weights_and_its_products(tmp_path):
    mod = load_bench_script("bench_bf16_rankings")
    mixed = _run(tmp_path / "ac", "float32", {"L0H0": (3.0, 1.0)}, autocast="bfloat16")
    assert mod.run_summary(mixed)["dtype"] == "float32 weights with bfloat16 autocast"

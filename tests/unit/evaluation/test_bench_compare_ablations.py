"""recipes/bench/compare_ablations.py: the same target validated under zero and mean ablation, one table."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import pytest
from conftest import load_bench_script

from capsense.evaluation.selectivity import judge
from capsense.evaluation.validate import ValidationRow


def _row(task, base, ablated, randoms, metric="acc"):
    rel = [(v - base) / base for v in randoms]
    return ValidationRow(task, metric, base, ablated, ablated - base, (ablated - base) / base, None, None,
                         sum(rel) / len(rel), None, list(randoms), metric == "acc")


def _record(path, rows, heads, ablation=None):
    samples = {r.task: list(range(40)) for r in rows}
    rec = {"rows": [asdict(r) for r in rows], "samples": samples, "heads": heads,
           "verdict": judge(rows, "t", [], 0.10, {t: 40 for t in samples})}
    if ablation:
        rec["ablation"] = ablation
    path.write_text(json.dumps(rec))


def test_one_row_per_ablation_with_target_worst_row_and_verdict(tmp_path, capsys):
    mod = load_bench_script("compare_ablations")
    _record(tmp_path / "zero.json", [_row("t", 0.80, 0.10, [0.80, 0.78, 0.80]), _row("letters", 0.95, 0.30, [0.9, 0.9, 0.9])],
            "L1H0+L2H3")  # a record from before the setting: zero
    _record(tmp_path / "mean.json", [_row("t", 0.80, 0.40, [0.80, 0.80, 0.80]), _row("letters", 0.95, 0.95, [0.95] * 3)],
            "L1H0+L4H1", ablation="mean")
    md = tmp_path / "out.md"
    argv, sys.argv = sys.argv, ["compare", f"toy={tmp_path / 'zero.json'},{tmp_path / 'mean.json'}", "--md", str(md)]
    try:
        mod.main()
    finally:
        sys.argv = argv
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert len(lines) == 4 and md.read_text() == out
    zero, mean = lines[2], lines[3]
    assert zero.startswith("| toy | zero | L1H0, L2H3 | acc 0.800 -> 0.100 (-87.5%) (-0.8%) |")
    assert "| letters acc +68.4% worse (held-out, net 26 of 40, z 6.0) | NOT selective: 1 off-target row(s) beyond" in zero
    assert mean.startswith("|  | mean | L1H0, L4H1 | acc 0.800 -> 0.400 (-50.0%) (+0.0%) |")
    assert "| selective" in mean and "NOT" not in mean


def test_a_pair_that_is_not_two_files_is_refused(tmp_path):
    mod = load_bench_script("compare_ablations")
    with pytest.raises(SystemExit, match="a pair is LABEL=ZERO.json,MEAN.json"):
        mod.parse_pair("toy=only_one.json")
    with pytest.raises(SystemExit, match="no such validation record"):
        mod.parse_pair(f"toy={tmp_path / 'a.json'},{tmp_path / 'b.json'}")

"""recipes/bench/rejudge_validations.py: recorded validations judged again with today's rule."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from conftest import load_bench_script

from capsense.evaluation.selectivity import judge
from capsense.evaluation.validate import ValidationRow


def _row(task, base, ablated, randoms):
    return ValidationRow(task, "acc", base, ablated, ablated - base, None, None, None, None, None, list(randoms), None)


def test_a_row_that_fails_now_is_named_with_its_documents(tmp_path, capsys):
    mod = load_bench_script("rejudge_validations")
    rows = [_row("t", 0.70, 0.05, [0.70, 0.68, 0.69]), _row("letters", 0.95, 0.325, [0.10, 0.10, 0.30]),
            _row("dates", 0.36, 0.32, [0.36, 0.32, 0.40])]
    samples = {"t": list(range(40)), "letters": list(range(40)), "dates": 25}  # document ids, or a count
    recorded = judge(rows, "t", ["dates"], 0.10)  # as a release without document counts judged it: selective
    assert recorded["selective"]
    (tmp_path / "validation.json").write_text(json.dumps(
        {"rows": [asdict(r) for r in rows], "samples": samples, "verdict": recorded, "locate_task": "t"}))
    before = judge(rows[:1] + rows[2:], "t", ["dates"], 0.10)
    for r in before["rows"]:
        del r["fails"]  # as recorded before round 32: the rule of that time decides
    pair = {"rows": [asdict(r) for r in rows[:1] + rows[2:]], "samples": samples, "verdict": before}
    (tmp_path / "selectivity_x.json").write_text(json.dumps({"run": "r", "new": pair}))
    md = tmp_path / "out.md"
    argv, sys.argv = sys.argv, ["rejudge", str(tmp_path / "validation.json"), str(tmp_path / "selectivity_x.json"),
                                "--md", str(md)]
    try:
        mod.main()
    finally:
        sys.argv = argv
    out = capsys.readouterr().out
    assert out == md.read_text()
    assert ("| validation | selective | NOT selective | letters acc +65.8% (net 25 of 40, z 5.8) now fails |"
            in out)
    assert "| selectivity_x (new) | selective | selective | none |" in out  # dates: one document, noise

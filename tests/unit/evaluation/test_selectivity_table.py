"""recipes/bench/selectivity_table.py without --old: the chosen set's table from the recipe's own
validation (nothing re-validated, so no model is loaded)."""

from __future__ import annotations

import json
import sys

from conftest import load_bench_script


def _row(task, metric, base, ablated, rnd):
    return {"task": task, "metric": metric, "base": base, "ablated": ablated,
            "change_rel": (ablated - base) / base, "random_change_rel_mean": rnd}


def test_chosen_set_alone_comes_from_the_recipes_validation(tmp_path, monkeypatch):
    run = tmp_path / "run"
    (run / "locate").mkdir(parents=True)
    (run / "validate").mkdir()
    heads = [{"layer": 1, "head": h, "importance": 1.0 - h / 10} for h in range(5)]
    (run / "locate" / "heads.json").write_text(json.dumps(
        {"model": "gemma3-270m", "task": "capsense_sequence", "controls": ["capsense_facts"], "heads": heads}))
    (run / "locate" / "manifest.json").write_text("{}")
    rows = [_row("capsense_sequence", "acc", 0.8, 0.4, 0.01), _row("capsense_facts", "acc", 0.5, 0.5, -0.1),
            _row("capsense_qa", "nats_per_token", 1.0, 1.05, 0.2)]
    (run / "validate" / "validation.json").write_text(json.dumps({
        "heads": "L1H0+L1H1+L1H2+L1H3+L1H4", "rows": rows, "verdict": {"line": "selective: a verdict line"},
        "random_sets": ["a", "b", "c"], "samples": {"capsense_sequence": [0] * 40, "capsense_facts": [0] * 39}}))
    out = tmp_path / "table.md"
    monkeypatch.setattr(sys, "argv", ["selectivity_table.py", "--run", str(run), "--out", str(out)])
    mod = load_bench_script("selectivity_table")
    mod.validate = lambda *a, **k: (_ for _ in ()).throw(AssertionError("must not re-validate"))
    mod.main()
    text = out.read_text()
    assert "- new (chosen by this run): L1H0+L1H1+L1H2+L1H3+L1H4" in text and "- old: none compared" in text
    assert "| capsense_sequence | target | acc | 0.8000 | 0.4000 | -50.0% | +1.0% |" in text
    assert "| capsense_qa | held out | nats_per_token |" in text and "**Old:**" not in text
    assert "**New:** selective: a verdict line." in text
    assert json.loads(out.with_suffix(".json").read_text())["new"]["from"].endswith("validation.json")

"""recipes/bench/compare_single_controls.py: a run with a single's controls until excluded against one with all."""

from __future__ import annotations

import json

import pytest

from conftest import load_bench_script


def _run(folder, records, chosen, excluded, fe):
    """A run folder whose evaluations.jsonl holds ``records`` (round, heads, scores) in order."""
    folder.mkdir()
    lines = [{"i": i, "round": r, "heads": heads, "scores": scores} for i, (r, heads, scores) in enumerate(records)]
    (folder / "evaluations.jsonl").write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    timing = {"load_s": 1.0, "evaluate_s_this_attempt": fe, "attribution_s": 0.5, "search_s": 2.0, "refine_s": 0.1,
              "checks_s": 0.0}
    (folder / "manifest.json").write_text(json.dumps({"task": "t", "layout": {"n_layers": 2, "n_heads": 2},
                                                      "forward_equivalents": fe, "timing": timing}))
    refine = {"heads": chosen, "n_evaluations": 1, "chosen": {"target_damage": 1.0, "control_damage": {"a": 0.01, "b": -0.02}}}
    screen = {"excluded": [{"head": h, "control": "b", "damage": 0.5} for h in excluded]}
    (folder / "heads.json").write_text(json.dumps({"task": "t", "refine": refine, "screen": screen, "heads": []}))
    return folder


def _s(**nll):
    return {t: {"nll": v, "acc": 0.0} for t, v in nll.items()}


def test_pairs_are_compared_on_cost_choice_screen_and_the_probe_scores_both_made(tmp_path):
    mod = load_bench_script("compare_single_controls")
    clean = (0, [], _s(t=2.0, a=1.0, b=1.0))
    new = _run(tmp_path / "new", [clean, (0, ["L0H0"], _s(t=3.0)), (0, ["L0H1"], _s(t=2.5)),  # targets, then b, then a
                                  (0, ["L0H0"], _s(b=1.5)), (0, ["L0H1"], _s(b=1.0)), (0, ["L0H1"], _s(a=1.1))],
               ["L0H1"], ["L0H0"], 3.0)
    old = _run(tmp_path / "all", [clean, (0, ["L0H0"], _s(t=3.0, a=1.2, b=1.5)), (0, ["L0H1"], _s(t=2.5, a=1.0, b=1.0))],
               ["L0H1"], ["L0H0"], 4.0)
    row = mod.compare(new, old)
    assert row["same_chosen_set"] and row["same_excluded"]
    # L0H0: t, b equal, a not scored; L0H1: t, b equal, a differs (1.1 against 1.0)
    assert row["probes"] == {"equal": 4, "differ": 1, "not_scored": 1}
    assert (row["until_excluded"]["forward_equivalents"], row["all"]["forward_equivalents"]) == (3.0, 4.0)
    assert row["until_excluded"]["chosen_worst_control"] == pytest.approx(0.01)
    md = mod.table([row])
    assert "same set: yes; same set aside: yes; probe scores equal 4, differ 1, not scored 1" in md


def test_folders_of_different_tasks_are_refused(tmp_path):
    mod = load_bench_script("compare_single_controls")
    a = _run(tmp_path / "a", [(0, [], _s(t=1.0))], [], [], 1.0)
    b = _run(tmp_path / "b", [(0, [], _s(t=1.0))], [], [], 1.0)
    data = json.loads((b / "heads.json").read_text())
    (b / "heads.json").write_text(json.dumps({**data, "task": "u"}))
    with pytest.raises(SystemExit, match="different tasks"):
        mod.compare(a, b)

"""recipes/bench/compare_control_stops.py: a run that stopped a knockout's controls early against one with all."""

from __future__ import annotations

import json

import pytest

from conftest import load_bench_script


def _run(folder, records, chosen, excluded, fe, args=None, measured=()):
    """A run folder whose evaluations.jsonl holds ``records`` (round, heads, scores) in order."""
    folder.mkdir()
    lines = [{"i": i, "round": r, "heads": heads, "scores": scores} for i, (r, heads, scores) in enumerate(records)]
    (folder / "evaluations.jsonl").write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    timing = {"load_s": 1.0, "evaluate_s_this_attempt": fe, "attribution_s": 0.5, "search_s": 2.0, "refine_s": 0.1,
              "checks_s": 0.0}
    (folder / "manifest.json").write_text(json.dumps({"task": "t", "layout": {"n_layers": 2, "n_heads": 2},
                                                      "forward_equivalents": fe, "timing": timing, "args": args or {}}))
    refine = {"heads": chosen, "n_evaluations": 1, "chosen": {"target_damage": 1.0, "control_damage": {"a": 0.01, "b": -0.02}},
              "measured": list(measured), "choice_settled_at": 1}
    screen = {"excluded": [{"head": h, "control": "b", "damage": 0.5} for h in excluded]}
    (folder / "heads.json").write_text(json.dumps({"task": "t", "refine": refine, "screen": screen, "heads": []}))
    return folder


def _s(**nll):
    return {t: {"nll": v, "acc": 0.0} for t, v in nll.items()}


def test_pairs_are_compared_on_cost_choice_screen_and_the_probe_scores_both_made(tmp_path):
    mod = load_bench_script("compare_control_stops")
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
    assert (row["early"]["forward_equivalents"], row["all"]["forward_equivalents"]) == (3.0, 4.0)
    assert row["early"]["chosen_worst_control"] == pytest.approx(0.01)
    md = mod.table([row])
    assert "same set: yes; same set aside: yes; probe scores equal 4, differ 1, not scored 1" in md


def test_folders_of_different_tasks_are_refused(tmp_path):
    mod = load_bench_script("compare_control_stops")
    a = _run(tmp_path / "a", [(0, [], _s(t=1.0))], [], [], 1.0)
    b = _run(tmp_path / "b", [(0, [], _s(t=1.0))], [], [], 1.0)
    data = json.loads((b / "heads.json").read_text())
    (b / "heads.json").write_text(json.dumps({**data, "task": "u"}))
    with pytest.raises(SystemExit, match="different tasks"):
        mod.compare(a, b)


def test_sets_scored_until_beyond_are_compared_where_both_runs_measured_them(tmp_path):
    """A measure-and-choose set both runs measured is compared probe by probe, whatever the order of its heads; the
    sets that stopped early are counted, and each run says how it scored its controls."""
    mod = load_bench_script("compare_control_stops")
    clean = (0, [], _s(t=2.0, a=1.0, b=1.0))
    new = _run(tmp_path / "new", [clean, (-1, ["L0H0", "L1H1"], _s(t=3.0)), (-1, ["L0H0", "L1H1"], _s(b=1.5)),
                                  (-1, ["L1H0", "L0H1"], _s(t=2.5, b=1.0)), (-1, ["L1H0", "L0H1"], _s(a=1.0))],
               ["L0H1", "L1H0"], [], 3.0, {"single_controls": "until-excluded", "set_controls": "until-beyond"},
               [{"heads": ["L0H0", "L1H1"], "all_controls": False}, {"heads": ["L1H0", "L0H1"]}])
    old = _run(tmp_path / "all", [clean, (-1, ["L1H1", "L0H0"], _s(t=3.0, a=1.3, b=1.5)),
                                  (-1, ["L0H1", "L1H0"], _s(t=2.5, a=1.0, b=1.0))],
               ["L1H0", "L0H1"], [], 4.0, {"single_controls": "until-excluded", "set_controls": "all"})
    row = mod.compare(new, old)
    assert row["same_chosen_set"] and row["probes"] == {"equal": 5, "differ": 0, "not_scored": 1}
    assert row["early"]["sets_stopped"] == 1 and row["all"]["sets_stopped"] == 0
    assert (row["early"]["controls_until"], row["all"]["controls_until"]) == (
        "single until-excluded; set until-beyond", "single until-excluded")

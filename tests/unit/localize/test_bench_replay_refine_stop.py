"""recipes/bench/replay_refine_stop.py: measure-and-choose cut short, replayed from a run folder's measured sets."""

from __future__ import annotations

import json

from conftest import load_bench_script

# (heads, target damage, worst control damage) in the order measured; none within the 3% tolerance
MEASURED = [
    (["L0H0", "L1H0"], 1.0, 0.20),
    (["L0H0"], 0.5, 0.10),  # a leave-one-out set: measured, never handed on (K = 2)
    (["L0H0", "L2H0"], 1.0, 0.10),  # the choice from here ...
    (["L0H0", "L3H0"], 0.9, 0.15),
    (["L0H0", "L3H1"], 0.9, 0.12),
    (["L2H0", "L3H2"], 0.8, 0.11),
    (["L2H0", "L3H3"], 0.7, 0.13),
    (["L2H0", "L2H1"], 1.0, 0.05),  # ... to here, after 4 evaluations that changed nothing
]


def _run(folder, set_aside=()):
    folder.mkdir()
    measured = [{"heads": h, "target_damage": t, "control_damage": {"c": c, "d": c / 2}, "feasible": False}
                for h, t, c in MEASURED]
    refine = {"heads": ["L2H1", "L2H0"], "tolerance": 0.03, "within_tolerance": False, "chosen": measured[-1],
              "measured": measured}
    if set_aside:
        refine["extra_singles"] = {"set_aside": list(set_aside)}
    (folder / "heads.json").write_text(json.dumps({"refine": refine, "forward_equivalents": 20.0}))
    (folder / "manifest.json").write_text(json.dumps({"layout": {"n_layers": 4, "n_heads": 4}}))
    return folder


def test_patience_stops_replayed_with_their_savings_and_choice(tmp_path):
    mod = load_bench_script("replay_refine_stop")
    row = mod.replay(mod.load_run(_run(tmp_path / "run")), [4, 5])
    assert row["n"] == 8 and row["first"] == 8 and row["settled"] == 8
    assert row["final"].heads == ("L2H0", "L2H1")
    four = row["rules"][4]  # 4 evaluations after the choice changed at the 3rd: stopped after the 7th
    assert four["stop"] == 7 and four["saved_evals"] == 1 and four["saved_fe"] == 0.5  # layers 2-3 of 4
    assert not four["same"] and four["got"].heads == ("L0H0", "L2H0")
    five = row["rules"][5]
    assert five["stop"] == 8 and five["saved_fe"] == 0 and five["same"]
    text = mod.table([row], [4, 5])
    assert "| run | 8 (" in text and "**no**: L0H0, L2H0 (target +100.0%, c +10.0%)" in text


def test_a_head_the_screen_set_aside_is_never_the_replayed_choice(tmp_path):
    mod = load_bench_script("replay_refine_stop")
    row = mod.replay(mod.load_run(_run(tmp_path / "run", set_aside=["L2H1"])), [4])
    assert row["final"].heads == ("L0H0", "L2H0") and row["first"] == 3 and row["settled"] == 3
    assert row["rules"][4]["same"] and row["rules"][4]["stop"] == 7

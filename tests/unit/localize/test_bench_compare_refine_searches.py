"""recipes/bench/compare_refine_searches.py: the swap and predicted searches' run folders side by side."""

from __future__ import annotations

import json

import pytest

from conftest import load_bench_script


def _run(folder, search, heads, target, control, fe, sets, stopped, extra=(), found_by=None):
    folder.mkdir()
    chosen = {"heads": heads, "target_damage": target, "control_damage": {"c": control, "d": control / 2},
              "feasible": control <= 0.03}
    refine = {"heads": heads, "tolerance": 0.03, "chosen": chosen, "n_evaluations": sets, "stopped": stopped,
              "measured": [{"found_by": by} if by else {} for by in (found_by or [None] * sets)]}
    if search != "swaps":
        refine["search"] = search  # (folders from before the predicted search do not say)
    if extra:
        refine["extra_singles"] = {"measured": list(extra)}
    (folder / "heads.json").write_text(json.dumps({"refine": refine, "forward_equivalents": fe}))
    return folder


def test_pairs_compared_by_chooses_rule_and_cost(tmp_path, capsys):
    mod = load_bench_script("compare_refine_searches")
    a = _run(tmp_path / "a", "swaps", ["L1H0", "L2H0"], 0.40, 0.048, 38.7, 24, "budget", extra=["L3H3"])
    b = _run(tmp_path / "b", "predicted", ["L1H0", "L3H0"], 0.40, 0.007, 22.1, 3, "prediction settled")
    c = _run(tmp_path / "c", "swaps", ["L1H0", "L2H0"], 0.80, 0.07, 40.9, 24, "budget")
    d = _run(tmp_path / "d", "predicted", ["L1H0", "L4H0"], 1.08, 0.27, 28.8, 9, "budget",
             found_by=["start", "prediction", "prediction"] + ["swaps"] * 6)
    md = tmp_path / "t.md"
    mod.main([f"antonyms={a},{b}", f"plural={c},{d}", "--md", str(md)])
    text = md.read_text()
    assert text == capsys.readouterr().out
    assert "| antonyms | swaps | 38.7 | 24 (+1 singles) | budget | L1H0, L2H0: target +40.0%, c +4.8% | no |" in text
    assert "| | predicted | 22.1 | 3 | prediction settled | L1H0, L3H0: target +40.0%, c +0.7% | yes |" in text
    assert "| | predicted | 28.8 | 9: 2 predicted, 6 by swaps | budget | L1H0, L4H0: target +108.0%, c +27.0% | no |" in text
    assert "- antonyms: better set: predicted; predicted cost -16.6 FE against swaps" in text
    assert "- plural: better set: swaps; predicted cost -12.1 FE against swaps" in text  # c +27% against +7%
    with pytest.raises(SystemExit, match="give the swaps run first"):
        mod.main([f"x={b},{a}"])

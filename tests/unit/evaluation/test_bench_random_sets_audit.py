"""recipes/bench/random_sets_audit.py: which random sets held the target's strongest heads."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from conftest import load_bench_script

from capsense.evaluation.selectivity import judge
from capsense.evaluation.validate import ValidationRow


def test_a_random_set_holding_a_top_head_is_named_with_what_it_did(tmp_path, capsys):
    mod = load_bench_script("random_sets_audit")
    rows = [ValidationRow("t", "acc", 1.0, 0.1, -0.9, None, None, None, None, None, [1.0, 0.0, 0.0], None),
            ValidationRow("c", "acc", 0.8, 0.8, 0.0, None, None, None, None, None, [0.8, 0.8, 0.8], None)]
    verdict = judge(rows, "t", ["c"], 0.10)
    assert not verdict["selective"]  # the two random sets that wreck t veto "clearly hurt"
    record = {"model": "m", "heads": "L0H0+L1H1", "random_sets": ["L2H2+L3H3", "L9H9+L4H4", "L9H9+L5H5"],
              "rows": [asdict(r) for r in rows], "verdict": verdict, "locate_task": "t"}
    (tmp_path / "validation_x.json").write_text(json.dumps(record))
    effects = {f"L{i}H{i}": float(i) for i in range(10)}  # L9H9 .. L5H5 are the top 5
    (tmp_path / "sweeps.json").write_text(json.dumps({"t": {"effects": effects}}))
    md = tmp_path / "audit.md"
    assert mod.main([str(tmp_path / "validation_x.json"), "--sweeps", f"m:{tmp_path / 'sweeps.json'}", "--md", str(md)]) == 0
    text = md.read_text()
    assert "| validation_x | t | 0.10 (1.00) | - | 1.00 -; 0.00 L9H9; 0.00 L9H9+L5H5 | no |" in text
    assert "in 1 a random set holds one of the target's top-5 heads; of those, the target was judged clearly hurt in 0; of the other 0, in 0." in text
    with pytest.raises(SystemExit):  # MODEL:PATH, or one clear usage error
        mod.main([str(tmp_path / "validation_x.json"), "--sweeps", "no-colon"])


def test_the_two_draws_compared_on_a_layout():
    """The seed-only draw gives every set random sets at the same pool positions, so a head is held by two of the
    three random sets either for many sets or for none; the keyed draw spreads it."""
    mod = load_bench_script("random_sets_audit")
    shares = mod.draw_shares(18, 4, (11, 2), 400)
    assert set(shares) == {"keyed", "seed_only"}
    for v in shares.values():
        assert 0 <= v["at_least_two"] <= v["at_least_one"] <= 1
    assert shares["keyed"]["at_least_two"] < 0.05 < shares["seed_only"]["at_least_two"]
    with pytest.raises(SystemExit):
        mod.main(["any.json", "--draw-layout", "18by4"])  # refused before any file is read

"""Which heads a heads file stands for when no ``top_k`` is given: the set its locate run chose, never its whole
ranking (a run ranks every head it scored: ablating them all was the default)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from capsense.core.heads import HeadSet, HeadsFile, write_heads_file
from capsense.errors import HeadSpecError

RANKING = [{"layer": l, "head": h, "rank": i + 1} for i, (l, h) in enumerate([(1, 2), (0, 3), (1, 0), (0, 1), (1, 1)])]


def test_a_run_s_file_stands_for_its_chosen_set_top_k_for_its_first_heads_and_a_bare_ranking_asks(tmp_path):
    chosen = write_heads_file(tmp_path / "chosen.json", HeadsFile("m", RANKING, {"refine": {"heads": ["L1H2", "L0H3"]}}))
    assert str(HeadSet.parse(chosen)) == "L1H2+L0H3"
    assert str(HeadSet.parse(chosen, top_k=3)) == "L1H2+L0H3+L1H0"
    bare = write_heads_file(tmp_path / "bare.json", HeadsFile("m", RANKING, {"method": "cs"}))
    with pytest.raises(HeadSpecError, match="ranks 5 heads and names no chosen set.*give `top_k`"):
        HeadSet.parse(bare)
    assert str(HeadSet.parse(bare, top_k=2)) == "L1H2+L0H3"
    by_hand = write_heads_file(tmp_path / "hand.json", HeadsFile("m", [{"layer": 0, "head": 1}, {"layer": 1, "head": 0}]))
    assert str(HeadSet.parse(by_hand)) == "L0H1+L1H0"


def test_export_without_top_k_ablates_the_chosen_set_and_records_it(tmp_path, tiny_model_dir):
    from capsense.cli import main

    heads = write_heads_file(tmp_path / "heads.json", HeadsFile("tiny", RANKING, {"refine": {"heads": ["L1H2", "L0H3"]}}))
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["export", str(tiny_model_dir), "--heads", str(heads), "--format", "checkpoint",
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "capsense.json").read_text())["heads_spec"] == "L1H2+L0H3"
    r = CliRunner().invoke(main, ["export", str(tiny_model_dir), "--heads", str(write_heads_file(
        tmp_path / "bare.json", HeadsFile("tiny", RANKING))), "--format", "checkpoint", "--out", str(tmp_path / "o2")])
    assert r.exit_code == 1 and "give --top-k" in r.output and not (tmp_path / "o2").exists()


def test_validate_without_top_k_validates_the_chosen_set(tmp_path, tiny_model_dir):
    """``capsense validate`` took the first 5 heads by default: a run that chose 2 had 3 heads it never chose validated
    with them. Now the chosen set; a bare ranking asks for --top-k before anything loads."""
    from capsense.evaluation.validate import validate

    heads = write_heads_file(tmp_path / "heads.json", HeadsFile("tiny", RANKING, {
        "task": "capsense_arithmetic", "controls": [], "refine": {"heads": ["L1H2", "L0H3"]}}))
    rows, info = validate(str(tiny_model_dir), heads, None, ["capsense_arithmetic"], n_random=1, limit=2, log=lambda m: None)
    assert info["top_k"] == 2 and info["heads"] == "L1H2+L0H3" and all(len(r.split("+")) == 2 for r in info["random_sets"])
    bare = write_heads_file(tmp_path / "bare.json", HeadsFile("tiny", RANKING, {"task": "capsense_arithmetic"}))
    with pytest.raises(HeadSpecError, match="give `top_k`"):
        validate(str(tiny_model_dir), bare, None, ["capsense_arithmetic"], n_random=1, limit=2, log=lambda m: None)


def test_heads_located_on_a_model_of_another_shape_are_refused_even_where_they_fit(tmp_path, tiny_model_dir):
    """A heads file of an 18 x 4 model (Gemma 3 270M's shape) fits the tiny 3 x 4 model's range only in part; one of
    2 x 4 fits it whole and was ablated without a word. Its layout says where it was located; a spec has none."""
    from capsense.cli import main
    from capsense.core.arch import HeadLayout

    meta = {"task": "capsense_arithmetic", "layout": {"n_layers": 2, "n_heads": 4, "head_dim": 16}}
    other = write_heads_file(tmp_path / "other.json", HeadsFile("other-model", [{"layer": 1, "head": 2}], meta))
    with pytest.raises(HeadSpecError, match="located on a model of 2 layers x 4 heads; this model has 3 x 4"):
        HeadSet.parse(other).check_fits(HeadLayout(3, 4, 16))
    assert HeadSet.parse(other).check_fits(HeadLayout(2, 4, 16)) == HeadSet.from_spec("L1H2")
    assert HeadSet.parse(other, top_k=1).made_for == (2, 4) and HeadSet.from_spec("L1H2").made_for is None
    r = CliRunner().invoke(main, ["evaluate", str(tiny_model_dir), "--heads", str(other), "--tasks", "capsense_arithmetic",
                                  "--limit", "2"])
    assert r.exit_code == 1 and "located on a model of 2 layers x 4 heads; this model has" in r.output
    r = CliRunner().invoke(main, ["export", str(tiny_model_dir), "--heads", str(other), "--format", "adapter",
                                  "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "located on a model of 2 layers x 4 heads" in r.output and not (tmp_path / "o").exists()

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
    with pytest.raises(HeadSpecError, match=r"located on a model of 2 layers x 4 heads \(16 wide\); this model is a "
                                            r"model of 3 layers x 4 heads \(16 wide\) \(they differ in layers x heads\)"):
        HeadSet.parse(other).check_fits(HeadLayout(3, 4, 16))
    assert HeadSet.parse(other).check_fits(HeadLayout(2, 4, 16)) == HeadSet.from_spec("L1H2")
    assert HeadSet.parse(other, top_k=1).made_for == HeadLayout(2, 4, 16) and HeadSet.from_spec("L1H2").made_for is None
    r = CliRunner().invoke(main, ["evaluate", str(tiny_model_dir), "--heads", str(other), "--tasks", "capsense_arithmetic",
                                  "--limit", "2"])
    assert r.exit_code == 1 and "located on a model of 2 layers x 4 heads (16 wide); this model is a llama model of 3" in r.output
    r = CliRunner().invoke(main, ["export", str(tiny_model_dir), "--heads", str(other), "--format", "adapter",
                                  "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "located on a model of 2 layers x 4 heads" in r.output and not (tmp_path / "o").exists()


def test_heads_of_another_model_of_the_same_shape_are_refused_and_a_fine_tune_s_pass(tmp_path, tiny_model_dir):
    """Layers x heads alone let a heads file of another model of one shape through (Llama 2 7B, Llama 3 8B and
    Mistral 7B are all 32 x 32): its key/value heads, head width and model type, where the file records them, tell
    them apart, before the load (from the config) and after it. A file recording all of the tiny Llama's (a
    fine-tuned variant's) passes; so does an older file that records only layers x heads."""
    from capsense.cli import main
    from capsense.core.arch import HeadLayout, head_layout
    from tests.conftest import make_tiny_model

    layout = head_layout(make_tiny_model("llama"))
    assert (layout.n_kv_heads, layout.family) == (2, "llama")
    assert HeadLayout.from_dict(layout.to_dict()).to_dict() == layout.to_dict() == {
        "n_layers": 3, "n_heads": 4, "head_dim": 16, "n_kv_heads": 2, "model_type": "llama"}

    def heads_file(name, **layout_changes):
        meta = {"task": "capsense_arithmetic", "layout": {**layout.to_dict(), **layout_changes}}
        return write_heads_file(tmp_path / name, HeadsFile("some-model", [{"layer": 1, "head": 2}], meta))

    mistral = heads_file("mistral.json", model_type="mistral", n_kv_heads=4)
    with pytest.raises(HeadSpecError, match=r"located on a mistral model of 3 layers x 4 heads \(4 key/value heads, 16 "
                                            r"wide\); this model is a llama model of 3 layers x 4 heads \(2 key/value "
                                            r"heads, 16 wide\) \(they differ in key/value heads and model type\)"):
        HeadSet.parse(mistral).check_fits(layout)
    r = CliRunner().invoke(main, ["evaluate", str(tiny_model_dir), "--heads", str(mistral), "--tasks",
                                  "capsense_arithmetic", "--limit", "2"])
    assert r.exit_code == 1 and "(they differ in key/value heads and model type)" in r.output, r.output
    wider = heads_file("wider.json", head_dim=32)
    r = CliRunner().invoke(main, ["export", str(tiny_model_dir), "--heads", str(wider), "--format", "checkpoint",
                                  "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "(they differ in head width)" in r.output and not (tmp_path / "o").exists(), r.output
    assert HeadSet.parse(heads_file("same.json")).check_fits(layout) == HeadSet.from_spec("L1H2")
    older = heads_file("older.json", head_dim=None, n_kv_heads=None, model_type=None)
    assert HeadSet.parse(older).check_fits(layout) == HeadSet.from_spec("L1H2")

"""Shipping the better of a guided allocation and the uniform setting, measured on calibration documents."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from click.testing import CliRunner
from conftest import make_char_tokenizer, make_tiny_model

from capsense.cli import main
from capsense.compress.budget import load_budget, uniform_budget
from capsense.compress.capability_loss import capability_probe, measure_probe
from capsense.compress.engine import calibrate, compress_model
from capsense.compress.guided import Guide
from capsense.compress.select import compress_better, compress_guided, guided_candidates
from capsense.compress.targets import find_targets
from capsense.errors import BudgetError

MILD, HARSH = {"method": "wanda", "density": 0.9}, {"method": "wanda", "density": 0.1}


@pytest.fixture(scope="module")
def case():
    model, tok = make_tiny_model("llama"), make_char_tokenizer()
    stats, _ = calibrate(model, tok, uniform_budget(MILD), "math", 6)
    orig = {k: v.clone() for k, v in model.state_dict().items()}
    return model, tok, stats, orig


def _weights(model):
    return {t.name: t.get().clone() for t in find_targets(model)}


def _calib_dl(model, tok, orig, budget, stats, n=3):
    """The kept capability's dL on its last ``n`` documents, compressing from ``orig`` with ``budget``."""
    probe = capability_probe("math", tok, n, use="calibration")
    model.load_state_dict(orig)
    before = measure_probe(model, probe).nll
    compress_model(model, budget, stats)
    return measure_probe(model, probe).nll - before


@pytest.mark.parametrize("order", [("harsh", "mild"), ("mild", "harsh")])
def test_the_candidate_with_the_lower_calibration_dl_is_left_in_the_model(case, order):
    model, tok, stats, orig = case
    budgets = {"mild": uniform_budget(MILD), "harsh": uniform_budget(HARSH)}
    expected = {name: _calib_dl(model, tok, orig, b, stats) for name, b in budgets.items()}
    assert expected["mild"] < expected["harsh"]  # the premise: pruning 90% hurts more than 10%
    model.load_state_dict(orig)
    compress_model(model, budgets["mild"], stats)
    mild_weights = _weights(model)
    model.load_state_dict(orig)
    sel = compress_better(model, tok, [(n, budgets[n]) for n in order], stats, ["math"], 3)
    assert sel.chosen == "mild" and sel.budget is budgets["mild"] and sel.record["chosen"] == "mild"
    assert sel.result.summary["target_density"] == pytest.approx(0.9, abs=0.01)
    assert all(torch.equal(w, mild_weights[k]) for k, w in _weights(model).items())  # whichever order
    for name in budgets:  # the record is what measuring each candidate alone gives
        assert sel.record["dL"][name]["math"] == pytest.approx(expected[name], abs=1e-5)
    assert sel.record["n_docs"] == 3 and sel.record["documents"] == "last"


def test_a_tie_keeps_the_first_candidate_and_bad_input_is_refused(case):
    model, tok, stats, orig = case
    model.load_state_dict(orig)
    sel = compress_better(model, tok, [("a", uniform_budget(MILD)), ("b", uniform_budget(MILD))], stats, ["math"], 2)
    assert sel.chosen == "a" and sel.record["dL"]["a"] == sel.record["dL"]["b"]
    with pytest.raises(BudgetError, match="distinct names"):
        compress_better(model, tok, [("a", uniform_budget(MILD)), ("a", uniform_budget(HARSH))], stats, ["math"], 2)
    with pytest.raises(BudgetError, match="`n_docs`"):
        compress_better(model, tok, [("a", uniform_budget(MILD))], stats, ["math"], 0)


def test_compress_guided_checks_only_at_the_uniform_size_and_when_asked(case):
    model, tok, stats, orig = case
    uni = uniform_budget({"method": "wanda", "density": 0.5})
    for guide, checked in ((Guide(["math"], samples=2, protect_top_k=0), True),
                           (Guide(["math"], samples=2, protect_top_k=0, check_uniform=False), False),
                           (Guide(["math"], samples=2, protect_top_k=0, size_ratio=0.8), False)):
        model.load_state_dict(orig)
        allocs = guided_candidates(model, tok, uni, stats, guide)
        assert [n for n, _ in allocs] == ["guided"]  # wanda has no second pricing
        result, shipped, al = compress_guided(model, tok, uni, allocs, stats, guide)
        assert al is allocs[0][1] and ("selection" in al.info) == checked
        if checked:
            sel = al.info["selection"]
            assert shipped is (al.budget if sel["chosen"] == "guided" else uni) and set(sel["dL"]) == {"guided", "uniform"}
            assert sum(sel["dL"][sel["chosen"]].values()) <= min(sum(d.values()) for d in sel["dL"].values())
        else:
            assert shipped is al.budget
        assert sum(a.bits for a in result.accounts) == sum(a.bits for a in compress_model(
            make_tiny_model("llama"), shipped, stats).accounts)
    model.load_state_dict(orig)
    result, shipped, al = compress_guided(model, tok, uni, [], stats, None)
    assert shipped is uni and al is None and result.summary["target_density"] == pytest.approx(0.5, abs=0.01)


def test_sparsegpt_at_the_default_pricing_also_measures_the_wanda_priced_allocation(case):
    model, tok, _, orig = case
    model.load_state_dict(orig)
    uni = uniform_budget({"method": "sparsegpt", "density": 0.5})
    stats, _ = calibrate(model, tok, uni, "math", 6)
    allocs = guided_candidates(model, tok, uni, stats, Guide(["math"], samples=2, protect_top_k=0))
    assert [(n, a.info["pricing"]) for n, a in allocs] == [("guided", "output"), ("guided-wanda", "wanda")]
    for guide in (Guide(["math"], samples=2, protect_top_k=0, pricing="output"),  # a pricing asked for: only it
                  Guide(["math"], samples=2, protect_top_k=0, check_uniform=False)):
        assert [n for n, _ in guided_candidates(model, tok, uni, stats, guide)] == ["guided"]
    guide = Guide(["math"], samples=2, protect_top_k=0)
    result, shipped, al = compress_guided(model, tok, uni, allocs, stats, guide)
    sel = al.info["selection"]
    assert set(sel["dL"]) == {"guided", "guided-wanda", "uniform"}
    assert sel["chosen"] == min(sel["dL"], key=lambda n: sum(sel["dL"][n].values()))
    assert shipped is {"uniform": uni, **{n: a.budget for n, a in allocs}}[sel["chosen"]]
    assert al is dict(allocs).get(sel["chosen"], allocs[0][1])


def test_guided_checkpoint_records_both_measurements_and_ships_what_budget_yaml_says(tmp_path, tiny_model_dir):
    from capsense.compress.request import compress_request

    out = tmp_path / "out"
    compress_request(str(tiny_model_dir), out, {"method": "wanda", "density": 0.5}, keep="math", protect_top_k=1,
                     calibration_samples=4)
    sel = json.loads((out / "capsense.json").read_text())["allocation"]["selection"]
    meta = json.loads((out / "capsense.json").read_text())
    assert set(sel["dL"]) == {"guided", "uniform"} and sel["n_docs"] == 4 and sel["capabilities"] == ["math"]
    assert sel["chosen"] == min(sel["dL"], key=lambda n: (sum(sel["dL"][n].values()), n != "guided"))
    shipped = load_budget(out / "budget.yaml")
    if sel["chosen"] == "uniform":
        assert not shipped.overrides and shipped.protect_heads is None
        assert {a["setting"].get("density") for a in meta["matrices"]} == {0.5}
    else:
        assert sum(a["bits"] for a in meta["matrices"]) == meta["allocation"]["allocated_bits"]
    assert yaml.safe_load((out / "budget.yaml").read_text())["method"] == "wanda"
    card = (out / "README.md").read_text()
    shipped_words = "the guided allocation" if sel["chosen"] == "guided" else "the uniform setting"
    assert f"the lower summed dL is shipped: **{shipped_words}**" in card
    assert f"| guided | {sel['dL']['guided']['math']:+.4f} |" in card


def test_check_uniform_needs_keep_and_the_uniform_size(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    for extra, message in ((["--check-uniform"], "--check-uniform shape(s) a guided allocation: give --keep"),
                           (["--keep", "math", "--check-uniform", "--budget-size", "0.6"], "with --budget-size the sizes differ")):
        r = CliRunner().invoke(main, ["compress", str(tiny_model_dir), "--method", "wanda", "--density", "0.5", *extra,
                                      "--out", str(out)])
        assert r.exit_code == 1 and message in r.output and r.output.count("Error") == 1, r.output
        assert not out.exists()

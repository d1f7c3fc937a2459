"""Shipping the guided allocation unless a candidate (uniform, another pricing) measures better beyond noise."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner
from conftest import make_char_tokenizer, make_tiny_model

from capsense.cli import main
from capsense.compress.budget import load_budget, uniform_budget
from capsense.compress.capability_loss import CapabilityLoss, capability_probe, measure_probe, paired_difference
from capsense.compress.engine import calibrate, compress_model
from capsense.compress.guided import Guide
from capsense.compress import select
from capsense.compress.select import MARGIN_SE, RESOLVED_SE, compress_better, compress_guided, guided_candidates
from capsense.compress.targets import find_targets
from capsense.errors import BudgetError, CapsenseError

MILD, HARSH = {"method": "wanda", "density": 0.9}, {"method": "wanda", "density": 0.1}


def _case(init: float | None):
    """A tiny llama (``init``: its initializer range; None the default 0.02, whose near-uniform outputs
    barely notice pruning), calibration statistics for ``MILD`` and its original weights."""
    model = make_tiny_model("llama", **({} if init is None else {"initializer_range": init}))
    tok = make_char_tokenizer()
    stats, _ = calibrate(model, tok, uniform_budget(MILD), "math", 6)
    return model, tok, stats, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def case():
    """Sharp enough (initializer range 0.2) that pruning 90% costs the kept capability far more than 10%."""
    return _case(0.2)


@pytest.fixture(scope="module")
def flat():
    return _case(None)


def _weights(model):
    return {t.name: t.get().clone() for t in find_targets(model)}


def _calib(model, tok, orig, budget, stats, n=3):
    """The kept capability's measurement on its last ``n`` documents, compressing from ``orig`` with
    ``budget`` (None: uncompressed), and the compressed weights."""
    model.load_state_dict(orig)
    if budget is not None:
        compress_model(model, budget, stats)
    return measure_probe(model, capability_probe("math", tok, n, use="calibration")), _weights(model)


def _paired_by_hand(a, b):
    """``b`` minus ``a`` in nats/token over the same documents and its standard error, written out: the
    token-weighted mean difference D and the ratio estimator's SE sqrt(n/(n-1) sum (e_i - D t_i)^2) / T."""
    e = [nb - na for na, nb in zip(a.doc_nats, b.doc_nats)]
    t, n = a.doc_tokens, len(e)
    total = sum(t)
    d = sum(e) / total
    return d, (n / (n - 1) * sum((ei - d * ti) ** 2 for ei, ti in zip(e, t))) ** 0.5 / total


def _expected_choice(sel):
    """What the rule ships given the record: the allocation unless a candidate's paired difference is
    below -MARGIN_SE standard errors (0: below 0); of those, the lowest summed dL (the record checked
    against itself)."""
    total = {n: sum(d.values()) for n, d in sel["dL"].items()}
    first = sel["allocation"]
    for name, p in sel["paired"].items():
        assert p["dL_diff"] == pytest.approx(total[name] - total[first], abs=1e-6)
        assert p["clears"] == (p["dL_diff"] < -MARGIN_SE * p["se"] if MARGIN_SE else p["dL_diff"] < 0)
        assert p["resolved"] == (p["se"] is not None and abs(p["dL_diff"]) > RESOLVED_SE * p["se"])
    cleared = [n for n, p in sel["paired"].items() if p["clears"]]
    return min(cleared, key=total.get) if cleared else first


@pytest.mark.parametrize("order", [("harsh", "mild"), ("mild", "harsh")])
def test_a_clearly_better_challenger_displaces_the_allocation_and_is_left_in_the_model(case, order):
    model, tok, stats, orig = case
    budgets = {"mild": uniform_budget(MILD), "harsh": uniform_budget(HARSH)}
    before, _ = _calib(model, tok, orig, None, stats)
    alone = {name: _calib(model, tok, orig, b, stats) for name, b in budgets.items()}
    first, second = (alone[n][0] for n in order)
    diff, se = _paired_by_hand(first, second)
    # the premise: on this model pruning 90% costs math clearly more than 10%, beyond 2 SE with 3 documents
    assert alone["mild"][0].nll < alone["harsh"][0].nll and abs(diff) > RESOLVED_SE * se > 0
    model.load_state_dict(orig)
    sel = compress_better(model, tok, [(n, budgets[n]) for n in order], stats, ["math"], 3)
    assert sel.chosen == "mild" and sel.budget is budgets["mild"] and sel.record["chosen"] == "mild"
    assert sel.result.summary["target_density"] == pytest.approx(0.9, abs=0.01)
    assert all(torch.equal(w, alone["mild"][1][k]) for k, w in _weights(model).items())  # whichever order
    rec = sel.record
    for name in budgets:  # the record is what measuring each candidate alone gives
        assert rec["dL"][name]["math"] == pytest.approx(alone[name][0].nll - before.nll, abs=1e-5)
    p = rec["paired"][order[1]]
    assert rec["allocation"] == order[0] and set(rec["paired"]) == {order[1]}
    assert p["dL_diff"] == pytest.approx(diff, abs=1e-6) and p["se"] == pytest.approx(se, rel=1e-5)
    assert p["by_capability"]["math"]["se"] == pytest.approx(se, rel=1e-5) and p["margin"] == pytest.approx(MARGIN_SE * se)
    assert p["resolved"]
    assert p["clears"] == (order[0] == "harsh") and _expected_choice(rec) == "mild"
    assert ("kept" in rec["reason"]) == (order[0] == "mild")
    assert rec["n_docs"] == 3 and rec["documents"] == "last" and rec["margin_se"] == MARGIN_SE == 0.0


def test_a_challenger_within_noise_ships_when_lower_and_is_recorded_as_unresolved(flat, monkeypatch):
    """The lowest dL ships even within noise (round 12 measured a margin for the allocation and left it
    off), and the record says the documents did not resolve it; with ``MARGIN_SE`` 2 the allocation stays."""
    model, tok, stats, orig = flat
    budgets = {"harsh": uniform_budget(HARSH), "mild": uniform_budget(MILD)}
    alone = {name: _calib(model, tok, orig, b, stats) for name, b in budgets.items()}
    diff, se = _paired_by_hand(alone["harsh"][0], alone["mild"][0])
    assert diff < 0 and -diff < RESOLVED_SE * se  # the premise: mild is lower, but within 2 SE on this flat model
    model.load_state_dict(orig)
    sel = compress_better(model, tok, list(budgets.items()), stats, ["math"], 3)
    p = sel.record["paired"]["mild"]
    assert sel.chosen == "mild" and sel.budget is budgets["mild"] and p["clears"] and not p["resolved"]
    assert p["se"] == pytest.approx(se, rel=1e-5) and p["dL_diff"] == pytest.approx(diff, abs=1e-6)
    assert all(torch.equal(w, alone["mild"][1][k]) for k, w in _weights(model).items())
    assert "mild's summed dL is the lowest" in sel.record["reason"] and "not resolved" in sel.record["reason"]
    monkeypatch.setattr(select, "MARGIN_SE", 2.0)  # the margin round 12 measured: the allocation is kept
    model.load_state_dict(orig)
    kept = compress_better(model, tok, list(budgets.items()), stats, ["math"], 3)
    assert kept.chosen == "harsh" and not kept.record["paired"]["mild"]["clears"] and "harsh kept" in kept.record["reason"]
    assert all(torch.equal(w, alone["harsh"][1][k]) for k, w in _weights(model).items())


def test_a_tie_keeps_the_first_candidate_and_bad_input_is_refused(case):
    model, tok, stats, orig = case
    model.load_state_dict(orig)
    sel = compress_better(model, tok, [("a", uniform_budget(MILD)), ("b", uniform_budget(MILD))], stats, ["math"], 2)
    assert sel.chosen == "a" and sel.record["dL"]["a"] == sel.record["dL"]["b"]
    model.load_state_dict(orig)  # one document: no standard error; the lower dL ships, recorded as not resolved
    sel = compress_better(model, tok, [("harsh", uniform_budget(HARSH)), ("mild", uniform_budget(MILD))], stats,
                          ["math"], 1)
    p = sel.record["paired"]["mild"]
    assert sel.chosen == "mild" and p["se"] is None and not p["resolved"] and "not resolved" in sel.record["reason"]
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
            assert sel["allocation"] == "guided" and sel["chosen"] == _expected_choice(sel)
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
    assert sel["chosen"] == _expected_choice(sel) and set(sel["paired"]) == {"guided-wanda", "uniform"}
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
    assert sel["chosen"] == _expected_choice(sel) and sel["allocation"] == "guided"
    shipped = load_budget(out / "budget.yaml")
    if sel["chosen"] == "uniform":
        assert not shipped.overrides and shipped.protect_heads is None
        assert {a["setting"].get("density") for a in meta["matrices"]} == {0.5}
    else:
        assert sum(a["bits"] for a in meta["matrices"]) == meta["allocation"]["allocated_bits"]
    assert yaml.safe_load((out / "budget.yaml").read_text())["method"] == "wanda"
    card = (out / "README.md").read_text()
    shipped_words = "the guided allocation" if sel["chosen"] == "guided" else "the uniform setting"
    assert "the lowest summed dL is shipped (SE: of the paired per-document difference to guided)" in card
    assert f"**{shipped_words}** ({sel['reason']})" in card
    p = sel["paired"]["uniform"]
    assert f"| guided | {sel['dL']['guided']['math']:+.4f} |  |  |" in card
    assert f"| uniform | {sel['dL']['uniform']['math']:+.4f} | {p['dL_diff']:+.4f} | {p['se']:.4f} |" in card


def test_check_uniform_needs_keep_and_the_uniform_size(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    for extra, message in ((["--check-uniform"], "--check-uniform shape(s) a guided allocation: give --keep"),
                           (["--keep", "math", "--check-uniform", "--budget-size", "0.6"], "with --budget-size the sizes differ"),
                           (["--check-docs", "8"], "--check-docs shape(s) a guided allocation: give --keep"),
                           (["--keep", "math", "--no-check-uniform", "--check-docs", "8"],
                            "with --check-uniform off no check runs"),
                           (["--keep", "math", "--budget-size", "0.6", "--check-docs", "8"],
                            "with --budget-size no check runs")):
        r = CliRunner().invoke(main, ["compress", str(tiny_model_dir), "--method", "wanda", "--density", "0.5", *extra,
                                      "--out", str(out)])
        assert r.exit_code == 1 and message in r.output and r.output.count("Error") == 1, r.output
        assert not out.exists()


def test_check_docs_sets_how_many_documents_the_choice_reads(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["compress", str(tiny_model_dir), "--method", "wanda", "--density", "0.5", "--keep",
                                  "math", "--protect-top-k", "1", "--calibration-samples", "4", "--check-docs", "3",
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    sel = json.loads((out / "capsense.json").read_text())["allocation"]["selection"]
    assert sel["n_docs"] == 3 and set(sel["dL"]) == {"guided", "uniform"}  # default: the Fisher's 4 (test above)


def _loss(nats, tokens, task="math"):
    return CapabilityLoss(task, task, sum(nats) / sum(tokens), 0.0, len(nats), sum(tokens), list(nats), list(tokens))


def test_paired_difference_is_the_sample_se_with_equal_tokens_and_refuses_other_documents():
    a = _loss([10.0, 12.0, 9.0, 11.0], [5, 5, 5, 5])
    b = _loss([9.0, 11.5, 9.5, 9.0], [5, 5, 5, 5])
    per_token = np.array([-1.0, -0.5, 0.5, -2.0]) / 5
    diff, se = paired_difference(a, b)
    assert diff == pytest.approx(per_token.mean()) and diff == pytest.approx(b.nll - a.nll)
    assert se == pytest.approx(per_token.std(ddof=1) / 2)  # s / sqrt(n), n = 4
    c = _loss([10.0, 30.0], [2, 6])  # unequal tokens: D weights documents by tokens
    diff, se = paired_difference(c, _loss([11.0, 30.0], [2, 6]))
    assert diff == pytest.approx(1 / 8) and se == pytest.approx((2 * ((1 - 2 / 8) ** 2 + (6 / 8) ** 2)) ** 0.5 / 8)
    assert paired_difference(_loss([3.0], [2]), _loss([4.0], [2])) == (0.5, None)
    with pytest.raises(CapsenseError, match="same documents"):
        paired_difference(a, _loss([1.0, 2.0], [5, 5]))
    with pytest.raises(CapsenseError, match="same documents"):
        paired_difference(a, _loss([10.0, 12.0, 9.0, 11.0], [5, 5, 5, 5], task="code"))


def test_the_uniform_check_measures_check_docs_documents_and_refuses_them_where_no_check_runs(case):
    """``check_docs`` sets how many calibration documents per kept capability the check measures (default:
    the Fisher's ``samples``); asked for without the check, or below 1, it is refused."""
    model, tok, stats, orig = case
    uni = uniform_budget({"method": "wanda", "density": 0.5})
    for guide, n in ((Guide(["math"], samples=2, protect_top_k=0), 2),
                     (Guide(["math"], samples=2, protect_top_k=0, check_docs=3), 3)):
        model.load_state_dict(orig)
        allocs = guided_candidates(model, tok, uni, stats, guide)
        _, _, al = compress_guided(model, tok, uni, allocs, stats, guide)
        assert al.info["selection"]["n_docs"] == n
    model.load_state_dict(orig)
    for bad in ({"check_docs": 0}, {"check_docs": 4, "check_uniform": False}):
        with pytest.raises(BudgetError, match="check_docs"):
            Guide(["math"], **bad)

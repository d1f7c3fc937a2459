"""``choice_nll``: a multiple-choice probe's gold choice under the softmax over its document's choices, scored under
knockouts by every scorer alike and attributed by an exact gradient (round 28)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from capsense.errors import CapsenseError
from capsense.scoring.attribution import AttributionScorer, attribute_probes, attribution_scorers, check_gradient_metric
from capsense.scoring.probe import KeepsRequestScores, ProbeScorer
from capsense.scoring.requests import check_choice_metric
from capsense.scoring.shared_context import SharedContextScorer
from conftest import N_HEADS, N_LAYERS, choice_probe, loglik_probe, make_tiny_model
from test_attribution import _assert_gradient, one_head


class _Kept(KeepsRequestScores, ProbeScorer):
    pass


def _masks() -> torch.Tensor:
    ko = torch.rand(5, N_LAYERS, N_HEADS, generator=torch.Generator().manual_seed(3)) < 0.3
    ko[0] = False
    return ko


def test_choice_nll_is_each_documents_gold_choice_cross_entropy():
    model = make_tiny_model("llama")
    probe = choice_probe(n_docs=4)
    scorer = _Kept(model, probe, batch_size=5)
    got = scorer.score(_masks())["choice_nll"]
    logprob = scorer.last[0]
    want = np.zeros(len(got))
    for d in range(probe.n_docs):
        sel = np.flatnonzero(probe.doc_of == d)
        lp = logprob[:, sel]
        gold = lp[:, probe.choice_of[sel] == probe.gold[d]][:, 0]
        want += -(gold - np.log(np.exp(lp).sum(1)))
    np.testing.assert_allclose(got, want / probe.n_docs, rtol=1e-12)
    assert (got > 0).all() and np.ptp(got[1:]) > 0  # a loss, and the knockouts move it
    assert "choice_nll" not in ProbeScorer(model, loglik_probe()).score()  # a probe without choices has none


def test_shared_context_scores_choice_nll_like_full_requests():
    model = make_tiny_model("llama")
    probe = choice_probe(n_docs=5)
    full = ProbeScorer(model, probe, batch_size=6).score(_masks())["choice_nll"]
    shared = SharedContextScorer(model, probe, batch_size=6)
    np.testing.assert_allclose(shared.score(_masks())["choice_nll"], full, atol=1e-5, rtol=0)
    assert shared.enabled


@pytest.mark.parametrize("on_shared_context", [True, False])
def test_choice_nll_gradient_equals_finite_difference(on_shared_context):
    """On the shared context and off it (every choice of whole documents per batch, one multiplier row per document)."""
    model = make_tiny_model("llama").double()
    probe = choice_probe(n_docs=4)
    scorer = AttributionScorer(model, probe, batch_size=4, metric="choice_nll")  # 4 requests: one document a batch
    if not on_shared_context:
        scorer.shared = None
    assert scorer.on_shared_context is on_shared_context and scorer.n_batches == 4
    att = scorer.attribute()
    _assert_gradient(scorer, att.gradient, all_fp64=False)
    clean = ProbeScorer(model, probe).score()["choice_nll"][0]
    assert att.nll == pytest.approx(clean, abs=1e-6)  # (llama keeps its attention softmax in float32)
    assert (att.magnitude >= np.abs(att.gradient) - 1e-12).all()


def test_choice_nll_batches_and_paths_agree_and_zero_is_the_knockout():
    model = make_tiny_model("llama")
    probe = choice_probe(n_docs=5)
    shared = AttributionScorer(model, probe, batch_size=7, metric="choice_nll")
    plain = AttributionScorer(model, probe, batch_size=64, metric="choice_nll")
    plain.shared = None
    a, b = shared.attribute(), plain.attribute()
    np.testing.assert_allclose(a.gradient, b.gradient, atol=1e-5, rtol=0)
    np.testing.assert_allclose(a.magnitude, b.magnitude, atol=1e-5, rtol=0)  # per document on both paths
    nll = AttributionScorer(model, probe, batch_size=7).attribute()
    assert np.abs(a.gradient - nll.gradient).max() > 1e-3  # another score than the gold choice's nll
    ko, scale = one_head(1, 0)
    knocked = ProbeScorer(model, probe, batch_size=3).score(ko)["choice_nll"][0]
    assert plain.score(scale) == pytest.approx(knocked, abs=1e-5)


def test_attribute_probes_scores_each_probe_in_its_metric():
    model = make_tiny_model("qwen2")
    probes = {"mc": choice_probe(), "ll": loglik_probe()}
    atts = attribute_probes(model, probes, scorers=attribution_scorers(model, probes, 4, metrics={"mc": "choice_nll"}))
    clean_mc, clean_ll = ProbeScorer(model, probes["mc"]).score(), ProbeScorer(model, probes["ll"]).score()
    assert atts["mc"].nll == pytest.approx(clean_mc["choice_nll"][0], abs=1e-5)
    assert atts["ll"].nll == pytest.approx(clean_ll["nll"][0], abs=1e-5)


def test_choice_nll_needs_a_multiple_choice_probe_and_task(tmp_path):
    check_gradient_metric("choice_nll")
    with pytest.raises(CapsenseError, match="'toy' is a loglikelihood task: use nll, or a multiple-choice task"):
        AttributionScorer(make_tiny_model("llama"), loglik_probe(), metric="choice_nll")
    with pytest.raises(CapsenseError, match="'capsense_induction' is a loglikelihood task, without choices"):
        check_choice_metric("choice_nll", "capsense_induction")
    check_choice_metric("nll", "no_such_task_is_looked_up")  # another metric reads no task


@pytest.mark.parametrize("metric", ["nll", "choice_nll"])
def test_choices_with_their_own_contexts_hand_no_clean_forward_on(metric):
    """Off the shared context the attribution's batches are not the prefix scorer's: no sink is handed on, and the
    attribution runs (before round 28 a prior-guided run of such a task raised in its first batch)."""
    from capsense.localize.evaluator import MaskEvaluator

    model = make_tiny_model("llama")
    probe = choice_probe(n_docs=4)
    probe.context_ids[1] = probe.context_ids[1] + [5]  # one choice's context differs: no shared context
    evaluator = MaskEvaluator(model, {"mc": probe}, 16, 1, True)
    scorers = attribution_scorers(model, {"mc": probe}, 16, metrics={"mc": metric})
    sinks = evaluator.clean_sinks({"mc": scorers["mc"].batch_keys()})
    assert evaluator.scorers["mc"].reuses_prefix and sinks == {} and evaluator.folded_share == 0
    att = attribute_probes(model, {"mc": probe}, sinks=sinks, scorers=scorers)["mc"]
    assert att.nll == pytest.approx(evaluator(np.zeros((1, N_LAYERS * N_HEADS), dtype=bool))[0]["mc"][metric], abs=1e-5)

"""Prefix reuse for multiple choice: knockouts replayed from their first layer equal full requests."""

from __future__ import annotations

import numpy as np
import torch

from capsense.core.arch import arch_spec, unwrap
from capsense.scoring.probe import ProbeScorer
from capsense.scoring.shared_context import SharedContextScorer
from capsense.scoring.shared_prefix import SharedPrefixScorer
from conftest import N_HEADS, N_LAYERS, make_tiny_model
from test_prefix import _masks as _singles_and_pairs  # the clean model, every head alone, two layers at once
from test_shared_context import _mc_probe

SHARED_ON = ("llama", "qwen2", "qwen3", "olmo2", "gpt_neox", "gpt2", "phi3")  # shared context enabled (test_shared_context)


def test_shared_prefix_equals_full_requests(arch):
    model = make_tiny_model(arch)
    probe = _mc_probe(n_docs=5, n_choices=3)
    ko = _singles_and_pairs()
    full = ProbeScorer(model, probe, batch_size=6).score(ko)
    fast = SharedPrefixScorer(model, probe, batch_size=6)
    got = fast.score(ko)
    np.testing.assert_allclose(got["nll"], full["nll"], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(got["acc"], full["acc"])
    assert np.ptp(full["nll"]) > 1e-3  # the knockouts do change the scores
    if arch in SHARED_ON:
        assert fast.reuses_prefix, f"{arch}: multiple-choice prefix reuse fell back to the whole forward"


def test_check_replay_runs_the_cache_rebuild_check_before_any_knockout(monkeypatch):
    """``check_replay`` (called by ``MaskEvaluator.check_scorers`` before anything is priced) decides reuse: a
    failing rebuild turns it off there, a passing one leaves it on with the check done, so a knockout scored
    later prices as the search assumed. (Round 39's version ran a clean pass and left the check to the first
    knockout.)"""
    model = make_tiny_model("llama")
    probe = _mc_probe(n_docs=3, n_choices=2, seed=3)
    passing = SharedPrefixScorer(model, probe, batch_size=4)
    passing.check_replay()
    assert passing.reuses_prefix and passing._reuse_checked
    monkeypatch.setattr(SharedPrefixScorer, "_replay_matches", lambda self, clean: False)
    failing = SharedPrefixScorer(model, probe, batch_size=4)
    assert failing.reuses_prefix  # before its check
    failing.check_replay()
    assert failing.enabled and not failing.reuses_prefix


def test_under_autocast_multiple_choice_reuse_survives_its_checks(arch):
    """Under bfloat16 autocast the shared-context and cache-rebuild checks pass where they pass in float32, and
    the replayed knockouts equal the full requests run under it."""
    model = make_tiny_model(arch)
    probe = _mc_probe(n_docs=5, n_choices=3)
    ko = _singles_and_pairs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = SharedPrefixScorer(model, probe, batch_size=6)
        fast.checked()
        fast.check_replay()
        if arch in SHARED_ON:
            assert fast.reuses_prefix, f"{arch}: a check failed under autocast"
        got = fast.score(ko)
        full = ProbeScorer(model, probe, batch_size=6).score(ko)
    np.testing.assert_allclose(got["nll"], full["nll"], atol=0.05, rtol=0)  # bf16 products: a cached context vs none


def test_a_late_knockout_runs_only_the_late_blocks():
    model = make_tiny_model("llama")
    probe = _mc_probe(n_docs=4, n_choices=4, seed=2)
    scorer = SharedPrefixScorer(model, probe, batch_size=8)
    scorer.score()  # the clean model: records both passes
    blocks = unwrap(model).get_submodule(arch_spec(unwrap(model)).layers)
    calls = [0] * len(blocks)
    hooks = [b.register_forward_pre_hook(lambda *_a, i=i: calls.__setitem__(i, calls[i] + 1)) for i, b in enumerate(blocks)]
    ko = torch.zeros(1, N_LAYERS, N_HEADS, dtype=torch.bool)
    ko[0, N_LAYERS - 1, 1] = True
    try:
        got = scorer.score(ko)
    finally:
        for h in hooks:
            h.remove()
    assert calls[: N_LAYERS - 1] == [0] * (N_LAYERS - 1)
    assert calls[-1] == 2 * 2  # two batches of two documents, a context pass and a choices pass each
    full = ProbeScorer(model, probe, batch_size=8).score(ko)
    np.testing.assert_allclose(got["nll"], full["nll"], atol=1e-5, rtol=0)


def test_a_failed_replay_check_turns_reuse_off_and_stays_exact(monkeypatch):
    model = make_tiny_model("llama")
    probe = _mc_probe(n_docs=3, n_choices=2, seed=3)
    monkeypatch.setattr(SharedPrefixScorer, "_replay_matches", lambda self, clean: False)
    scorer = SharedPrefixScorer(model, probe, batch_size=4)
    ko = _singles_and_pairs()
    got = scorer.score(ko)
    assert scorer.enabled and not scorer.reuses_prefix  # still shared context, no prefix reuse
    want = SharedContextScorer(model, probe, batch_size=4).score(ko)
    np.testing.assert_allclose(got["nll"], want["nll"], atol=1e-6, rtol=0)


def test_the_evaluator_picks_it_and_prices_its_knockouts_by_layers_run():
    from capsense.localize.evaluator import MaskEvaluator, scorer_class
    from capsense.scoring.shared_context import SharedContextScorer as Plain

    probe = _mc_probe(n_docs=3, n_choices=2)
    assert scorer_class(probe, 1, True) is SharedPrefixScorer
    assert scorer_class(probe, 1, False) is Plain
    model = make_tiny_model("llama")
    ev = MaskEvaluator(model, {"mc": probe}, batch_size=4, masks_per_forward=1, prefix_reuse=True)
    ev(np.zeros((1, N_LAYERS * N_HEADS), dtype=bool))
    assert ev.reuse_share == 1.0
    last_layer_head = (N_LAYERS - 1) * N_HEADS
    assert ev.cost([last_layer_head]) == 1.0 / N_LAYERS


def test_the_attributions_forward_is_the_clean_one(arch, monkeypatch):
    """Where the shared context is on, the attribution's forward fills the clean cache: the same clean
    scores as the scorer's own, no second clean capture, and knockouts equal full requests."""
    import pytest

    from capsense.errors import CapsenseError
    from capsense.scoring.attribution import attribute_probes

    model = make_tiny_model(arch)
    probe = _mc_probe(n_docs=5, n_choices=3)
    ko = _singles_and_pairs()
    taker = SharedPrefixScorer(model, probe, batch_size=6)
    if not taker.can_take_clean():
        assert arch not in SHARED_ON
        with pytest.raises(CapsenseError, match="failed its check"):  # no sink where the shared context is off
            attribute_probes(model, {"mc": probe}, batch_size=6, sinks={"mc": taker.take_clean})
        return
    attribute_probes(model, {"mc": probe}, batch_size=6, sinks={"mc": taker.take_clean})
    monkeypatch.setattr(taker, "_capture", lambda *a: pytest.fail("a second clean forward ran"))
    full = ProbeScorer(model, probe, batch_size=6).score(ko)
    clean = taker.score()
    np.testing.assert_allclose(clean["nll"], full["nll"][:1], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(clean["acc"], full["acc"][:1])
    got = taker.score(ko)
    assert taker.reuses_prefix, f"{arch}: the taken passes failed the replay check"
    np.testing.assert_allclose(got["nll"], full["nll"], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(got["acc"], full["acc"])

"""The mask evaluator's clean forward taken from the attribution: which probes, and its cost."""

from __future__ import annotations

import numpy as np
import pytest

from capsense.localize.evaluator import MaskEvaluator
from capsense.scoring.attribution import attribute_probes
from capsense.scoring.cost import FORWARD
from conftest import choice_probe, loglik_probe, make_tiny_model


def test_both_probe_kinds_take_the_attributions_forward_and_the_clean_cost_follows():
    """Log-likelihood and (since round 12, on the shared context) multiple-choice probes take the
    attribution's forward as their clean one, so the clean model costs nothing more; without prefix
    reuse neither takes it; the clean scores equal a plain evaluator's."""
    model = make_tiny_model("llama")
    probes = {"toy": loglik_probe(), "mc": choice_probe()}
    plain = MaskEvaluator(model, probes, batch_size=4, masks_per_forward=1, prefix_reuse=True)
    folded = MaskEvaluator(model, probes, batch_size=4, masks_per_forward=1, prefix_reuse=True)
    assert folded.cost([]) == FORWARD
    assert MaskEvaluator(model, probes, batch_size=4, masks_per_forward=1, prefix_reuse=False).clean_sinks() == {}
    sinks = folded.clean_sinks()
    assert set(sinks) == {"toy", "mc"}
    assert folded.folded_share == pytest.approx(1.0)
    assert folded.cost([]) == pytest.approx(0.0) and folded.cost([5]) == plain.cost([5])  # knockouts cost the same
    attribute_probes(model, probes, batch_size=4, sinks=sinks)
    clean = np.zeros((1, model.config.num_hidden_layers * model.config.num_attention_heads), dtype=bool)
    got, want = folded(clean)[0], plain(clean)[0]
    for task in probes:
        assert got[task]["nll"] == pytest.approx(want[task]["nll"], abs=1e-6)
        assert got[task]["acc"] == want[task]["acc"]

"""The mask evaluator's clean forward taken from the attribution: which probes, and its cost."""

from __future__ import annotations

import numpy as np
import pytest

from capsense.localize.evaluator import MaskEvaluator
from capsense.scoring.attribution import attribute_probes
from capsense.scoring.cost import FORWARD
from conftest import choice_probe, loglik_probe, make_tiny_model


def test_only_log_likelihood_probes_take_the_attributions_forward_and_the_clean_cost_follows():
    """Multiple choice: the attribution scores only the gold choices, so its clean forward still runs
    and is still paid for; the clean scores of both kinds equal a plain evaluator's."""
    model = make_tiny_model("llama")
    probes = {"toy": loglik_probe(), "mc": choice_probe()}
    plain = MaskEvaluator(model, probes, batch_size=4, masks_per_forward=1, prefix_reuse=True)
    folded = MaskEvaluator(model, probes, batch_size=4, masks_per_forward=1, prefix_reuse=True)
    assert folded.cost([]) == FORWARD
    sinks = folded.clean_sinks()
    assert set(sinks) == {"toy"}
    tokens = {n: sum(len(x) for x in s._inputs) for n, s in folded.scorers.items()}
    assert folded.folded_share == pytest.approx(tokens["toy"] / sum(tokens.values()))
    assert 0 < folded.cost([]) < FORWARD and folded.cost([5]) == plain.cost([5])  # knockouts cost the same
    attribute_probes(model, probes, batch_size=4, sinks=sinks)
    clean = np.zeros((1, model.config.num_hidden_layers * model.config.num_attention_heads), dtype=bool)
    got, want = folded(clean)[0], plain(clean)[0]
    for task in probes:
        assert got[task]["nll"] == pytest.approx(want[task]["nll"], abs=1e-6)
        assert got[task]["acc"] == want[task]["acc"]

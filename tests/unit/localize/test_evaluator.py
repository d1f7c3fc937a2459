"""The mask evaluator's clean forward taken from the attribution: which probes, and its cost."""

from __future__ import annotations

import numpy as np
import pytest

from capsense.localize.evaluator import MaskEvaluator
from capsense.scoring.attribution import attribute_probes
from capsense.scoring.cost import FORWARD
from capsense.scoring.probe import Probe
from conftest import VOCAB, make_tiny_model


def _loglik(n: int = 5) -> Probe:
    rng = np.random.default_rng(0)
    ctx = [rng.integers(4, VOCAB, rng.integers(4, 12)).tolist() for _ in range(n)]
    cont = [rng.integers(4, VOCAB, rng.integers(1, 4)).tolist() for _ in range(n)]
    return Probe("toy", "loglikelihood", ctx, cont, np.arange(n), list(range(n)))


def _choice(n_docs: int = 3) -> Probe:
    rng = np.random.default_rng(1)
    ctx, cont, doc_of, choice_of = [], [], [], []
    for d in range(n_docs):
        c = rng.integers(4, VOCAB, 6).tolist()
        for j in range(3):
            ctx.append(c)
            cont.append(rng.integers(4, VOCAB, rng.integers(1, 3)).tolist())
            doc_of.append(d)
            choice_of.append(j)
    return Probe("mc", "multiple_choice", ctx, cont, np.array(doc_of), list(range(n_docs)),
                 gold=rng.integers(0, 3, n_docs), choice_of=np.array(choice_of))


def test_only_log_likelihood_probes_take_the_attributions_forward_and_the_clean_cost_follows():
    """Multiple choice: the attribution scores only the gold choices, so its clean forward still runs
    and is still paid for; the clean scores of both kinds equal a plain evaluator's."""
    model = make_tiny_model("llama")
    probes = {"toy": _loglik(), "mc": _choice()}
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

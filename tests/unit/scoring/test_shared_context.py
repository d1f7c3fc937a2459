"""Shared-context scoring of multiple-choice probes equals scoring every request in full."""

from __future__ import annotations

import numpy as np
import torch

from capsense.scoring.probe import Probe, ProbeScorer
from capsense.scoring.shared_context import SharedContextScorer, shared_context_groups
from conftest import N_HEADS, N_LAYERS, VOCAB, make_tiny_model


def _mc_probe(n_docs: int = 5, n_choices: int = 4, seed: int = 0) -> Probe:
    rng = np.random.default_rng(seed)
    ctx, cont, doc_of, choice_of = [], [], [], []
    for d in range(n_docs):
        c = rng.integers(4, VOCAB, rng.integers(4, 15)).tolist()  # contexts of different lengths
        for j in range(n_choices):
            ctx.append(c)
            cont.append(rng.integers(4, VOCAB, rng.integers(1, 5)).tolist())  # choices of different lengths
            doc_of.append(d)
            choice_of.append(j)
    gold = rng.integers(0, n_choices, n_docs)
    return Probe("mc", "multiple_choice", ctx, cont, np.array(doc_of), list(range(n_docs)), gold, np.array(choice_of))


def _masks(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ko = torch.rand(6, N_LAYERS, N_HEADS, generator=g) < 0.25
    ko[0] = False  # the clean model too
    return ko


def test_shared_context_equals_full_requests(arch):
    model = make_tiny_model(arch)
    probe = _mc_probe()
    full = ProbeScorer(model, probe, batch_size=6).score(_masks())
    shared = SharedContextScorer(model, probe, batch_size=6)  # 6 // 4 = 1 document per batch
    got = shared.score(_masks())
    np.testing.assert_allclose(got["nll"], full["nll"], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(got["acc"], full["acc"])
    if arch in ("llama", "qwen2", "qwen3", "olmo2", "gpt_neox", "gpt2", "phi3"):
        assert shared.enabled, f"{arch}: shared-context scoring fell back to full requests"


def test_several_documents_per_batch():
    model = make_tiny_model("llama")
    probe = _mc_probe(n_docs=7, n_choices=3, seed=1)
    full = ProbeScorer(model, probe, batch_size=16).score(_masks(1))
    shared = SharedContextScorer(model, probe, batch_size=16)  # 5 documents per batch, padded contexts
    np.testing.assert_allclose(shared.score(_masks(1))["nll"], full["nll"], atol=1e-5, rtol=0)
    assert shared.enabled


def test_groups_need_one_context_per_document():
    p = _mc_probe(n_docs=2, n_choices=2)
    assert shared_context_groups(p) == [[0, 1], [2, 3]]
    p.context_ids[1] = p.context_ids[1] + [5]  # a choice whose context differs
    assert shared_context_groups(p) is None
    ll = Probe("ll", "loglikelihood", [[5, 6]], [[7]], np.array([0]), [0])
    assert shared_context_groups(ll) is None
    model = make_tiny_model("llama")
    assert not SharedContextScorer(model, p, batch_size=4).enabled

"""Prefix reuse: scores equal the full forward (fp32, <= 1e-5) on every architecture."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from capsense.scoring.prefix import PrefixReuseScorer
from capsense.scoring.probe import Probe, ProbeScorer
from conftest import N_HEADS, N_LAYERS, VOCAB, make_tiny_model


def _probe(n: int = 6, seed: int = 0) -> Probe:
    rng = np.random.default_rng(seed)
    ctx = [rng.integers(4, VOCAB, rng.integers(5, 14)).tolist() for _ in range(n)]
    cont = [rng.integers(4, VOCAB, rng.integers(1, 4)).tolist() for _ in range(n)]
    return Probe("toy", "loglikelihood", ctx, cont, np.arange(n), list(range(n)))


def _masks() -> torch.Tensor:
    ko = torch.zeros(1 + N_LAYERS * N_HEADS + 1, N_LAYERS, N_HEADS, dtype=torch.bool)
    for i in range(N_LAYERS * N_HEADS):
        ko[1 + i].view(-1)[i] = True
    ko[-1, 1, 2] = ko[-1, 2, 0] = True  # two layers at once
    return ko


def test_prefix_reuse_equals_full_forward(arch):
    _check_prefix_reuse(arch)


@pytest.mark.parametrize("arch", ["phi", "mixtral", "gpt_oss", "cohere2"])
def test_prefix_reuse_on_more_families(arch):
    """Families outside ``ARCHS``: Phi-2's final norm is ``final_layernorm``; two MoE; Cohere 2."""
    _check_prefix_reuse(arch)


def _check_prefix_reuse(arch):
    model = make_tiny_model(arch)
    probe = _probe()
    full = ProbeScorer(model, probe, batch_size=4).score(_masks())
    reuse = PrefixReuseScorer(model, probe, batch_size=4)
    fast = reuse.score(_masks())
    assert reuse.enabled, f"prefix reuse fell back to the full forward on {arch}"
    np.testing.assert_allclose(fast["nll"], full["nll"], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(fast["acc"], full["acc"])
    assert np.ptp(full["nll"]) > 1e-3  # the knockouts do change the scores


def test_under_autocast_the_replay_check_passes_and_equals_the_full_forward(arch):
    """Under bfloat16 autocast (``--autocast``) the replay runs the same products as the full forward: the check run
    ahead of pricing (``check_replay``) keeps reuse on, and every knockout's scores equal the full forward's."""
    model = make_tiny_model(arch)
    probe = _probe()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reuse = PrefixReuseScorer(model, probe, batch_size=4)
        reuse.check_replay()
        assert reuse.enabled and reuse._checked, f"the replay check failed under autocast on {arch}"
        fast = reuse.score(_masks())
        full = ProbeScorer(model, probe, batch_size=4).score(_masks())
    np.testing.assert_allclose(fast["nll"], full["nll"], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(fast["acc"], full["acc"])


def test_prefix_reuse_falls_back_with_many_masks_per_forward():
    model = make_tiny_model("llama")
    probe = _probe()
    scorer = PrefixReuseScorer(model, probe, batch_size=4, masks_per_forward=2)
    assert not scorer.enabled
    np.testing.assert_allclose(
        scorer.score(_masks())["nll"], ProbeScorer(model, probe, batch_size=4).score(_masks())["nll"], atol=1e-5
    )


def test_clean_forward_taken_from_the_attribution_equals_its_own(arch, monkeypatch):
    """The attribution's forward (every multiplier 1) as the clean one: the same clean scores, and
    knockouts replayed from its block inputs equal those from the scorer's own clean capture."""
    import pytest

    from capsense.errors import CapsenseError
    from capsense.scoring.attribution import attribute_probes

    model = make_tiny_model(arch)
    probe = _probe()
    own = PrefixReuseScorer(model, probe, batch_size=4)
    expected = own.score(_masks())
    taker = PrefixReuseScorer(model, probe, batch_size=4)
    attribute_probes(model, {"toy": probe}, batch_size=4, sinks={"toy": taker.take_clean})
    monkeypatch.setattr(taker, "_capture", lambda *a: pytest.fail("a second clean forward ran"))
    clean = taker.score()
    np.testing.assert_allclose(clean["nll"], expected["nll"][:1], atol=1e-6, rtol=0)
    np.testing.assert_array_equal(clean["acc"], expected["acc"][:1])
    got = taker.score(_masks())
    assert taker.enabled, f"the taken prefix failed the replay check on {arch}"
    np.testing.assert_allclose(got["nll"], expected["nll"], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(got["acc"], expected["acc"])
    with pytest.raises(CapsenseError, match="does not run"):  # a batch of another size is not this scorer's
        taker.take_clean([0, 1], None, None, np.zeros(2), np.zeros(2, dtype=bool))

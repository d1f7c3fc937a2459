"""Prefix reuse: scores equal the full forward (fp32, <= 1e-5) on every architecture."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from capsense.scoring.logits import scored_hidden
from capsense.scoring.prefix import PrefixReuseScorer
from capsense.scoring.probe import Probe, ProbeScorer
from conftest import ARCHS, N_HEADS, N_LAYERS, VOCAB, make_tiny_model


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


def _recorded_batch(model):
    """A right-padded batch of four documents of different lengths, recorded block by block: (replay, final hidden)."""
    from capsense.core.replay import BlockReplay
    from capsense.scoring.probe import pad_right

    rng = np.random.default_rng(3)
    ids, att = pad_right([rng.integers(4, VOCAB, n).tolist() for n in (13, 11, 8, 5)], 0)
    replay = BlockReplay(model)
    with torch.no_grad():
        return replay, replay.record(lambda: scored_hidden(model, ids, att))


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", [*ARCHS, "mixtral", "gpt_oss", "cohere2", "phi"])
def test_a_replay_of_some_rows_equals_those_rows_of_the_whole_replay(arch, attention):
    """``BlockReplay.rows``: the padded batch's first and last rows (every argument indexed by row sliced: masks,
    positions, rotary tables) replay from any block to what the whole batch's replay gives those rows."""
    try:
        model = make_tiny_model(arch, attn_implementation=attention)
    except ValueError as e:
        if "does not support" not in str(e):
            raise
        pytest.skip(f"{arch} has no {attention} attention")
    replay, _ = _recorded_batch(model)
    with torch.no_grad():
        for start in (0, N_LAYERS - 1):
            whole = replay.run_from(start)
            part = replay.rows([0, 3]).run_from(start)
            assert part.shape[0] == 2
            torch.testing.assert_close(part, whole[[0, 3]], atol=1e-5, rtol=1e-5)
    assert replay.inputs[0][0].hidden.shape[0] == 4  # the view left the recording whole


def _replayed_rows(scorer, monkeypatch) -> list[int]:
    """The number of rows of every replay the scorer runs from here on."""
    seen, replay = [], scorer._replay
    monkeypatch.setattr(scorer, "_replay", lambda calls, start: seen.append(calls.inputs[start][0].hidden.shape[0])
                        or replay(calls, start))
    return seen


def test_the_replay_check_replays_two_rows_of_the_first_batch(arch, monkeypatch):
    """The check before pricing (``check_replay``) replays the first batch's longest and most padded rows only,
    not the whole batch (round 44: on the main job the whole-batch checks cost about one forward-equivalent)."""
    scorer = PrefixReuseScorer(make_tiny_model(arch), _probe(), batch_size=4)
    seen = _replayed_rows(scorer, monkeypatch)
    scorer.check_replay()
    assert scorer.enabled and scorer._checked, f"the replay check failed on {arch}"
    assert seen == [2]


def test_in_reduced_precision_the_rows_are_checked_against_their_own_forward(arch, monkeypatch):
    """Under autocast two rows round unlike the whole batch (on the real model every probe's rows missed the recorded
    ones), so their replay is compared with the model's own forward of the two rows: it passes on every architecture
    without replaying the whole batch, and a replay that differs from that forward is caught."""
    from capsense.scoring import prefix

    scorer = PrefixReuseScorer(make_tiny_model(arch), _probe(), batch_size=4)
    seen = _replayed_rows(scorer, monkeypatch)
    forwards = []
    monkeypatch.setattr(prefix, "scored_hidden", lambda m, ids, att: forwards.append(ids.shape[0]) or scored_hidden(m, ids, att))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scorer.check_replay()
    assert scorer.enabled and scorer._checked, f"the replay check failed under autocast on {arch}"
    assert seen == [2] and forwards == [4, 2]  # the batch's capture, then the two rows' own forward

    wrong = PrefixReuseScorer(make_tiny_model(arch), _probe(), batch_size=4)
    seen = _replayed_rows(wrong, monkeypatch)
    monkeypatch.setattr(prefix, "scored_hidden", lambda m, ids, att: scored_hidden(m, ids, att) + (ids.shape[0] == 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        wrong.check_replay()
    assert seen == [2, 4] and wrong.enabled  # the rows missed, the whole batch decided against its recorded output


@pytest.mark.parametrize("failure", ["raises", "differs"])
def test_where_two_rows_do_not_replay_the_whole_batch_decides(failure, monkeypatch):
    """Rows that cannot be sliced (an error) or that replay wrong (an argument indexed by row that the view does not
    slice) turn reuse off only if the whole batch does not replay either."""
    from capsense.core.replay import BlockReplay

    def rows(self, index):
        if failure == "raises":
            raise RuntimeError("a mask that is no tensor")
        return BlockReplay.rows.__wrapped__(self, [index[0], index[0]])  # the wrong rows

    rows.__wrapped__ = BlockReplay.rows
    monkeypatch.setattr(BlockReplay, "rows", rows)
    probe = _probe()
    scorer = PrefixReuseScorer(make_tiny_model("llama"), probe, batch_size=4)
    seen = _replayed_rows(scorer, monkeypatch)
    scorer.check_replay()
    assert scorer.enabled and scorer._checked
    assert seen == ([4] if failure == "raises" else [2, 4])
    np.testing.assert_allclose(scorer.score(_masks())["nll"],
                               ProbeScorer(make_tiny_model("llama"), probe, batch_size=4).score(_masks())["nll"], atol=1e-5)

"""Pruning, RTN and low-rank methods against hand computations and their defining properties."""

from __future__ import annotations

import pytest
import torch

from capsense.compress.calibration import InputStats, collect_stats
from capsense.compress.lowrank import asvd, factorize, rank_for_ratio, reconstruct, stable_rank, svd_llm, svd_truncate
from capsense.compress.prune import (
    apply_mask,
    global_masks,
    magnitude_scores,
    mask_from_scores,
    wanda_scores,
)
from capsense.compress.quantize import rtn_bits, rtn_quantize
from capsense.compress.targets import Target
from capsense.errors import CapsenseError


def _w(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- magnitude ------------------------------------------------------------------------------

@pytest.mark.parametrize("density", [0.9, 0.5, 0.25, 1.0])
def test_magnitude_row_keeps_largest_per_row(density):
    w = _w(7, 40)
    mask = mask_from_scores(magnitude_scores(w), density, "row")
    k = round(density * 40)
    for i in range(7):
        assert int(mask[i].sum()) == k
        kept, dropped = w[i].abs()[mask[i]], w[i].abs()[~mask[i]]
        if dropped.numel():
            assert kept.min() >= dropped.max()
    pruned = apply_mask(w, mask)
    assert torch.equal(pruned[mask], w[mask]) and bool((pruned[~mask] == 0).all())


@pytest.mark.parametrize("density", [0.8, 0.5, 0.1])
def test_magnitude_matrix_and_global_keep_largest(density):
    w = _w(6, 30)
    mask = mask_from_scores(magnitude_scores(w), density, "matrix")
    assert int(mask.sum()) == round(density * w.numel())
    assert w.abs()[mask].min() >= w.abs()[~mask].max()
    ws = [_w(5, 8, seed=1) * 3, _w(4, 10, seed=2)]
    masks = global_masks([magnitude_scores(x) for x in ws], density)
    total = sum(x.numel() for x in ws)
    assert sum(int(m.sum()) for m in masks) == round(density * total)
    kept = torch.cat([x.abs()[m] for x, m in zip(ws, masks)])
    dropped = torch.cat([x.abs()[~m] for x, m in zip(ws, masks)])
    assert kept.min() >= dropped.max()
    # global: the larger-scaled matrix keeps more than its share
    assert masks[0].float().mean() > masks[1].float().mean()


def test_protected_columns_are_kept_on_top_of_the_density():
    w = _w(4, 20) * 10
    prot = torch.zeros(20, dtype=torch.bool)
    prot[:4] = True
    w[:, :4] = 1e-6  # the smallest weights: magnitude alone would drop them
    mask = mask_from_scores(magnitude_scores(w), 0.5, "row", prot)
    assert bool(mask[:, :4].all())
    assert (mask[:, 4:].sum(1) == 8).all()  # the 16 free columns keep exactly 50% among themselves
    mask = mask_from_scores(magnitude_scores(w), 0.1, "row", prot)
    assert bool(mask[:, :4].all()) and (mask[:, 4:].sum(1) == round(0.1 * 16)).all()


# -- Wanda ----------------------------------------------------------------------------------

def test_wanda_matches_hand_computation_with_known_activations():
    # one linear layer, 3 inputs, 2 outputs; activations chosen by hand
    layer = torch.nn.Linear(3, 2, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, -2.0, 0.5], [-0.3, 0.2, 4.0]]))
    x = torch.tensor([[3.0, 0.0, 0.0], [4.0, 1.0, 0.1], [0.0, 0.0, 0.0]])  # feature norms: 5, 1, 0.1
    target = Target("layer", 0, "mlp", "layer", layer, False)

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, input_ids, use_cache=False):
            return self.layer(x[input_ids[0]])

    stats = collect_stats(Wrap(), [target], [[0, 1, 2]])["layer"]
    assert torch.allclose(stats.input_norm, torch.tensor([5.0, 1.0, 0.1], dtype=torch.float64))
    scores = wanda_scores(layer.weight, stats.input_norm)
    # |W| * ||x||: row 0: 5, 2, 0.05; row 1: 1.5, 0.2, 0.4
    assert torch.allclose(scores, torch.tensor([[5.0, 2.0, 0.05], [1.5, 0.2, 0.4]]))
    mask = mask_from_scores(scores, 2 / 3, "row")
    assert mask.tolist() == [[True, True, False], [True, False, True]]
    # magnitude alone ranks by |W| and ignores the activations
    assert mask_from_scores(magnitude_scores(layer.weight), 1 / 3, "row").tolist() == [[False, True, False], [False, False, True]]


# -- RTN ------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits,group", [(2, 16), (3, 32), (4, 128), (8, 0), (3, 24)])
def test_rtn_levels_and_half_step_error(bits, group):
    w = _w(5, 96, seed=bits) * torch.linspace(0.1, 3, 96)
    q = rtn_quantize(w, bits, group)
    g = 96 if group == 0 else min(group, 96)
    for i in range(5):
        for start in range(0, 96, g):
            wg, qg = w[i, start : start + g], q[i, start : start + g]
            # the scale is max|w| / q_max rounded to bfloat16 (8 significant bits) for packing
            step = (wg.abs().max() / (2 ** (bits - 1) - 1)).to(torch.bfloat16).float()
            assert len(torch.unique(qg)) <= 2**bits
            assert (qg - wg).abs().max() <= step / 2 + 1e-6
            levels = torch.round(qg / step)
            assert torch.allclose(levels * step, qg, atol=1e-5)


def test_rtn_bits_accounting():
    assert rtn_bits((4, 256), 4, 128) == 4 * 256 * 4 + 4 * 2 * 16
    assert rtn_bits((4, 200), 3, 128) == 4 * 200 * 3 + 4 * 2 * 16  # a trailing partial group has its own scale
    assert rtn_bits((4, 200), 8, 0) == 4 * 200 * 8 + 4 * 16


# -- low-rank -------------------------------------------------------------------------------

@pytest.mark.parametrize("rank", [1, 5, 12])
def test_truncated_svd_error_is_the_discarded_singular_values(rank):
    w = _w(20, 12, seed=3)
    s = torch.linalg.svdvals(w.double())
    err = torch.linalg.matrix_norm((w.double() - svd_truncate(w.double(), rank)))
    assert torch.isclose(err, s[rank:].pow(2).sum().sqrt(), atol=1e-9)
    err2 = torch.linalg.matrix_norm((w.double() - svd_truncate(w.double(), rank)), ord=2)
    assert torch.isclose(err2, s[rank] if rank < 12 else torch.tensor(0.0, dtype=torch.float64), atol=1e-9)


def _calibration(n_in=24, tokens=400, seed=5):
    g = torch.Generator().manual_seed(seed)
    # heterogeneous feature scales and correlations, as in real activations
    scales = torch.logspace(-1, 1, n_in)
    mix = torch.eye(n_in) + 0.3 * torch.randn(n_in, n_in, generator=g)
    return (torch.randn(tokens, n_in, generator=g) * scales) @ mix


@pytest.mark.parametrize("rank", [2, 6, 10])
def test_asvd_and_svd_llm_beat_svd_on_activation_weighted_error(rank):
    w = _w(16, 24, seed=7).double()
    x = _calibration().double()
    stats = InputStats.from_inputs(x)
    errs = {
        "svd": torch.linalg.matrix_norm((w - svd_truncate(w, rank)) @ x.T),
        "asvd": torch.linalg.matrix_norm((w - asvd(w, rank, stats.abs_mean)) @ x.T),
        "svd-llm": torch.linalg.matrix_norm((w - svd_llm(w, rank, stats.gram)) @ x.T),
    }
    assert errs["asvd"] < errs["svd"]
    assert errs["svd-llm"] < errs["svd"]
    assert errs["svd-llm"] <= errs["asvd"] + 1e-9  # SVD-LLM is the optimum for this error


def test_svd_llm_is_optimal_in_the_whitened_norm():
    w = _w(10, 8, seed=9).double()
    x = _calibration(8, 200).double()
    gram = x.T @ x
    L = torch.linalg.cholesky(gram)
    rank = 3
    s = torch.linalg.svdvals(w @ L)
    err = torch.linalg.matrix_norm((w - svd_llm(w, rank, gram)) @ x.T)
    assert torch.isclose(err, s[rank:].pow(2).sum().sqrt(), rtol=1e-4)


def test_factorize_once_reconstruct_any_rank():
    w = _w(12, 9, seed=11).double()
    f = factorize(w, "svd")
    for r in (1, 4, 9):
        assert torch.allclose(reconstruct(f, r), svd_truncate(w, r))


def test_rank_for_ratio_and_errors():
    assert rank_for_ratio((576, 576), 0.9) == int(0.9 * 576 * 576 / 1152)
    assert rank_for_ratio((10, 10), 1.0) == 5
    with pytest.raises(CapsenseError, match="leaves no rank"):  # user-facing: the ratio is a user's
        rank_for_ratio((4, 4), 0.1)
    with pytest.raises(CapsenseError, match=r"outside \(0, 1\]"):
        rank_for_ratio((4, 4), 0)


def test_stable_rank():
    assert stable_rank(torch.eye(7)) == pytest.approx(7.0)
    rank1 = torch.outer(torch.arange(1.0, 5.0), torch.arange(1.0, 4.0))
    assert stable_rank(rank1) == pytest.approx(1.0, rel=1e-5)
    d = torch.diag(torch.tensor([2.0, 1.0]))
    assert stable_rank(d) == pytest.approx(5 / 4)

"""bench_attribution_cost.py: the attribution's measured cost, per precision of a float32 model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import load_bench_script, make_tiny_model

bench = load_bench_script("bench_attribution_cost")


def _probe():
    import numpy as np

    from capsense.scoring.probe import Probe

    rng = np.random.default_rng(0)
    ctx = [rng.integers(4, 60, rng.integers(5, 12)).tolist() for _ in range(5)]
    cont = [rng.integers(4, 60, 2).tolist() for _ in range(5)]
    return Probe("toy", "loglikelihood", ctx, cont, np.arange(5), list(range(5)))


def test_float32_attention_under_autocast_runs_the_kernel_in_float32_and_restores_it():
    q, k, v = (torch.randn(2, 3, 7, 8) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    original = F.scaled_dot_product_attention
    with bench.precision("autocast-attention32"):
        assert torch.is_autocast_enabled("cpu")
        got = F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True)
        plain = torch.nn.Linear(8, 8)(q)  # the products around it still run in bfloat16
    assert got.dtype == torch.bfloat16 and plain.dtype == torch.bfloat16
    exact = F.scaled_dot_product_attention(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), is_causal=True)
    torch.testing.assert_close(got, exact.bfloat16())
    assert (got.float() - want).abs().max() < 0.05
    assert F.scaled_dot_product_attention is original and not torch.is_autocast_enabled("cpu")
    with pytest.raises(ValueError, match="one of float32, autocast, autocast-attention32"):
        with bench.precision("bfloat16"):
            pass


def test_each_precision_times_the_forward_and_the_attribution():
    model = make_tiny_model("llama", attn_implementation="sdpa")
    probe = _probe()
    for name in bench.PRECISIONS:
        with bench.precision(name):
            row = bench.time_attribution(model, probe, batch_size=4, repeats=1)
        assert row["median_forward_s"] > 0 and row["median_attribution_s"] > 0
        assert row["charged_fe"] == 3


def test_a_precision_needs_a_float32_model():
    with pytest.raises(SystemExit):
        bench.main(["--precision", "float32", "--precision", "autocast", "--dtype", "bfloat16"])

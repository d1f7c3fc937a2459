"""bench_attribution_cost.py: the attribution's measured cost, per precision of a float32 model."""

from __future__ import annotations

import pytest
import torch

from conftest import load_bench_script, make_tiny_model

bench = load_bench_script("bench_attribution_cost")


def _probe():
    import numpy as np

    from capsense.scoring.probe import Probe

    rng = np.random.default_rng(0)
    ctx = [rng.integers(4, 60, rng.integers(5, 12)).tolist() for _ in range(5)]
    cont = [rng.integers(4, 60, 2).tolist() for _ in range(5)]
    return Probe("toy", "loglikelihood", ctx, cont, np.arange(5), list(range(5)))


def test_the_precisions_are_the_librarys_autocast_with_and_without_float32_attention():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model, registered = make_tiny_model("llama", attn_implementation="sdpa"), ALL_ATTENTION_FUNCTIONS["sdpa"]
    with bench.precision("autocast", model):  # as a locate run's search computes on a CPU
        assert torch.is_autocast_enabled("cpu") and ALL_ATTENTION_FUNCTIONS["sdpa"] is not registered
    with bench.precision("autocast-bf16-attention", model):  # as rounds 39-40 ran it
        assert torch.is_autocast_enabled("cpu") and ALL_ATTENTION_FUNCTIONS["sdpa"] is registered
    with bench.precision("float32", model):
        assert not torch.is_autocast_enabled("cpu")
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is registered and not torch.is_autocast_enabled("cpu")
    with pytest.raises(ValueError, match="one of float32, autocast, autocast-bf16-attention"):
        with bench.precision("bfloat16", model):
            pass


def test_each_precision_times_the_forward_and_the_attribution():
    model = make_tiny_model("llama", attn_implementation="sdpa")
    probe = _probe()
    for name in bench.PRECISIONS:
        with bench.precision(name, model):
            row = bench.time_attribution(model, probe, batch_size=4, repeats=1)
        assert row["median_forward_s"] > 0 and row["median_attribution_s"] > 0
        assert row["charged_fe"] == 3


def test_a_precision_needs_a_float32_model():
    with pytest.raises(SystemExit):
        bench.main(["--precision", "float32", "--precision", "autocast", "--dtype", "bfloat16"])


def test_each_repeat_times_every_precision_in_alternating_order(monkeypatch):
    import contextlib

    import capsense.core.models
    import capsense.scoring.probe

    model, order, current = make_tiny_model("llama", attn_implementation="sdpa"), [], []

    @contextlib.contextmanager
    def recorded(name, model):
        current.append(name)
        yield
        current.pop()

    def fake_time(self, sync=lambda: None):
        order.append(current[-1])
        return {"float32": 2.0, "autocast": 1.0}[current[-1]], {"float32": 6.0, "autocast": 3.0}[current[-1]] + len(order)

    monkeypatch.setattr(capsense.core.models, "load_model", lambda name, dtype: (model, None))
    monkeypatch.setattr(capsense.scoring.probe, "build_probe", lambda task, tok, limit, seed: _probe())
    monkeypatch.setattr(bench, "precision", recorded)
    monkeypatch.setattr(bench.Paths, "time", fake_time)
    rows = bench.measure("tiny", "toy", 5, "float32", 3, 4, ("float32", "autocast"))
    assert order == ["float32", "autocast"] + ["float32", "autocast", "autocast", "float32", "float32", "autocast"]
    assert [r["precision"] for r in rows] == ["float32", "autocast"]
    assert rows[0]["attribution_s"] == [9.0, 12.0, 13.0] and rows[1]["attribution_s"] == [7.0, 8.0, 11.0]
    assert rows[1]["forward_ratio"] == 0.5 and rows[1]["attribution_ratio"] == pytest.approx(8.0 / 12.0)

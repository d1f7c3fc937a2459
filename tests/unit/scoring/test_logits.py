"""LM-head scoring (capsense.scoring.logits)."""

from __future__ import annotations

import pytest


def test_bf16_lm_head_scores_in_float32():
    """A bf16 model's logits are computed in float32 (bf16 logits move in steps of 0.125 near 20)."""
    import types

    import torch

    from capsense.scoring.logits import VOCAB_CHUNK, output_logits

    torch.manual_seed(0)
    head = torch.nn.Linear(64, VOCAB_CHUNK + 7, bias=False).to(torch.bfloat16)  # two chunks
    model = types.SimpleNamespace(get_output_embeddings=lambda: head, config=types.SimpleNamespace())
    hidden = (4 * torch.randn(5, 64)).to(torch.bfloat16)
    exact = hidden.double() @ head.weight.double().T
    logits = output_logits(model, hidden)
    assert logits.dtype == torch.float32 and logits.shape == exact.shape
    assert (logits.double() - exact).abs().max() < 1e-4
    assert (head(hidden).double() - exact).abs().max() > 1e-3  # what the bf16 head would have returned


def _head_model(dtype, bias=True):
    import types

    import torch

    from capsense.scoring.logits import VOCAB_CHUNK

    torch.manual_seed(0)
    head = torch.nn.Linear(64, VOCAB_CHUNK + 7, bias=bias).to(dtype)
    return types.SimpleNamespace(get_output_embeddings=lambda: head, config=types.SimpleNamespace()), head


def test_float32_head_block_keeps_one_copy_and_gives_the_chunked_logits():
    """Inside ``float32_head`` a CPU bf16 head is cast once (not per call) and the logits are the chunked
    path's; the copy is dropped when the block ends, nested blocks share it, and a float32 head keeps none."""
    import torch

    import capsense.scoring.logits as L

    model, head = _head_model(torch.bfloat16)
    hidden = (4 * torch.randn(5, 64)).to(torch.bfloat16)
    with torch.no_grad():
        chunked = L.output_logits(model, hidden)
        with L.float32_head(model):
            assert set(L._FLOAT32_HEADS) == {id(head)}
            kept = L._FLOAT32_HEADS[id(head)]
            with L.float32_head(model):
                assert L._FLOAT32_HEADS[id(head)] is kept  # nested: the same copy
            assert L._FLOAT32_HEADS[id(head)] is kept  # the inner block did not drop it
            casts = []
            orig = torch.Tensor.float
            torch.Tensor.float = lambda self, *a, **k: casts.append(self.shape) or orig(self, *a, **k)
            try:
                reused = L.output_logits(model, hidden)
            finally:
                torch.Tensor.float = orig
        assert not L._FLOAT32_HEADS
    assert torch.Size([L.VOCAB_CHUNK, 64]) not in casts and torch.Size([7, 64]) not in casts  # no weight cast
    assert torch.allclose(reused, chunked, rtol=1e-6, atol=1e-5)
    f32_model, _ = _head_model(torch.float32)
    with L.float32_head(f32_model):
        assert not L._FLOAT32_HEADS


def test_float32_head_block_keeps_gradients_to_the_weight():
    """With gradients on and a weight that wants one, the kept (detached) copy is not used."""
    import torch

    import capsense.scoring.logits as L

    model, head = _head_model(torch.bfloat16, bias=False)
    hidden = (4 * torch.randn(3, 64)).to(torch.bfloat16).requires_grad_()
    with L.float32_head(model):
        L.output_logits(model, hidden).sum().backward()
    assert head.weight.grad is not None and hidden.grad is not None


@pytest.mark.parametrize("arch,overrides", [
    ("cohere", {"logit_scale": 0.25}), ("cohere2", {"logit_scale": 0.25}), ("granite", {"logits_scaling": 3.0}),
    ("granitemoe", {"logits_scaling": 3.0}), ("gemma2", {"final_logit_softcapping": 2.0}),
    ("llama", {"logit_scale": 0.25, "logits_scaling": 3.0}),  # attributes Llama's forward ignores
])
def test_scores_equal_the_models_own_logits(arch, overrides):
    """output_logits on the final hidden states equals the model's own logits, whatever its forward
    does after the head: Cohere scales them (logit_scale), Granite divides them (logits_scaling),
    Gemma 2 soft-caps them (values away from 1 here, so a missed step shows)."""
    import torch

    from capsense.scoring.logits import output_logits, scored_hidden
    from conftest import make_tiny_model, tiny_inputs

    model = make_tiny_model(arch, **overrides)
    x = tiny_inputs()
    with torch.no_grad():
        want = model(x).logits
        got = output_logits(model, scored_hidden(model, x, torch.ones_like(x)))
    assert (got - want).abs().max().item() <= 1e-5

"""LM-head scoring (capsense.scoring.logits)."""

from __future__ import annotations


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

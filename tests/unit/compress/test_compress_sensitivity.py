"""Per-head Fisher scores read every projection that computes a head's query, fused or not."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

from capsense.compress.sensitivity import head_scores
from capsense.compress.targets import find_targets, out_projection_name
from capsense.core.arch import head_layout

# The query rows of head h in each architecture's query projection, written out per model (the oracle).
QUERY_ROWS = {
    "llama": ("q_proj", lambda h, hd: range(h * hd, (h + 1) * hd)),
    "gpt2": ("c_attn", lambda h, hd: range(h * hd, (h + 1) * hd)),  # [all q | all k | all v]
    "phi3": ("qkv_proj", lambda h, hd: range(h * hd, (h + 1) * hd)),  # [all q | all k | all v]
    "gpt_neox": ("query_key_value", lambda h, hd: range(3 * h * hd, 3 * h * hd + hd)),  # per head [q, k, v]
}


@pytest.mark.parametrize("arch", list(QUERY_ROWS))
def test_query_rows_count_for_fused_qkv_projections(arch):
    """Fisher 1 on the query projection only, 0 on the output projection: each head scores the sum
    of its query rows' squared weights (gpt2, gpt_neox and phi3 used to score 0: only q_proj was read)."""
    model = make_tiny_model(arch)
    layout = head_layout(model)
    short, rows = QUERY_ROWS[arch]
    targets = [t for t in find_targets(model, "attn") if t.short == short or t.name == out_projection_name(model, t.layer)]
    fisher = {t.name: torch.zeros(t.shape) if t.name == out_projection_name(model, t.layer) else torch.ones(t.shape)
              for t in targets}
    scores = head_scores(model, targets, fisher)
    hd = layout.head_dim
    for t in targets:
        if t.short != short:
            continue
        w2 = t.get().double().pow(2)
        for h in range(layout.n_heads):
            assert scores[t.layer, h].item() == pytest.approx(w2[list(rows(h, hd))].sum().item(), rel=1e-6)  # float32 products
    assert (scores > 0).all()

"""End to end on Gemma 3 270M (slow; CI runs it): both export formats load in plain
transformers / peft and reproduce capsense's ablated logits, and ``lm_eval --model
capsense-masked`` scores every sample as stock ``--model hf`` scores the exported checkpoint.

Cheaper than ``test_export_smollm2.py``'s three lm_eval runs: the adapter is checked on logits
in this process, and lm_eval runs twice.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from test_export_smollm2 import _lm_eval
from test_smollm2 import MODELS, PROMPTS

pytestmark = pytest.mark.slow

NAME = "gemma3-270m"
(_, N_HEADS, HEAD_DIM), HEADS = MODELS[NAME]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from capsense.ship.adapter import export_adapter
    from capsense.ship.checkpoint import export_checkpoint

    out = tmp_path_factory.mktemp("gemma3-export")
    export_checkpoint(NAME, HEADS, out / "ckpt")
    export_adapter(NAME, HEADS, out / "adapter")
    yield out
    shutil.rmtree(out, ignore_errors=True)  # a 1 GB checkpoint: gone when this file's tests are done, not at the run's end


def test_gemma3_exports_reproduce_the_ablated_logits(exported):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from capsense.core.ablation import HeadAblator
    from capsense.core.models import load_model

    with safe_open(exported / "ckpt" / "model.safetensors", "pt") as f:
        w = f.get_tensor("model.layers.9.self_attn.o_proj.weight")  # L9H3: the last head's columns
    assert w.shape[1] == N_HEADS * HEAD_DIM
    assert (w[:, 3 * HEAD_DIM :] == 0).all() and (w[:, : 3 * HEAD_DIM] != 0).any()

    base, tok = load_model(NAME)
    ids = [torch.tensor([tok.encode(p)]) for p in PROMPTS]
    with torch.no_grad(), HeadAblator(base).apply(HEADS):
        ablated = [base(x).logits for x in ids]
    checkpoint = AutoModelForCausalLM.from_pretrained(exported / "ckpt", dtype=torch.float32).eval()
    with torch.no_grad():
        for x, want in zip(ids, ablated):
            assert (checkpoint(x).logits - want).abs().max().item() <= 1e-4
    del checkpoint
    adapted = PeftModel.from_pretrained(base, exported / "adapter").eval()  # IA3 on the base's own modules
    with torch.no_grad():
        for x, want in zip(ids, ablated):
            assert (adapted(x).logits - want).abs().max().item() <= 1e-4


def test_gemma3_capsense_masked_matches_the_checkpoint_sample_by_sample(exported, tmp_path):
    masked = _lm_eval("capsense-masked", f"pretrained={NAME},heads={HEADS}", tmp_path / "masked")
    from_ckpt = _lm_eval("hf", f"pretrained={exported / 'ckpt'}", tmp_path / "hf-ckpt")
    assert from_ckpt.keys() == masked.keys()
    worst = max(abs(a - b) for d in masked for a, b in zip(masked[d], from_ckpt[d]))
    assert worst <= 1e-5, worst


def test_gemma3_mean_exports_reproduce_mean_ablation(tmp_path):
    """Gemma 3's attention has no biases: a mean-ablated checkpoint turns ``attention_bias`` on (zero biases beside
    the folded means) and plain transformers reproduces capsense's mean ablation (round 33); the mean-ablation
    adapter, a LoRA whose bias carries the means, does the same in stock PEFT on the unedited base (round 36)."""
    import json

    from transformers import AutoModelForCausalLM

    from capsense.core.ablation import HeadAblator, reference_means
    from capsense.core.models import load_model
    from capsense.ship.adapter import export_adapter
    from capsense.ship.checkpoint import export_checkpoint

    result = export_checkpoint(NAME, HEADS, tmp_path / "mean", ablation="mean")
    export_adapter(NAME, HEADS, tmp_path / "mean-adapter", ablation="mean")
    assert result.metadata["attention_biases_added"] > 0
    assert json.loads((tmp_path / "mean" / "config.json").read_text())["attention_bias"] is True
    base, tok = load_model(NAME)
    ids = [torch.tensor([tok.encode(p)]) for p in PROMPTS]
    ablator = HeadAblator(base, "mean", reference_means(base, tok, "mean"))
    with torch.no_grad(), ablator.apply(HEADS):
        want = [base(x).logits for x in ids]
    with torch.no_grad():
        clean = [base(x).logits for x in ids]
    checkpoint = AutoModelForCausalLM.from_pretrained(tmp_path / "mean", dtype=torch.float32).eval()
    with torch.no_grad():
        for x, w, c in zip(ids, want, clean):
            got = checkpoint(x).logits
            assert (got - w).abs().max().item() <= 1e-4
            assert (got - c).abs().max().item() > 1e-2  # the edit is there: not the clean model
    del checkpoint
    from peft import PeftModel

    adapted = PeftModel.from_pretrained(base, tmp_path / "mean-adapter").eval()
    with torch.no_grad():
        for x, w in zip(ids, want):
            assert (adapted(x).logits - w).abs().max().item() <= 1e-4

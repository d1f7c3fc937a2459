"""recipes/bench/gpu_e2e.py: the whole job through the real commands, on a tiny config on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import load_bench_script, make_char_tokenizer


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without a GPU")
def test_exits_cleanly_without_a_gpu(tmp_path, capsys):
    assert load_bench_script("gpu_e2e").main(["--tokenizer", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    assert "no GPU here" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_cpu_smoke_locates_validates_exports_and_reloads(tmp_path):
    tok = tmp_path / "tok"
    make_char_tokenizer().save_pretrained(tok)
    out = tmp_path / "e2e"
    args = ["--tokenizer", str(tok), "--out", str(out), "--cpu-smoke", "--batch-size", "auto"]
    assert load_bench_script("gpu_e2e").main(args) == 0
    info = json.loads((out / "gpu_e2e.json").read_text())
    assert [(s["step"], s["rc"]) for s in info["steps"]] == [("locate", 0), ("validate", 0), ("export", 0)]
    assert info["locate"]["forward_equivalents"] > 0 and len(info["locate"]["top5"]) == 5
    assert info["locate"]["batch_size"] == info["locate"]["attribution_batch_size"] == 16  # auto on a CPU
    for dtype in ("bfloat16", "float32"):
        agree = info["export_agreement"][dtype]
        # the exported checkpoint is the run-time ablation, and differs from the unablated base
        assert agree["max_abs_dlogit"] < 1e-5 < agree["vs_unablated_base"]


def test_cpu_smoke_under_mean_ablation_carries_the_runs_ablation_to_validate_and_export(tmp_path):
    """``--ablation mean``: validate and export apply the run's ablation with no flag, and the bf16 checkpoint is the
    run-time mean ablation up to its bias's bf16 rounding (round 34 on an H100: 3.9e-3 in float32)."""
    tok = tmp_path / "tok"
    make_char_tokenizer().save_pretrained(tok)
    out = tmp_path / "e2e"
    assert load_bench_script("gpu_e2e").main(["--tokenizer", str(tok), "--out", str(out), "--cpu-smoke",
                                              "--ablation", "mean"]) == 0
    info = json.loads((out / "gpu_e2e.json").read_text())
    assert info["locate"]["ablation"] == "mean"
    assert "ablation: mean" in next((out / "validate").glob("*.md")).read_text()
    exported = json.loads((out / "export" / "capsense.json").read_text())
    assert exported["ablation"] == "mean" and exported["torch_dtype"] == "bfloat16"
    agree = info["export_agreement"]["float32"]
    assert agree["max_abs_dlogit"] < 0.05 * agree["vs_unablated_base"]
    assert "stored in bfloat16" in (out / "export" / "README.md").read_text()

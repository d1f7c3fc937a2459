"""recipes/bench/adapter_parity.py: an exported adapter scores every sample as capsense-masked does, in lm-eval."""

from __future__ import annotations

import json

import pytest
from conftest import load_bench_script

from _toy_task import TOY_TASK, make_toy_setup


@pytest.mark.parametrize("ablation", ["mean", "zero"])
def test_adapter_scores_every_sample_as_capsense_masked(ablation, tmp_path, capsys):
    mod = load_bench_script("adapter_parity")
    model, tasks = make_toy_setup(tmp_path)
    out = tmp_path / "parity.json"
    assert mod.main(["--model", str(model), "--heads", "L0H1+L2H0+L2H3", "--ablation", ablation, "--task", TOY_TASK,
                     "--limit", "8", "--include-path", str(tasks), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    other = "zero" if ablation == "mean" else "mean"
    assert result["documents"] == 8 and result["adapter_bytes"] > 0
    assert result["largest_difference"][f"capsense-masked {ablation}"] <= 1e-4
    assert result["largest_difference"][f"capsense-masked {other}"] > 1e-3  # the comparison can fail
    assert f"{ablation}-ablation adapter" in capsys.readouterr().out

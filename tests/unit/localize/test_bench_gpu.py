"""recipes/bench/bench_gpu.py: a clean exit without a GPU, and an end-to-end run on a tiny CPU config."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import load_bench_script


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without a GPU")
def test_exits_cleanly_without_a_gpu(capsys, tmp_path):
    assert load_bench_script("bench_gpu").main(["--out", str(tmp_path / "x.json")]) == 0
    assert "no GPU here" in capsys.readouterr().out
    assert not (tmp_path / "x.json").exists()


def test_cpu_smoke_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "smoke.json"
    assert load_bench_script("bench_gpu").main(["--cpu-smoke", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"][0]
    assert res["model"] == "tiny" and res["auto_masks_per_forward"] == 1
    assert [r["masks_per_forward"] for r in res["capsense"]] == [1, 2]
    assert all(r["evaluations_per_s"] > 0 for r in res["capsense"]) and res["reference"]["evaluations_per_s"] > 0
    assert "reference (reload, bs 1)" in capsys.readouterr().out
    sizes = res["batch_sizes"]  # one mask per forward at 2 requests and at auto (16 on a CPU), the same masks
    assert [(b["batch_size"], b["resolved"]) for b in sizes] == [("2", 2), ("auto", 16)]
    assert sizes[0]["nll"] == pytest.approx(sizes[1]["nll"], abs=1e-5) and sizes[1]["vs_first"] > 0
    # float32 on the CPU: run-time masks equal heads zeroed in the weights, packed or not
    agree = res["agreement"]
    assert agree["vs_weights_max_abs_dnll"] < 1e-4 and agree["nll_scale"] > 1.0
    assert set(agree["packing_max_abs_dnll"]) == {"2"} and agree["packing_max_abs_dnll"]["2"] < 1e-4
    att = res["attribution"]  # the attribution timed against a clean forward of the same requests
    assert att["charged_fe"] == 3 and len(att["forward_s"]) == len(att["attribution_s"]) == 3
    assert att["measured_fe"] == pytest.approx(att["median_attribution_s"] / att["median_forward_s"])
    assert att["median_attribution_s"] > 0 and att["median_forward_s"] > 0
    solve = json.loads(out.read_text())["solve"][0]  # GPTQ/SparseGPT timed (on the CPU alone here)
    assert solve["shape"] == "64x256" and set(solve["gptq"]) == set(solve["sparsegpt"]) == {"cpu"}
    assert 0 < solve["gptq"]["cpu"]["relative_output_error"] < solve["sparsegpt"]["cpu"]["relative_output_error"] < 0.5


def test_solve_bench_compares_devices_and_refuses_a_missing_gpu(tmp_path, capsys):
    mod = load_bench_script("bench_gptq_solve")
    row = mod.run_shape("32x128", (32, 128), ["cpu"], 256)
    assert row["gptq"]["cpu"]["seconds"] >= 0 and 0 < row["gptq"]["cpu"]["relative_output_error"] < 0.05
    assert mod.parse_shape("llama-3.1-70b") == ("llama-3.1-70b", (8192, 28672))
    assert mod.main(["--devices", "cpu,cpu", "--out", str(tmp_path / "x.json")]) == 2
    if not torch.cuda.is_available():
        assert mod.main(["--devices", "cpu,cuda", "--out", str(tmp_path / "x.json")]) == 2
    assert "give" in capsys.readouterr().out and not (tmp_path / "x.json").exists()


def test_meta_build_has_the_published_shapes():
    mod = load_bench_script("bench_gpu")
    from transformers import AutoModelForCausalLM, LlamaConfig

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(LlamaConfig(**mod.CONFIGS["llama-3.1-8b"], **mod.COMMON))
    assert 8.0e9 < sum(p.numel() for p in m.parameters()) < 8.1e9  # Llama-3.1-8B: 8.03B parameters

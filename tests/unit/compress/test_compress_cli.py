"""capsense compress / measure / grid / fit / select end to end on a tiny model folder."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import tiny_inputs
from test_compress_fit import _synthetic_grid

from capsense.cli import main


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])




def _compressed_in_memory(tiny_model_dir, setting, calib_file=None):
    from capsense.compress.engine import calibrate, compress_model
    from capsense.compress.budget import uniform_budget
    from capsense.core.models import load_model

    model, tok = load_model(str(tiny_model_dir))
    b = uniform_budget(setting)
    stats, _ = calibrate(model, tok, b, str(calib_file), 8) if calib_file else ({}, [])
    compress_model(model, b, stats)
    return model


@pytest.mark.parametrize("args,setting", [
    (["--method", "magnitude", "--density", "0.5"], {"method": "magnitude", "density": 0.5}),
    (["--method", "rtn", "--bits", "3", "--group-size", "32", "--format", "dense"], {"method": "rtn", "bits": 3, "group_size": 32}),
    (["--method", "svd-llm", "--ratio", "0.6"], {"method": "svd-llm", "ratio": 0.6}),
    (["--method", "wanda", "--density", "0.4", "--targets", "mlp"], None),
    (["--method", "sparsegpt", "--density", "0.5", "--scope", "2:4"], {"method": "sparsegpt", "density": 0.5, "scope": "2:4"}),
])
def test_compress_writes_a_checkpoint_stock_transformers_loads(tmp_path, tiny_model_dir, calib_file, args, setting):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    calibrated = args[1] in ("wanda", "sparsegpt", "gptq", "asvd", "svd-llm")  # (calibration elsewhere is refused)
    r = run("compress", tiny_model_dir, *args, *(["--calibration", calib_file, "--calibration-samples", 8] if calibrated else []),
            "--out", out)
    assert r.exit_code == 0, r.output
    meta = json.loads((out / "capsense.json").read_text())
    assert meta["method"] == args[1]
    assert meta["summary"]["target_params"] > 0 and meta["matrices"]
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    if setting is None:  # wanda on mlp only: attention untouched, mlp at 40% per row
        # gate/up keep round(0.4 * 64) = 26 of 64 per row, down keeps round(0.4 * 128) = 51 of 128
        assert meta["summary"]["target_density"] == (2 * 128 * 26 + 64 * 51) / (3 * 128 * 64)
        assert all(m["kind"] == "mlp" for m in meta["matrices"])
        assert meta["calibration"][0]["kind"] == "file"
        return
    expected = _compressed_in_memory(tiny_model_dir, setting, calib_file if setting["method"] in ("svd-llm", "sparsegpt") else None)
    x = tiny_inputs()
    with torch.no_grad():
        assert torch.allclose(loaded(x).logits, expected(x).logits, atol=1e-5)
    if setting["method"] == "magnitude":
        assert meta["summary"]["target_density"] == 0.5
        w = loaded.model.layers[0].mlp.down_proj.weight
        assert float((w == 0).float().mean()) == 0.5
    if setting["method"] == "rtn":
        assert meta["summary"]["target_bits_per_param"] == pytest.approx(3 + 16 / 32)
    if setting["method"] == "sparsegpt":  # dense format (no sparse storage); two of every four weights kept
        w = loaded.model.layers[1].mlp.up_proj.weight
        assert ((w != 0).view(w.shape[0], -1, 4).sum(2) == 2).all() and meta["format"]["format"] == "dense"
    assert "path" not in meta["base_model"] and str(tiny_model_dir) not in (out / "capsense.json").read_text()
    assert meta["made_with"]["versions"]["torch"] == torch.__version__ and meta["made_with"]["host"]["device"] == "cpu"
    card = (out / "README.md").read_text()
    assert f"torch {torch.__version__}" in card and f"on {meta['made_with']['host']['cpu']}" in card
    assert str(tiny_model_dir) not in card and "| layer |" in card and f"| {meta['size']['bytes_on_disk']} |" in card
    assert ("no sparse storage" in card) == (args[1] in ("magnitude", "sparsegpt")) and ("reconstructed products" in card) == (args[1] == "svd-llm")


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_quantized_checkpoints_are_packed_by_default_and_reload_exactly(tmp_path, tiny_model_dir, calib_file, method):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    calibration = ["--calibration", calib_file, "--calibration-samples", 8] if method == "gptq" else []
    r = run("compress", tiny_model_dir, "--method", method, "--bits", "4", "--group-size", "32", *calibration, "--out", out)
    assert r.exit_code == 0, r.output
    meta = json.loads((out / "capsense.json").read_text())
    assert meta["format"]["format"] == "compressed-tensors" and meta["format"]["dtype"] == "bfloat16"
    assert "pack-quantized" in (out / "README.md").read_text()
    assert abs(meta["size"]["bytes_on_disk"] / meta["size"]["bytes_accounted"] - 1) < 0.10
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.down_proj.weight_packed" in f.keys()
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    expected = _compressed_in_memory(tiny_model_dir, {"method": method, "bits": 4, "group_size": 32},
                                     calib_file if method == "gptq" else None)
    for p in expected.parameters():  # the checkpoint stores the rest in bfloat16
        p.data = p.data.to(torch.bfloat16)
    x = tiny_inputs()
    with torch.no_grad():
        nll = [torch.nn.functional.cross_entropy(m(x).logits[:, :-1].float().transpose(1, 2), x[:, 1:], reduction="none")
               for m in (loaded, expected)]
    assert float((nll[0] - nll[1]).abs().max()) <= 1e-3
    from capsense.core.models import load_model  # capsense's own loader unpacks at load (its hooks need weights)

    ours, _ = load_model(str(out), dtype="bfloat16")  # a plain dense model: the weights stock transformers unpacked
    mine, theirs = ours.state_dict(), loaded.state_dict()  # (stock keeps the scales beside them; capsense drops them)
    assert set(mine) == {k for k in theirs if not k.endswith(("weight_scale", "weight_shape"))}
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.parametrize("args,message", [
    (["--method", "magnitude", "--density", "1.5"], "density 1.5 is outside (0, 1]"),
    (["--method", "magnitude", "--density", "0"], "density 0.0 is outside (0, 1]"),
    (["--method", "rtn", "--bits", "1"], "RTN needs an integer bit width from 2 to 16"),
    (["--method", "awq", "--bits", "4"], "unknown --method 'awq': valid methods are magnitude, wanda, sparsegpt, rtn, gptq, svd, asvd, svd-llm"),
    (["--method", "svd", "--ratio", "0.01"], "leaves no rank"),
    (["--method", "magnitude", "--density", "0.5", "--targets", "embed"], "unknown target kind embed"),
    (["--method", "magnitude", "--density", "0.5", "--scope", "block"], "unknown pruning scope 'block'"),
    (["--method", "magnitude"], "magnitude needs a density"),
    (["--method", "gptq", "--bits", "4", "--calibration-samples", "0"], "gptq needs calibration data"),
    (["--method", "gptq", "--bits", "4", "--calibration", ""], "gptq needs calibration data"),
    (["--method", "rtn", "--bits", "12", "--group-size", "32"], "--format compressed-tensors cannot store"),
    (["--method", "rtn", "--bits", "4", "--group-size", "48"], "group size 48 on 64 input columns"),
    (["--method", "wanda", "--density", "0.5", "--format", "compressed-tensors"], "no sparse storage"),
    (["--method", "rtn", "--bits", "4", "--damp", "0.1"], "damp does not apply to rtn"),
    (["--method", "sparsegpt", "--density", "0.6", "--scope", "2:4"], "density must be 0.5"),
    ([], "give --method"),
    (["--method", "gptq", "--bits", "4", "--pricing", "rtn"], "--pricing shape(s) a guided allocation: give --keep"),
    (["--method", "gptq", "--bits", "4", "--fisher-groups", "2"], "--fisher-groups shape(s) a guided allocation"),
    (["--method", "wanda", "--density", "0.5", "--protect-top-k", "2", "--sensitivity", "flat"],
     "--protect-top-k, --sensitivity shape(s) a guided allocation"),
    (["--method", "wanda", "--density", "0.5", "--keep", "math", "--pricing", "rtn"], "--pricing applies to methods gptq, sparsegpt, not wanda"),
    (["--method", "sparsegpt", "--density", "0.5", "--keep", "math", "--pricing", "rtn"], "--pricing 'rtn' does not apply to sparsegpt"),
    (["--method", "rtn", "--bits", "4", "--sequential"], "--sequential applies to the calibrated methods"),
    (["--method", "gptq", "--bits", "4", "--keep", "math", "--sensitivity", "measured", "--sequential"],
     "sensitivity measured prices each layer's levels in the uniformly compressed model"),
    (["--method", "wanda", "--density", "0.5", "--scope", "global", "--sequential"], "cannot prune with scope global"),
    (["--method", "gptq", "--bits", "4", "--sequential-propagate", "original"], "--sequential-propagate says how --sequential"),
    (["--method", "magnitude", "--density", "0.5", "--calibration", "prose"],
     "--calibration is read by the calibrated methods (wanda, sparsegpt, gptq, asvd, svd-llm); magnitude calibrate(s) on nothing"),
    (["--method", "rtn", "--bits", "4", "--calibration-samples", "8"],  # (round 53: it was ignored)
     "--calibration-samples is read by the calibrated methods (wanda, sparsegpt, gptq, asvd, svd-llm); rtn calibrate(s)"),
])
def test_compress_bad_input_one_clear_message_nothing_written(tmp_path, tiny_model_dir, args, message):
    out = tmp_path / "out"
    r = run("compress", tiny_model_dir, *args, "--out", out)
    assert r.exit_code == 1
    last = r.output.strip().splitlines()[-1]  # (a model load may print a progress bar first)
    assert last.startswith("Error: ") and message in last and r.output.count("Error") == 1
    assert "Traceback" not in r.output
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_compress_refuses_existing_output(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    r = run("compress", tiny_model_dir, "--method", "magnitude", "--density", "0.5", "--out", out)
    assert r.exit_code == 1 and "not empty" in r.output
    assert (out / "keep.txt").read_text() == "x"


def test_compress_with_budget_file_protecting_heads(tmp_path, tiny_model_dir):
    from capsense.core.heads import HeadsFile, write_heads_file

    write_heads_file(tmp_path / "heads.json", HeadsFile("tiny", [{"layer": 2, "head": 1}]))
    (tmp_path / "budget.yaml").write_text(
        "method: magnitude\ndensity: 0.25\noverrides:\n  - layers: 0\n    skip: true\nprotect:\n  heads: heads.json\n"
    )
    out = tmp_path / "out"
    r = run("compress", tiny_model_dir, "--budget-file", tmp_path / "budget.yaml", "--out", out)
    assert r.exit_code == 0, r.output
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    comp = AutoModelForCausalLM.from_pretrained(out)
    o_base, o_comp = base.model.layers[2].self_attn.o_proj.weight, comp.model.layers[2].self_attn.o_proj.weight
    assert torch.equal(o_comp[:, 16:32], o_base[:, 16:32])
    assert torch.equal(comp.model.layers[0].mlp.up_proj.weight, base.model.layers[0].mlp.up_proj.weight)
    meta = json.loads((out / "capsense.json").read_text())
    assert meta["summary"]["protected_heads"] == "L2H1"
    assert meta["budget"]["protect"]["heads"] == "heads.json"


@pytest.mark.parametrize("sequential", [False, True])
def test_a_budget_file_s_override_may_change_only_a_setting_of_the_method(tmp_path, tiny_model_dir, calib_file, sequential):
    """An override without a method (``density: 0.9`` for layer 0) keeps the default's method: the checks before the
    load parsed it as a whole setting and refused it ("no method given"), the repository's example budget among them."""
    from pathlib import Path

    from capsense.compress.budget import load_budget
    from capsense.compress.pipeline import calibrated_methods, check_calibration_given
    from capsense.compress.sequential import check_sequential

    example = load_budget(Path(__file__).resolve().parents[3] / "recipes" / "compress_budget_example.yaml")
    assert [s.label for s in example.settings()] == ["wanda@d0.6", "wanda@d0.9", "wanda@d0.7"]
    stacked = tmp_path / "stacked.yaml"  # a partial override on top of an earlier override's method
    stacked.write_text("method: wanda\ndensity: 0.5\noverrides:\n  - layers: 0-1\n    method: rtn\n    bits: 4\n"
                       "  - layers: 0\n    group_size: 32\n")
    assert [s.label for s in load_budget(stacked).settings()] == ["wanda@d0.5", "rtn@4b/g128", "rtn@4b/g32"]
    assert calibrated_methods(example) == ["wanda"]
    check_calibration_given(example, "prose", 8)
    check_sequential(example)
    (tmp_path / "budget.yaml").write_text("method: wanda\ndensity: 0.5\noverrides:\n  - layers: 0\n    density: 0.75\n")
    out = tmp_path / "out"
    r = run("compress", tiny_model_dir, "--budget-file", tmp_path / "budget.yaml", "--calibration", calib_file,
            "--calibration-samples", 4, *(["--sequential"] if sequential else []), "--out", out)
    assert r.exit_code == 0, r.output
    kept = {m["name"]: (m["setting"], m["nonzero"] / m["n_params"])
            for m in json.loads((out / "capsense.json").read_text())["matrices"]}
    assert kept["model.layers.0.mlp.up_proj"] == ({"method": "wanda", "density": 0.75, "scope": "row"}, 0.75)
    assert kept["model.layers.1.mlp.up_proj"] == ({"method": "wanda", "density": 0.5, "scope": "row"}, 0.5)


def test_measure(tmp_path, tiny_model_dir):
    out = tmp_path / "m.json"
    r = run("measure", tiny_model_dir, "--capabilities", "qa,math", "--probes", 3, "--out", out)
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert set(data["capabilities"]) == {"qa", "math"}
    assert data["capabilities"]["qa"]["n_docs"] == 3 and data["capabilities"]["qa"]["nll"] > 0
    assert data["versions"]["torch"] == torch.__version__ and data["host"]["device"] == "cpu"  # what made the numbers
    r = run("measure", tiny_model_dir, "--capabilities", "qa,capsense_poetry")
    assert r.exit_code == 1 and "unknown capability: unknown task 'capsense_poetry'" in r.output
    assert "the short names are math, code, qa" in r.output


def test_grid_appends_and_resumes(tmp_path, tiny_model_dir, calib_file):
    out = tmp_path / "grid.jsonl"
    args = ["grid", tiny_model_dir, "--methods", "magnitude,wanda", "--densities", "0.8,0.5", "--capabilities", "qa",
            "--probes", 3, "--calibration", calib_file, "--calibration-samples", 4, "--out", out, "--no-progress"]
    r = run(*args)
    assert r.exit_code == 0, r.output
    lines = out.read_text().splitlines()
    assert len(lines) == 5  # dense + 4 settings, one capability
    recs = [json.loads(x) for x in lines]
    assert recs[0]["method"] == "none" and all(r["nll0"] == recs[0]["nll"] for r in recs)
    assert {r["label"] for r in recs[1:]} == {"magnitude@d0.8", "magnitude@d0.5", "wanda@d0.8", "wanda@d0.5"}
    # a crash mid-write leaves a torn line: resume drops it and measures only what is missing
    out.write_text("\n".join(lines[:3]) + "\n" + lines[3][: len(lines[3]) // 2])
    r = run(*args)
    assert r.exit_code == 0, r.output
    again = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["key"] for x in again][:3] == [x["key"] for x in recs[:3]]
    assert sorted(x["key"] for x in again) == sorted(x["key"] for x in recs)
    assert again[4]["nll"] == pytest.approx(recs[4]["nll"], abs=1e-9)  # deterministic
    r = run(*args)
    assert r.exit_code == 0 and len(out.read_text().splitlines()) == 5
    # another grid's file is refused
    r = run(*[a if a != 3 else 4 for a in args])
    assert r.exit_code == 1 and "another grid" in r.output


def test_a_grid_refuses_calibration_none_of_its_methods_reads(tmp_path, tiny_model_dir, calib_file):
    """It was ignored, yet kept in the grid's fingerprint: resuming with another calibration was refused."""
    out = tmp_path / "g.jsonl"
    r = run("grid", tiny_model_dir, "--methods", "rtn", "--bits", 4, "--group-size", 32, "--calibration", calib_file,
            "--calibration-samples", 4, "--out", out)
    assert r.exit_code == 1 and not out.exists()
    assert ("Error: --calibration and --calibration-samples are read by the calibrated methods (wanda, sparsegpt, gptq, "
            "asvd, svd-llm); this grid's rtn calibrate(s) on nothing") in r.output


def test_a_grid_refuses_a_list_or_group_size_none_of_its_methods_reads(tmp_path, tiny_model_dir):
    """--methods magnitude --bits 4 measured magnitude alone, and --densities without --methods beside a spec file was
    dropped, without a word: each is one error naming what reads it, nothing measured."""
    out = tmp_path / "g.jsonl"
    spec = tmp_path / "grid.yaml"
    spec.write_text(f"model: {tiny_model_dir}\ncapabilities: [arithmetic]\nsettings:\n  - method: magnitude\n    density: 0.5\n")
    base = ["--capabilities", "arithmetic", "--probes", 2, "--no-progress", "--out", out]
    for args, stray in [(["--methods", "magnitude", "--densities", 0.5, "--bits", 4], "--bits not read by this grid's "
                         "methods (magnitude)"),
                        (["--methods", "rtn", "--bits", 4, "--ratios", 0.5], "--ratios not read by this grid's methods (rtn)"),
                        (["--methods", "wanda", "--densities", 0.5, "--group-size", 32], "--group-size not read"),
                        (["--spec", spec, "--densities", 0.7], "--densities not read by this grid's methods (none given: "
                         "give --methods)")]:
        r = run("grid", *([] if args[0] == "--spec" else [tiny_model_dir]), *args, *base)
        assert r.exit_code == 1 and r.output.count("Error") == 1 and stray in r.output, r.output
        assert "--bits and --group-size by rtn, gptq" in r.output and not out.exists(), r.output
    r = run("grid", tiny_model_dir, "--methods", "magnitude,rtn", "--densities", 0.5, "--bits", 4, "--group-size", 32, *base)
    assert r.exit_code == 0, r.output
    assert [json.loads(line)["setting"].get("group_size") for line in out.read_text().splitlines()][-1] == 32


def test_fit_select_and_grid_refuse_a_file_grid_did_not_write(tmp_path, tiny_model_dir):
    """Another JSONL (here a guided run's bench record) is named as no grid file, with what its first record lacks: fit
    and select failed on it with a KeyError traceback, and grid called it another grid's measurements."""
    other = tmp_path / "bench.jsonl"
    other.write_text(json.dumps({"model": "m", "keep": "math", "setting": {"method": "wanda", "density": 0.5}}) + "\n")
    message = f"Error: {other} is not a grid file: its record 1 has no model_state, method, capability, dL, summary"
    for args in (["fit", other], ["select", other, "--max-size", 0.6],
                 ["grid", tiny_model_dir, "--methods", "magnitude", "--densities", "0.5", "--out", other]):
        r = run(*args)
        assert r.exit_code == 1 and "Traceback" not in r.output, r.output
        assert r.output.strip().splitlines()[-1].startswith(message), r.output


def test_fit_and_select_cli(tmp_path):
    grid = tmp_path / "g.jsonl"
    grid.write_text("".join(json.dumps(r) + "\n" for r in _synthetic_grid()))
    r = run("fit", grid, "--report", tmp_path / "rep", "--predict", "0.75")
    assert r.exit_code == 0, r.output
    assert "compact relation vs per-density" in r.output and "predict wanda d=0.75 math" in r.output
    assert (tmp_path / "rep" / "report.md").is_file() and (tmp_path / "rep" / "pruning_fits.png").is_file()
    assert (tmp_path / "rep" / "predicted_vs_measured.png").is_file()
    r = run("fit", grid, "--predict", "0.3")
    assert r.exit_code == 1 and "outside the measured range [0.5, 0.9]" in r.output
    r = run("fit", grid, "--predict", "0.3", "--allow-extrapolation")
    assert r.exit_code == 0 and "EXTRAPOLATED" in r.output
    r = run("select", grid, "--max-size", "0.6")
    assert r.exit_code == 0, r.output
    assert "chosen:" in r.output and "regret:" in r.output
    r = run("select", grid, "--max-size", "0.6", "--capabilities", "poetry")
    assert r.exit_code == 1 and "poetry is not in the grid" in r.output


def test_grid_fit_select_measure_take_gptq_and_sparsegpt(tmp_path, tiny_model_dir, calib_file):
    out = tmp_path / "grid.jsonl"
    r = run("grid", tiny_model_dir, "--methods", "gptq,sparsegpt", "--bits", "8,4,3", "--group-size", 32,
            "--densities", "0.8,0.6,0.4", "--capabilities", "qa", "--probes", 3, "--calibration", calib_file,
            "--calibration-samples", 4, "--out", out, "--no-progress")
    assert r.exit_code == 0, r.output
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert {x["label"] for x in recs[1:]} == {"gptq@8b/g32", "gptq@4b/g32", "gptq@3b/g32", "sparsegpt@d0.8",
                                              "sparsegpt@d0.6", "sparsegpt@d0.4"}
    assert all(x["calibration"] for x in recs[1:])  # both solvers ran on calibration statistics
    r = run("fit", out, "--predict", "0.7", "--method", "sparsegpt")
    assert r.exit_code == 0, r.output
    assert "gptq/g32" in r.output and "predict sparsegpt d=0.7 qa" in r.output
    r = run("fit", out, "--predict", "0.7", "--method", "gptq")  # a density of a quantizer: refused, naming the valid
    assert r.exit_code == 1 and "no pruning fit for 'gptq': the grid has sparsegpt" in r.output
    r = run("select", out, "--max-size", "0.5")
    assert r.exit_code == 0, r.output
    assert "chosen:" in r.output
    r = run("grid", tiny_model_dir, "--methods", "gptq", "--densities", "0.5", "--out", tmp_path / "g2.jsonl")
    assert r.exit_code == 1 and "gptq needs a list of bits" in r.output
    # a GPTQ checkpoint (packed, compressed-tensors) is measured like any model folder
    ckpt = tmp_path / "ckpt"
    r = run("compress", tiny_model_dir, "--method", "gptq", "--bits", 4, "--group-size", 32, "--calibration", calib_file,
            "--calibration-samples", 4, "--out", ckpt)
    assert r.exit_code == 0, r.output
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"
    r = run("measure", ckpt, "--capabilities", "qa", "--probes", 3, "--reference", tiny_model_dir, "--out", tmp_path / "m.json")
    assert r.exit_code == 0, r.output
    qa = json.loads((tmp_path / "m.json").read_text())["capabilities"]["qa"]
    assert qa["nll"] > 0 and qa["dL"] == pytest.approx(qa["nll"] - qa["nll0"])
    assert qa["dL_se"] > 0 and f"dL {qa['dL']:+.4f} (se {qa['dL_se']:.4f})" in r.output


@pytest.mark.parametrize("propagate", ["original", "compressed"])
def test_compress_sequential_writes_the_layered_checkpoint(tmp_path, tiny_model_dir, calib_file, propagate):
    """--sequential --sequential-propagate original writes the one-pass weights; compressed other ones; both say so."""
    from safetensors.torch import load_file

    args = ["--method", "gptq", "--bits", "3", "--group-size", "32", "--format", "dense", "--calibration", calib_file,
            "--calibration-samples", 8]
    one, layered = tmp_path / "one", tmp_path / "layered"
    assert run("compress", tiny_model_dir, *args, "--out", one).exit_code == 0
    r = run("compress", tiny_model_dir, *args, "--sequential", "--sequential-propagate", propagate, "--out", layered)
    assert r.exit_code == 0, r.output
    meta = json.loads((layered / "capsense.json").read_text())
    assert meta["sequential"] == {"propagate": propagate, "layers": 3} and "sequential" not in json.loads(
        (one / "capsense.json").read_text())
    assert meta["calibration"][0]["kind"] == "file"
    a, b = load_file(one / "model.safetensors"), load_file(layered / "model.safetensors")
    same = all(torch.equal(a[k], b[k]) for k in a)
    assert same == (propagate == "original")

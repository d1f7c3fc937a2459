"""``capsense compress --device-map``: the checkpoint equals the single-device one to the bit;
offloaded weights and devices that do not exist are refused with one message, nothing written."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import N_LAYERS
from safetensors.torch import load_file

from capsense.cli import main

MODULES = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(N_LAYERS)), "model.norm", "model.rotary_emb", "lm_head"]
ON_CPU = {m: "cpu" for m in MODULES}  # one entry per module: the map as a user would write it for GPUs




def _compress(tiny_model_dir, out, args, *extra):
    return CliRunner().invoke(main, ["compress", str(tiny_model_dir), *map(str, args), "--out", str(out), *extra])


def _assert_same_checkpoint(a, b) -> None:
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())  # no offload artifacts
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert wa[k].dtype == wb[k].dtype and torch.equal(wa[k], wb[k]), k


@pytest.mark.parametrize("args", [
    ["--method", "wanda", "--density", "0.5"],
    ["--method", "rtn", "--bits", "3", "--group-size", "16", "--save-dtype", "bfloat16"],
    ["--method", "svd-llm", "--ratio", "0.5"],
    ["--method", "gptq", "--bits", "4", "--group-size", "32"],
])
def test_compress_under_a_device_map_equals_the_single_device_checkpoint(tmp_path, tiny_model_dir, calib_file, args):
    args = [*args, "--calibration", calib_file, "--calibration-samples", 6] if args[1] != "rtn" else args
    plain, mapped = tmp_path / "plain", tmp_path / "mapped"
    r = _compress(tiny_model_dir, plain, args)
    assert r.exit_code == 0, r.output
    r = _compress(tiny_model_dir, mapped, args, "--device-map", json.dumps(ON_CPU))
    assert r.exit_code == 0, r.output
    _assert_same_checkpoint(plain, mapped)
    base = load_file(tiny_model_dir / "model.safetensors")["model.layers.1.mlp.up_proj.weight"]
    written = load_file(mapped / "model.safetensors")
    if "model.layers.1.mlp.up_proj.weight_packed" in written:  # rtn, gptq: packed integer codes
        assert "model.layers.1.mlp.up_proj.weight" not in written
    else:
        assert not torch.equal(written["model.layers.1.mlp.up_proj.weight"].to(base.dtype), base)
    a, b = (json.loads((p / "capsense.json").read_text()) for p in (plain, mapped))
    assert a["matrices"] == b["matrices"] and a["summary"] == b["summary"]


def test_parallelize_and_keep_under_a_device_map(tmp_path, tiny_model_dir):
    """``--parallelize`` (auto: all on cpu here) and the gradient of a kept capability (``--keep``)."""
    args = ["--method", "magnitude", "--density", "0.5", "--keep", "math", "--calibration-samples", 4, "--protect-top-k", 1]
    plain, mapped = tmp_path / "plain", tmp_path / "mapped"
    assert _compress(tiny_model_dir, plain, args).exit_code == 0
    r = _compress(tiny_model_dir, mapped, args, "--parallelize")
    assert r.exit_code == 0, r.output
    _assert_same_checkpoint(plain, mapped)
    assert (mapped / "budget.yaml").read_text() == (plain / "budget.yaml").read_text()


@pytest.mark.parametrize("device_map, message", [
    ({**ON_CPU, "model.layers.1": "disk"}, "the device map offloaded 9 weights (model.layers.1.self_attn.q_proj.weight, "),
    ({**ON_CPU, "model.layers.2": "cuda:3"}, "device 'cuda:3' does not exist on this machine: available devices are cpu"),
    ("{model", "device_map is not valid JSON"),
])
def test_bad_device_map_is_one_message_and_writes_nothing(tmp_path, tiny_model_dir, device_map, message):
    out = tmp_path / "out"
    spec = device_map if isinstance(device_map, str) else json.dumps(device_map)
    r = _compress(tiny_model_dir, out, ["--method", "rtn", "--bits", "4"], "--device-map", spec)
    assert r.exit_code == 1, r.output
    last = r.output.strip().splitlines()[-1]
    assert last.startswith("Error: ") and message in last and r.output.count("Error") == 1, r.output
    assert "Traceback" not in r.output
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


@pytest.mark.parametrize("extra, message", [
    ([], "without a device map every layer is on the CPU, where it changes nothing"),  # before the model loads
    (["--device-map", json.dumps(ON_CPU)], "it would solve are on the CPU"),  # once the map has placed them
])
def test_solve_on_layer_where_every_layer_is_on_the_cpu_is_one_message(tmp_path, tiny_model_dir, extra, message):
    out = tmp_path / "out"
    r = _compress(tiny_model_dir, out, ["--method", "gptq", "--bits", "4", "--solve-on", "layer"], *extra)
    assert r.exit_code == 1 and r.output.count("Error") == 1 and message in r.output, r.output
    assert "Traceback" not in r.output and not out.exists()
    r = _compress(tiny_model_dir, out, ["--method", "rtn", "--bits", "4", "--solve-on", "layer"], "--device-map",
                  json.dumps(ON_CPU))
    assert r.exit_code == 1 and "solve_on does not apply to rtn" in r.output and not out.exists(), r.output


def test_offload_refusal_says_what_to_do(tiny_model_dir):
    from capsense.core.models import load_model
    from capsense.core.placement import check_weights_in_memory, offloaded_weights
    from capsense.errors import CapsenseError

    model, _ = load_model(str(tiny_model_dir), device_map=json.dumps({**ON_CPU, "model.embed_tokens": "disk"}))
    assert offloaded_weights(model) == ["model.embed_tokens.weight"]
    with pytest.raises(CapsenseError, match=r"compression edits.*: use a device map that keeps every module on a device"):
        check_weights_in_memory(model, "compression edits every weight in place")
    check_weights_in_memory(load_model(str(tiny_model_dir), device_map=json.dumps(ON_CPU))[0], "x")  # nothing offloaded


def test_calibration_gradients_and_compression_through_accelerate_hooks(tmp_path, tiny_model_dir, calib_file):
    """A model dispatched with accelerate's hooks (as a multi-GPU map leaves it; forced here on cpu)
    calibrates, takes gradients, compresses and saves exactly like the plain model."""
    from accelerate import dispatch_model

    from capsense.compress.engine import calibrate, compress_model
    from capsense.compress.budget import uniform_budget
    from capsense.compress.calibration import calibration_samples
    from capsense.compress.sensitivity import fisher_diagonal
    from capsense.compress.targets import find_targets
    from capsense.core.models import load_model

    plain, tok = load_model(str(tiny_model_dir))
    hooked = dispatch_model(load_model(str(tiny_model_dir))[0], device_map=ON_CPU, main_device="cpu", force_hooks=True)
    assert hasattr(hooked.model.layers[1], "_hf_hook")
    samples, _ = calibration_samples(str(calib_file), tok, 4)
    budget = uniform_budget({"method": "wanda", "density": 0.5})
    fishers = []
    for model, name in ((plain, "plain"), (hooked, "hooked")):
        fishers.append(fisher_diagonal(model, find_targets(model), samples))
        stats, _ = calibrate(model, tok, budget, str(calib_file), 6)
        compress_model(model, budget, stats)
        model.save_pretrained(tmp_path / name)
    for name, f in fishers[0].items():
        assert torch.equal(f, fishers[1][name]) and float(f.abs().sum()) > 0, name
    _assert_same_checkpoint(tmp_path / "plain", tmp_path / "hooked")


def test_distill_under_a_device_map_equals_the_single_device_student(tmp_path, tiny_model_dir):
    student = tmp_path / "student"
    assert _compress(tiny_model_dir, student, ["--method", "magnitude", "--density", "0.5"]).exit_code == 0
    args = ["distill", str(student), "--teacher", str(tiny_model_dir), "--epochs", "1", "--texts", "3", "--gen-tokens", "2",
            "--seq-len", "24", "--lr", "1e-3", "--capabilities", "qa", "--probes", "2"]
    plain, mapped, refused = tmp_path / "plain", tmp_path / "mapped", tmp_path / "refused"
    r = CliRunner().invoke(main, [*args, "--out", str(plain)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, [*args, "--out", str(mapped), "--device-map", json.dumps(ON_CPU)])
    assert r.exit_code == 0, r.output
    _assert_same_checkpoint(plain, mapped)
    trained, pruned = (load_file(p / "model.safetensors")["model.layers.0.mlp.up_proj.weight"] for p in (mapped, student))
    assert not torch.equal(trained, pruned) and torch.equal(trained == 0, pruned == 0)  # trained, masks kept
    r = CliRunner().invoke(main, [*args, "--out", str(refused), "--device-map", json.dumps({**ON_CPU, "lm_head": "disk"})])
    assert r.exit_code == 1 and "distillation trains the student's weights in place" in r.output, r.output
    assert "Traceback" not in r.output and not refused.exists() and not (tmp_path / "refused.partial").exists()


def test_measured_sensitivity_under_accelerate_hooks_keeps_them_and_equals_the_plain_model(tiny_model_dir):
    """Replaying blocks (measured sensitivity) on a model dispatched with accelerate's hooks (as a
    multi-GPU map leaves it; forced here on cpu) gives the plain model's costs, and every block
    keeps accelerate's forward hook afterwards (deleting the replay's shadow used to remove it)."""
    from accelerate import dispatch_model
    from conftest import make_char_tokenizer

    from capsense.compress.measured_sensitivity import allocation_probes, measure_costs, probe_loss, units_of
    from capsense.compress.methods import QuantSetting
    from capsense.compress.targets import find_targets
    from capsense.core.models import load_model
    from capsense.core.replay import BlockReplay

    plain = load_model(str(tiny_model_dir))[0]
    hooked = dispatch_model(load_model(str(tiny_model_dir))[0], device_map=ON_CPU, main_device="cpu", force_hooks=True)
    hooks = {i: vars(b)["forward"] for i, b in enumerate(hooked.model.layers)}  # accelerate's, on the instance
    base, levels = QuantSetting("rtn", 3, 128), [QuantSetting("rtn", 2, 0), QuantSetting("rtn", 4, 32)]
    tok = make_char_tokenizer()
    costs = []
    for model in (plain, hooked):
        targets = find_targets(model)
        orig = {t.name: t.get().clone() for t in targets}
        for t in targets:
            t.set(base.apply(t.name, orig[t.name], None, None, 16).weight)
        probes = allocation_probes(model, tok, ["math"], 3)
        costs.append(measure_costs(units_of(targets, "kind"), [base, *levels], base, orig, {}, {},
                                   lambda model=model: probe_loss(model, probes), replay=BlockReplay(model)))
    assert costs[0] == costs[1] and any(c.cost != 0 for cs in costs[0][1].values() for c in cs)
    for i, b in enumerate(hooked.model.layers):
        assert vars(b).get("forward") is hooks[i], f"block {i} lost accelerate's hook"


@pytest.mark.parametrize("propagate", ["compressed", "original"])
def test_sequential_under_a_device_map_equals_the_single_device_checkpoint(tmp_path, tiny_model_dir, calib_file,
                                                                           propagate):
    """Layer by layer, each layer is run on its cached inputs through its own placement hooks."""
    args = ["--method", "gptq", "--bits", "4", "--group-size", "32", "--calibration", calib_file,
            "--calibration-samples", 6, "--sequential", "--sequential-propagate", propagate]
    plain, mapped = tmp_path / "plain", tmp_path / "mapped"
    assert _compress(tiny_model_dir, plain, args).exit_code == 0
    r = _compress(tiny_model_dir, mapped, args, "--device-map", json.dumps(ON_CPU))
    assert r.exit_code == 0, r.output
    _assert_same_checkpoint(plain, mapped)


def test_compress_and_distill_load_on_the_device_given(tmp_path, tiny_model_dir, monkeypatch):
    """--device (what locate, measure and grid take) reaches the load: a machine with a GPU is faked and every load is
    made on the CPU, recording the device asked for; a device this machine lacks is one error before any load."""
    import capsense.core.models as models
    import capsense.core.placement as placement

    real, asked = models.load_model, []

    def spy(name, *a, device="cpu", **k):
        asked.append(device)
        return real(name, *a, device="cpu", **k)

    student, distilled = tmp_path / "student", tmp_path / "distilled"
    distill = ["distill", str(student), "--teacher", str(tiny_model_dir), "--epochs", "1", "--texts", "2",
               "--gen-tokens", "2", "--seq-len", "16", "--capabilities", "qa", "--probes", "2"]
    for device in ("cuda:3", "cuda"):  # lacking: refused, nothing written
        r = _compress(tiny_model_dir, student, ["--method", "magnitude", "--density", "0.5"], "--device", device)
        assert r.exit_code == 1 and r.output.count("Error") == 1, r.output
        assert f"device {device!r} does not exist on this machine" in r.output and not student.exists()
    monkeypatch.setattr(placement, "available_devices", lambda: ["cpu", "cuda:0"])
    monkeypatch.setattr(models, "load_model", spy)
    r = _compress(tiny_model_dir, student, ["--method", "magnitude", "--density", "0.5"], "--device", "cuda")
    assert r.exit_code == 0 and asked == ["cuda"], r.output
    r = CliRunner().invoke(main, [*distill, "--device", "cuda:0", "--out", str(distilled)])
    assert r.exit_code == 0 and asked == ["cuda", "cuda:0", "cuda:0"], r.output  # the student and the teacher
    r = CliRunner().invoke(main, [*distill, "--device", "cuda:1", "--out", str(tmp_path / "d2")])
    assert r.exit_code == 1 and "device 'cuda:1' does not exist" in r.output and len(asked) == 3, r.output

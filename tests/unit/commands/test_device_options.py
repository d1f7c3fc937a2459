"""Options a command that loads a model should take, as locate and validate do. measure had no device option (an 8B
model was measured on the CPU whatever the machine had), evaluate no device map (a 70B model could not be spread over
GPUs, as validate's can) and no --no-progress, grid neither device option: they take them now, checked before a load."""

from __future__ import annotations

import json

from click.testing import CliRunner

from capsense.cli import main


def test_measure_takes_a_device_and_a_device_map(tmp_path, tiny_model_dir):
    base = ["measure", str(tiny_model_dir), "--capabilities", "arithmetic", "--probes", "2"]
    r = CliRunner().invoke(main, [*base, "--device", "cuda:7", "--out", str(tmp_path / "no.json")])
    assert r.exit_code == 1 and "device 'cuda:7' does not exist on this machine" in r.output, r.output
    assert not (tmp_path / "no.json").exists()
    r = CliRunner().invoke(main, [*base, "--device-map", "cpu", "--out", str(tmp_path / "m.json")])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "m.json").read_text())
    assert doc["host"]["device_map"] == "cpu" and doc["capabilities"]["arithmetic"]["n_docs"] == 2
    r = CliRunner().invoke(main, [*base, "--device", "cpu", "--out", str(tmp_path / "d.json")])
    assert r.exit_code == 0 and json.loads((tmp_path / "d.json").read_text())["capabilities"] == doc["capabilities"]


def test_evaluate_takes_a_device_map(tiny_model_dir):
    base = ["evaluate", str(tiny_model_dir), "--heads", "L0H1", "--tasks", "capsense_arithmetic", "--limit", "2"]
    spread = CliRunner().invoke(main, [*base, "--device-map", "cpu"])
    plain = CliRunner().invoke(main, base)
    assert spread.exit_code == 0 and plain.exit_code == 0, spread.output + plain.output
    table = lambda out: out[out.index("| task"):]  # noqa: E731 - the table, after the progress display
    assert table(spread.output) == table(plain.output)
    r = CliRunner().invoke(main, [*base, "--device-map", "balanced", "--parallelize"])
    assert r.exit_code == 1 and "give --parallelize or --device-map, not both" in r.output


def test_grid_takes_a_device_and_a_device_map(tmp_path, tiny_model_dir):
    """grid loaded every model on the CPU (round 51 left it so): it takes the device options now, checked before the
    load, and a map gives the plain run's measurements."""
    base = ["grid", str(tiny_model_dir), "--methods", "magnitude", "--densities", "0.5", "--capabilities", "arithmetic",
            "--probes", "2", "--no-progress"]
    r = CliRunner().invoke(main, [*base, "--device", "cuda:7", "--out", str(tmp_path / "no.jsonl")])
    assert r.exit_code == 1 and "device 'cuda:7' does not exist on this machine" in r.output, r.output
    assert not (tmp_path / "no.jsonl").exists()

    def nll(*extra: str) -> list[float]:
        out = tmp_path / f"g{len(list(tmp_path.glob('g*.jsonl')))}.jsonl"
        r = CliRunner().invoke(main, [*base, *extra, "--out", str(out)])
        assert r.exit_code == 0, r.output
        return [json.loads(line)["nll"] for line in out.read_text().splitlines()]

    plain = nll()
    assert len(plain) == 2 and plain == nll("--device-map", "cpu") == nll("--device", "cpu")


def test_evaluate_takes_no_progress(tiny_model_dir):
    """evaluate drew its bar into every log (locate, validate and grid had --no-progress): it takes it too."""
    base = ["evaluate", str(tiny_model_dir), "--heads", "L0H1", "--tasks", "capsense_arithmetic", "--limit", "2"]
    bar, quiet = CliRunner().invoke(main, base), CliRunner().invoke(main, [*base, "--no-progress"])
    assert bar.exit_code == 0 == quiet.exit_code, quiet.output
    assert "%|" in bar.output and "%|" not in quiet.output and "| capsense_arithmetic | acc |" in quiet.output


def test_a_device_beside_a_device_map_is_refused_by_every_command_and_loader(tmp_path, tiny_model_dir, monkeypatch):
    """`--device cuda:1 --device-map auto` spread the model from cuda:0 without a word (the map placed every module, the
    device was dropped): each command that takes both refuses the pair, one error, nothing written, nothing loaded; the
    library's loaders too. The default device (cpu) beside a map is what every map run passes, and stays allowed."""
    import capsense.core.placement as placement
    import transformers

    from capsense.core.models import load_model
    from capsense.errors import CapsenseError
    from capsense.evaluation.evaluate import load_lm

    monkeypatch.setattr(placement, "available_devices", lambda: ["cpu", "cuda:0", "cuda:1"])  # a real pair, not refused

    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    m, heads = str(tiny_model_dir), "L0H1"
    out = tmp_path / "out"
    commands = {
        "locate": ["locate", m, "--task", "capsense_arithmetic", "--limit", "2", "--method", "exhaustive", "--out", str(out)],
        "validate": ["validate", m, "--heads", str(tmp_path / "heads.json"), "--tasks", "capsense_arithmetic", "--out", str(out)],
        "evaluate": ["evaluate", m, "--heads", heads, "--tasks", "capsense_arithmetic", "--out", str(out / "e.json")],
        "measure": ["measure", m, "--capabilities", "arithmetic", "--probes", "2", "--out", str(out / "m.json")],
        "grid": ["grid", m, "--methods", "magnitude", "--densities", "0.5", "--capabilities", "arithmetic", "--out",
                 str(out / "g.jsonl")],
        "compress": ["compress", m, "--method", "magnitude", "--density", "0.5", "--out", str(out)],
        "distill": ["distill", m, "--teacher", m, "--out", str(out)],
    }
    (tmp_path / "heads.json").write_text(json.dumps({"model": m, "task": "capsense_arithmetic",
                                                     "heads": [{"layer": 0, "head": 1}]}))
    for name, args in commands.items():
        for placed in (["--device-map", "auto"], ["--parallelize"]):
            r = CliRunner().invoke(main, [*args, "--device", "cuda:1", *placed])
            assert r.exit_code == 1 and r.output.count("Error") == 1, (name, r.output)
            assert "give --device (the whole model on one device) or --device-map" in r.output, (name, r.output)
            assert "--device 'cuda:1' does not apply beside --device-map 'auto'" in r.output, (name, r.output)
            assert not out.exists(), name
    for loader in (load_model, load_lm):
        try:
            loader(m, device="cuda:1", device_map="auto")
        except CapsenseError as e:
            assert "does not apply beside `device_map`" in str(e)
        else:
            raise AssertionError(f"{loader.__name__} took a device beside a map")


def test_measure_shows_progress_unless_told_not_to(tmp_path, tiny_model_dir):
    """measure was silent for as long as its probes took (minutes on an 8B model): a bar per model on stderr, the JSON
    on stdout as before; --no-progress as the other commands."""
    base = ["measure", str(tiny_model_dir), "--capabilities", "arithmetic,qa", "--probes", "2",
            "--reference", str(tiny_model_dir)]
    bar, quiet = CliRunner().invoke(main, base), CliRunner().invoke(main, [*base, "--no-progress"])
    assert bar.exit_code == 0 == quiet.exit_code, bar.output
    assert f"measure {tiny_model_dir}: 100%" in bar.stderr and "capability" in bar.stderr, bar.stderr
    assert "%|" not in quiet.stderr and json.loads(quiet.stdout)["capabilities"] == json.loads(bar.stdout)["capabilities"]


def test_compress_shows_progress_unless_told_not_to(tmp_path, tiny_model_dir, calib_file):
    """compress printed two lines around a one-pass calibration and compression that take hours on a 70B model: a bar
    over the calibration texts and one over the matrices, on stderr; --no-progress as the other commands. The
    checkpoint is the same either way."""
    from safetensors.torch import load_file

    base = ["compress", str(tiny_model_dir), "--method", "gptq", "--bits", "4", "--group-size", "16",
            "--calibration", str(calib_file), "--calibration-samples", "4"]
    bar = CliRunner().invoke(main, [*base, "--out", str(tmp_path / "a")])
    quiet = CliRunner().invoke(main, [*base, "--no-progress", "--out", str(tmp_path / "b")])
    assert bar.exit_code == 0 == quiet.exit_code, bar.output
    assert "calibrate: 100%" in bar.stderr and "4/4" in bar.stderr and "compress: 100%" in bar.stderr, bar.stderr
    assert "calibrate:" not in quiet.stderr and "compress:" not in quiet.stderr, quiet.stderr
    a, b = (load_file(tmp_path / x / "model.safetensors") for x in "ab")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_distill_takes_no_progress(tmp_path, tiny_model_dir):
    student = tmp_path / "student"
    r = CliRunner().invoke(main, ["compress", str(tiny_model_dir), "--method", "magnitude", "--density", "0.5",
                                  "--no-progress", "--out", str(student)])
    assert r.exit_code == 0, r.output
    base = ["distill", str(student), "--teacher", str(tiny_model_dir), "--epochs", "1", "--texts", "2", "--gen-tokens",
            "2", "--seq-len", "16", "--capabilities", "qa", "--probes", "2"]
    bar = CliRunner().invoke(main, [*base, "--out", str(tmp_path / "a")])
    quiet = CliRunner().invoke(main, [*base, "--no-progress", "--out", str(tmp_path / "b")])
    assert bar.exit_code == 0 == quiet.exit_code, quiet.output
    assert "%|" in bar.stderr and "%|" not in quiet.stderr, quiet.stderr


def test_export_loads_on_the_device_given(tmp_path, tiny_model_dir, monkeypatch):
    """export took a single GPU only as --device-map cuda:0: it takes --device as every other command that loads a
    model. A faked GPU machine's loads record the device asked for (a checkpoint, a mean-ablation adapter); a
    zero-ablation adapter loads no weights, so a device is refused there, as a map is."""
    import capsense.core.models as models
    import capsense.core.placement as placement
    import capsense.ship.checkpoint as checkpoint

    base = ["export", str(tiny_model_dir), "--heads", "L0H1"]
    r = CliRunner().invoke(main, [*base, "--format", "checkpoint", "--device", "cuda:7", "--out", str(tmp_path / "n")])
    assert r.exit_code == 1 and "device 'cuda:7' does not exist on this machine" in r.output, r.output
    real, asked = models.load_model, []

    def spy(name, *a, device="cpu", **k):
        asked.append(device)
        return real(name, *a, device="cpu", **k)

    monkeypatch.setattr(placement, "available_devices", lambda: ["cpu", "cuda:0"])
    monkeypatch.setattr(models, "load_model", spy)
    monkeypatch.setattr(checkpoint, "load_model", spy)
    for fmt, extra in (("checkpoint", []), ("adapter", ["--ablation", "mean"])):
        r = CliRunner().invoke(main, [*base, "--format", fmt, *extra, "--device", "cuda", "--out", str(tmp_path / fmt)])
        assert r.exit_code == 0, r.output
    assert asked == ["cuda", "cuda"]
    r = CliRunner().invoke(main, [*base, "--format", "adapter", "--device", "cuda", "--out", str(tmp_path / "ia3")])
    assert r.exit_code == 1 and "--device applies to --format checkpoint and to a mean-ablation adapter" in r.output
    assert not (tmp_path / "ia3").exists(), r.output

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

"""The library functions behind the thin commands (measure, grid, fit, select, compress): each
does what its command did, speaking of parameters, so Python callers get the same results."""

from __future__ import annotations

import json

import pytest
from test_compress_fit import _synthetic_grid

from capsense.errors import CapsenseError, FitError


def _grid_file(tmp_path, records):
    p = tmp_path / "g.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in records))
    return p


def test_check_measure_refuses_before_loading(tmp_path, tiny_model_dir):
    from capsense.compress.capabilities import check_measure

    check_measure(str(tiny_model_dir), None, 3, tmp_path / "m.json", "qa")
    with pytest.raises(CapsenseError, match="`probes` must be at least 1, got 0"):
        check_measure(str(tiny_model_dir), None, 0)
    with pytest.raises(CapsenseError, match="`out` .* is a folder"):
        check_measure(str(tiny_model_dir), None, 3, tmp_path)
    with pytest.raises(CapsenseError, match="unknown capability 'prosse' .did you mean prose.."):
        check_measure(str(tiny_model_dir), None, 3, None, "qa,prosse")


def test_measure_models_against_itself_has_zero_dL(tiny_model_dir):
    from capsense.compress.capability_loss import measure_models

    doc = measure_models(str(tiny_model_dir), "qa", 3, reference=str(tiny_model_dir), per_doc=True)
    assert doc["model"] == doc["reference"] == str(tiny_model_dir) and doc["probes"] == 3
    qa = doc["capabilities"]["qa"]
    assert qa["nll"] > 0 and qa["nll0"] == pytest.approx(qa["nll"], abs=1e-6) and qa["dL"] == pytest.approx(0.0, abs=1e-6)
    assert len(qa["doc_nats"]) == qa["n_docs"] == 3
    assert sum(qa["doc_tokens"]) == qa["n_tokens"]


def test_fit_grid_file_predicts_every_method_density_and_capability(tmp_path):
    from capsense.compress.study.fits import fit_grid, fit_grid_file, predict_pruning

    records = _synthetic_grid()
    fitted = fit_grid_file(_grid_file(tmp_path, records), [0.75, 0.65])
    assert fitted.records == json.loads(json.dumps(records, default=float))  # as the file holds them
    same = lambda d: json.dumps(d, default=float, sort_keys=True)  # noqa: E731 - NaN-tolerant comparison
    assert same(fitted.fits) == same(fit_grid(fitted.records))
    methods = list(fitted.fits["pruning"])
    assert {(p["method"], p["density"]) for p in fitted.predictions} == {(m, d) for m in methods for d in (0.75, 0.65)}
    one = next(p for p in fitted.predictions if p["method"] == methods[0] and p["density"] == 0.75)
    assert one["dL"] == predict_pruning(fitted.fits, methods[0], 0.75)[one["capability"]]["dL"]
    assert fit_grid_file(_grid_file(tmp_path, records), [0.7], methods[0]).predictions[0]["method"] == methods[0]
    assert fit_grid_file(_grid_file(tmp_path, records)).predictions == []
    with pytest.raises(FitError, match="holds no measurements"):
        fit_grid_file(_grid_file(tmp_path, []))
    no_pruning = [r for r in records if r.get("family") != "prune" and "density" not in r.get("setting", {})]
    with pytest.raises(FitError, match="no pruning measurements to predict from"):
        fit_grid_file(_grid_file(tmp_path, no_pruning), [0.7])
    # a density that is no kept fraction was told to be measured ("outside the measured range"); options that apply
    # only to predictions, given without densities, were ignored
    for d in (2.0, 0.0, -0.5, float("nan")):
        with pytest.raises(FitError, match="fraction of weights kept, in \\(0, 1\\]"):
            fit_grid_file(_grid_file(tmp_path, records), [d], allow_extrapolation=True)
    for extra in ({"method": methods[0]}, {"allow_extrapolation": True}):
        with pytest.raises(FitError, match="apply to predictions: give the densities"):
            fit_grid_file(_grid_file(tmp_path, records), **extra)


def test_select_from_grid_is_select_over_the_file(tmp_path):
    from capsense.compress.study.fits import fit_grid
    from capsense.compress.study.select import select, select_from_grid

    records = _synthetic_grid()
    got = select_from_grid(_grid_file(tmp_path, records), 0.6, weights={"math": 2.0})
    assert got == select(records, fit_grid(records), 0.6, None, {"math": 2.0}, "size_ratio")
    with pytest.raises(CapsenseError, match="capability poetry is not in the grid: it has math, qa"):
        select_from_grid(_grid_file(tmp_path, records), 0.6, weights={"poetry": 1.0})
    with pytest.raises(CapsenseError, match="`budget` 1.5 is outside"):
        select_from_grid(_grid_file(tmp_path, records), 1.5)


def test_grid_spec_from_a_file_or_from_lists(tmp_path):
    from capsense.compress.study.grid_spec import grid_spec

    spec = grid_spec(None, ["magnitude", "rtn"], {"densities": [0.8, 0.5], "bits": [4]}, 64, model="m",
                     capabilities="qa", probes=None, targets="mlp")
    assert spec.model == "m" and spec.capabilities == ["qa"] and spec.probes == 64
    assert {(s["method"], s.get("density"), s.get("bits"), s["targets"]) for s in spec.settings} == {
        ("magnitude", 0.8, None, "mlp"), ("magnitude", 0.5, None, "mlp"), ("rtn", None, 4, "mlp")}
    assert next(s for s in spec.settings if s["method"] == "rtn")["group_size"] == 64
    f = tmp_path / "grid.yaml"
    f.write_text("model: m\nprobes: 5\nsettings:\n  - method: wanda\n    density: [0.9, 0.7]\n")
    from_file = grid_spec(f, probes=7)
    assert from_file.probes == 7 and [s["density"] for s in from_file.settings] == [0.9, 0.7]
    replaced = grid_spec(f, ["svd"], {"ratios": [0.5]})
    assert [(s["method"], s["ratio"]) for s in replaced.settings] == [("svd", 0.5)] and replaced.probes == 5
    with pytest.raises(CapsenseError, match=r"give `model` \(or `spec_file` FILE\)"):
        grid_spec(None, ["svd"], {"ratios": [0.5]})
    with pytest.raises(CapsenseError, match="give `methods`"):
        grid_spec(None, model="m")
    for settings in ("magnitude", "{method: magnitude, density: 0.5}"):  # (round 53: read letter by letter, or by key)
        f.write_text(f"model: m\nsettings: {settings}\n")
        with pytest.raises(CapsenseError, match=r"`settings` must be a list of settings \(each a mapping"):
            grid_spec(f)


def test_compress_request_is_the_pipeline_on_the_budget_it_names(tmp_path, tiny_model_dir):
    from capsense.compress.budget import uniform_budget
    from capsense.compress.pipeline import compress_checkpoint
    from capsense.compress.request import check_request, compress_request

    setting = {"method": "magnitude", "density": 0.5, "scope": None, "bits": None}
    got = compress_request(str(tiny_model_dir), tmp_path / "a", setting, targets="mlp")
    want = compress_checkpoint(str(tiny_model_dir), uniform_budget({"method": "magnitude", "density": 0.5}, "mlp"),
                               tmp_path / "b")
    assert got.budget["targets"] == ["mlp"] and got.summary == want.summary
    assert json.loads((tmp_path / "a" / "capsense.json").read_text())["summary"] == got.summary
    # a budget file's default setting, the given values over it
    bf = tmp_path / "budget.yaml"
    bf.write_text("method: magnitude\ndensity: 0.9\ntargets: attn\n")
    over = compress_request(str(tiny_model_dir), tmp_path / "c", {"density": 0.5}, budget_file=bf)
    assert over.budget["default"]["density"] == 0.5 and over.budget["targets"] == ["attn"]
    with pytest.raises(CapsenseError, match="unknown setting dnesity"):
        compress_request(str(tiny_model_dir), tmp_path / "d", {"method": "magnitude", "dnesity": 0.5})
    assert not (tmp_path / "d").exists()
    with pytest.raises(CapsenseError, match="give `method`"):
        check_request(str(tiny_model_dir), tmp_path / "e", False, None, None, None, None)
    with pytest.raises(CapsenseError, match="capsense_mathh"):
        check_request(str(tiny_model_dir), tmp_path / "e", False, None, "wanda", None, "capsense_mathh")

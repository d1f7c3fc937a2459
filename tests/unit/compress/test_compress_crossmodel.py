"""Fits across model states recover the relations that generated two synthetic models' grids,
and a second model's grid is read, checked and reported through ``capsense fit A B``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from capsense.cli import main
from capsense.compress.study.fits import fit_grid, fit_grid_file
from capsense.compress.study.crossmodel import cross_model_fits, read_grids
from capsense.compress.study.grid_spec import load_spec
from capsense.errors import FitError

DENSITIES = (0.9, 0.8, 0.7, 0.6, 0.5)
GAMMA = 2.0
# (model, n_params, train tokens) -> reference loss L0 per capability; amplitude A = 0.05 + 0.4 L0
MODELS = {
    ("small", 1.3e8, 2e12): {"math": 0.3, "code": 0.8, "qa": 0.9},
    ("large", 2.7e8, 6e12): {"math": 0.6, "code": 1.1, "qa": 1.5},
}
RHO = {"small": {"attn": 40.0, "mlp": 80.0}, "large": {"attn": 25.0, "mlp": 60.0}}


def _amp(L0: float) -> float:
    return 0.05 + 0.4 * L0


def _model_grid(name, n_params, tokens, L0s, seed=0, noise=0.001, probes=8):
    rng = np.random.default_rng(seed)
    state = {"model": name, "n_params": n_params, "log_params": float(np.log(n_params)), "train_tokens": tokens}
    grid = {"model": name, "probes": probes, "dtype": "float32"}
    recs = []

    def rec(setting, family, label, cap, dL, targets="attn,mlp", extra=None):
        L0 = L0s[cap]
        doc = np.full(probes, 10 * L0) + 10 * (dL + rng.normal(0, noise, probes))
        return {"key": f"{label}|{targets}|{cap}", "grid": grid, "model_state": state, "setting": setting,
                "label": label, "method": setting["method"], "family": family, "targets": targets,
                "capability": cap, "nll": L0 + dL, "nll0": L0, "dL": float(doc.sum() / (10 * probes) - L0),
                "acc": 0.5, "acc0": 0.5, "dacc": 0.0, "doc_nats": doc.tolist(), "doc_tokens": [10] * probes,
                "summary": {"compression_ratio": setting.get("ratio", 1.0)}, **(extra or {})}

    for cap, L0 in L0s.items():
        base = rec({"method": "none"}, "none", "dense", cap, 0.0, targets="")
        base["doc_nats"], base["dL"] = [10 * L0] * probes, 0.0
        recs.append(base)
        for d in DENSITIES:
            recs.append(rec({"method": "wanda", "density": d, "scope": "row"}, "prune", f"wanda@d{d}", cap,
                            _amp(L0) * ((1 - d) / 0.3) ** GAMMA))
        for tg, rho in RHO[name].items():
            for method in ("svd", "svd-llm"):
                for r in (0.8, 0.6):
                    recs.append(rec({"method": method, "ratio": r}, "lowrank", f"{method}@r{r}", cap,
                                    0.01 * r * rho + (0.005 if method == "svd" else 0.0), targets=tg,
                                    extra={"stable_rank": {tg: rho, "all": rho}}))
    return recs


def _both(noise=0.001):
    return [r for i, ((n, p, t), L0s) in enumerate(MODELS.items()) for r in _model_grid(n, p, t, L0s, seed=i, noise=noise)]


def test_shared_response_and_held_out_model_recover_the_relation():
    cross = cross_model_fits(_both())
    assert cross["models"] == ["large", "small"]
    w = cross["pruning"]["wanda"]
    for cap in ("math", "code", "qa"):
        e = w["capabilities"][cap]
        assert e["joint"]["gamma"] == pytest.approx(GAMMA, abs=0.15)
        assert e["joint"]["features"]  # two model states: the amplitude depends on them
        for model, L0s in (("small", MODELS[("small", 1.3e8, 2e12)]), ("large", MODELS[("large", 2.7e8, 6e12)])):
            assert e["per_model"][model]["mae_joint"] < 0.01
            h = e["held_out_model"][model]
            assert h["anchor_density"] == 0.7
            assert h["A_from_anchor"] == pytest.approx(_amp(L0s[cap]), rel=0.05)
            assert h["mae_gamma_transfer"] < 0.01
            # the other model's amplitude is wrong for this one: plain transfer misses by the gap
            assert h["mae_plain_transfer"] > 5 * h["mae_gamma_transfer"]
    # A linear in L0 over one model's capabilities predicts the other model from its L0 alone
    for model, e in w["l0_across_capabilities"].items():
        assert e["coef"][0] > 0 and e["mae"] < 0.01, model
        assert e["gamma"] == pytest.approx(GAMMA, abs=0.15)


def test_stable_rank_line_fitted_on_one_model_predicts_the_other():
    cross = cross_model_fits(_both())
    for key in ("math|attn", "qa|mlp"):
        for model, e in cross["lowrank"][key].items():
            assert e["n_train"] == e["n"] == 4
            assert e["mae"] < 0.03 and e["pearson"] > 0.9, (key, model)
    # the pooled leave-one-out Pearson over both models and both methods is the ordinary group
    pooled = fit_grid(_both())["lowrank"]["groups"]["math|attn"]
    assert pooled["n"] == 8 and pooled["loo_pearson"] > 0.8


def test_one_model_has_no_cross_model_fits_and_a_broken_amplitude_is_not_hidden():
    one = [r for r in _both() if r["model_state"]["model"] == "small"]
    assert cross_model_fits(one) is None and "cross_model" not in fit_grid(one)
    # a model whose capabilities do not follow A(L0): the held-out L0 prediction misses, and says by how much
    recs = _both()
    for r in recs:
        if r["model_state"]["model"] == "large" and r["capability"] == "qa" and r["family"] == "prune":
            r["dL"] *= 3
    e = cross_model_fits(recs)["pruning"]["wanda"]["l0_across_capabilities"]["large"]
    assert e["capabilities"]["qa"]["mae"] > 0.1 > e["capabilities"]["math"]["mae"]


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_read_grids_checks_each_file_and_model(tmp_path):
    recs = _both()
    a = _write(tmp_path / "a.jsonl", [r for r in recs if r["model_state"]["model"] == "small"])
    b = _write(tmp_path / "b.jsonl", [r for r in recs if r["model_state"]["model"] == "large"])
    assert len(read_grids([a, b])) == len(recs)
    fitted = fit_grid_file([a, b])
    assert fitted.fits["models"] == ["large", "small"] and "cross_model" in fitted.fits
    assert "cross_model" not in fit_grid_file(a).fits  # one path, as before
    other = [{**r, "grid": {**r["grid"], "probes": 16}} for r in recs if r["model_state"]["model"] == "small"]
    c = _write(tmp_path / "c.jsonl", other)
    with pytest.raises(FitError, match="small is measured by two different grids"):
        read_grids([a, c])
    nobase = _write(tmp_path / "d.jsonl", [r for r in recs if r["model_state"]["model"] == "large" and r["method"] != "none"])
    with pytest.raises(FitError, match="d.jsonl has no dense baseline"):
        read_grids([a, nobase])
    with pytest.raises(FitError, match="at least one grid file"):
        read_grids([])


def test_fit_cli_takes_one_grid_per_model(tmp_path):
    recs = _both()
    a = _write(tmp_path / "a.jsonl", [r for r in recs if r["model_state"]["model"] == "small"])
    b = _write(tmp_path / "b.jsonl", [r for r in recs if r["model_state"]["model"] == "large"])
    r = CliRunner().invoke(main, ["fit", str(a), str(b), "--report", str(tmp_path / "rep"),
                                  "--json-out", str(tmp_path / "fits.json")])
    assert r.exit_code == 0, r.output
    assert "Across models: pruning" in r.output and "stable-rank line fitted on the other models" in r.output
    assert "Across models: pruning" in (tmp_path / "rep" / "report.md").read_text()
    assert json.loads((tmp_path / "fits.json").read_text())["cross_model"]["models"] == ["large", "small"]
    r = CliRunner().invoke(main, ["fit"])
    assert r.exit_code == 2 and "GRID_FILES" in r.output


GRID_SPECS = sorted(p for p in (Path(__file__).resolve().parents[3] / "recipes").glob("compress_*.yaml")
                    if "grid" in p.stem or "lowrank_split" in p.stem)


@pytest.mark.parametrize("path", GRID_SPECS, ids=lambda p: p.name)
def test_shipped_grid_specs_load_with_their_model_state(path):
    spec = load_spec(path)
    assert spec.settings and spec.train_tokens and spec.train_tokens > 1e11
    if "lowrank_split" in path.stem:  # every low-rank method on each target set alone
        assert {(s["method"], s["targets"]) for s in spec.settings} == {
            (m, t) for m in ("svd", "asvd", "svd-llm") for t in ("attn", "mlp")}

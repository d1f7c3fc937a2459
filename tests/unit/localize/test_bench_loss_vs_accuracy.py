"""recipes/bench/loss_vs_accuracy.py: per run, how each loss ranks the evaluations against the accuracy fall."""

from __future__ import annotations

import json

import pytest

from capsense.localize.store import Evaluation
from conftest import load_bench_script


def _run(folder, rows: list[tuple[float, float, float | None]]):
    """A run folder whose target ``t`` scores (acc, nll, choice_nll) in ``rows``, clean first."""
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"task": "t", "metric": "nll", "layout": {"n_heads": 4}}))
    lines = []
    for i, (acc, nll, choice) in enumerate(rows):
        scores = {"nll": nll, "acc": acc, **({} if choice is None else {"choice_nll": choice})}
        lines.append(Evaluation(i, [] if i == 0 else [i], {"t": scores, "c": {"nll": 1.0, "acc": 0.5}}).to_json(4))
    (folder / "evaluations.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_spearman_per_loss_and_the_table(tmp_path):
    mod = load_bench_script("loss_vs_accuracy")
    # accuracy falls 0, .25, .5, .75: choice_nll rises with it, the gold nll falls
    mc = _run(tmp_path / "mc", [(1.0, 2.0, 0.1), (0.75, 1.9, 0.3), (0.5, 1.5, 0.6), (0.25, 1.2, 0.9)])
    ll = _run(tmp_path / "ll", [(1.0, 2.0, None), (0.5, 2.5, None), (0.5, 2.4, None)])
    out = tmp_path / "table.md"
    rows = mod.main([str(mc), str(ll), "--out", str(out)])
    assert rows[0]["choice_nll"] == pytest.approx(1.0) and rows[0]["nll"] == pytest.approx(-1.0)
    assert rows[0]["evaluations"] == 4 and rows[0]["task"] == "t"
    assert rows[1]["choice_nll"] is None and rows[1]["nll"] == pytest.approx(0.866, abs=1e-3)  # ties ranked as halves
    text = out.read_text()
    assert f"| {mc} | t | nll | 4 | -1.00 | 1.00 |" in text and f"| {ll} | t | nll | 3 | 0.87 | n/a |" in text

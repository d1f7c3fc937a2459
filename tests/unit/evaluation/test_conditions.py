"""A validation's finished conditions: kept as they end, read back by a rerun of the same settings."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from capsense.cli import main
from capsense.errors import RunFolderBusyError
from capsense.evaluation.conditions import CONDITIONS_FILE, ConditionStore
from _toy_task import TOY_CONTROL, TOY_TASK, make_toy_setup

class _Killed(Exception):
    pass


KEY = {"model": "m", "samples": {"t": [1, 2, 3]}, "dtype": "float32"}


def test_finished_conditions_are_read_back_and_other_settings_start_over(tmp_path):
    logs = []
    store = ConditionStore(tmp_path, KEY, logs.append)
    assert store.open() == {}
    store.put("base", "", {"t": {"acc,none": 0.5}}, {"t": {"acc": True}})
    store.put("ablated", "L0H1", {"t": {"acc,none": 0.25}}, {"t": {"acc": True}})
    with pytest.raises(RunFolderBusyError):  # one writer
        ConditionStore(tmp_path, KEY).open()
    store.close()
    with open(tmp_path / CONDITIONS_FILE, "a") as f:
        f.write('{"label": "random1", "heads": "L1H')  # a line a kill cut short
    again = ConditionStore(tmp_path, KEY, logs.append)
    assert set(again.open()) == {"base", "ablated"} and "2 condition(s) finished (base, ablated)" in logs[-1]
    assert again.get("ablated", "L0H1")["results"] == {"t": {"acc,none": 0.25}}
    assert again.get("ablated", "L0H2") is None and again.get("random1", "L1H1") is None  # another set: not finished
    again.put("random1", "L1H1", {"t": {"acc,none": 0.5}}, {})
    again.close()
    lines = [json.loads(x) for x in (tmp_path / CONDITIONS_FILE).read_text().splitlines()]
    assert [x.get("label") for x in lines] == [None, "base", "ablated", "random1"]  # the cut line is gone
    other = ConditionStore(tmp_path, {**KEY, "dtype": "bfloat16"}, logs.append)
    assert other.open() == {}
    other.close()
    assert "other settings (dtype)" in logs[-1] and (tmp_path / (CONDITIONS_FILE + ".stale")).is_file()
    assert json.loads((tmp_path / CONDITIONS_FILE).read_text().splitlines()[0])["key"]["dtype"] == "bfloat16"


def test_a_validation_killed_in_a_condition_resumes_where_it_stopped(tmp_path, monkeypatch):
    import lm_eval

    model, tasks = make_toy_setup(tmp_path)
    run = tmp_path / "run"
    r = CliRunner().invoke(main, ["locate", str(model), "--task", TOY_TASK, "--controls", TOY_CONTROL, "--include-path",
                                  str(tasks), "--limit", "15", "--method", "cs", "--masks", "6", "--heads-per-mask", "2",
                                  "--no-progress", "--out", str(run)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    args = ["validate", str(model), "--heads", str(run / "heads.json"), "--top-k", "2", "--tasks", f"{TOY_TASK},{TOY_CONTROL}",
            "--random", "2", "--limit", "10", "--include-path", str(tasks), "--no-progress", "--out", str(tmp_path / "val")]
    real, calls = lm_eval.simple_evaluate, []

    def dies_in_the_third(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise _Killed  # killed while the third condition runs
        return real(*a, **k)

    monkeypatch.setattr(lm_eval, "simple_evaluate", dies_in_the_third)
    with pytest.raises(_Killed):
        CliRunner().invoke(main, args, catch_exceptions=False)
    assert len((tmp_path / "val" / CONDITIONS_FILE).read_text().splitlines()) == 3  # the key and two conditions
    calls.clear()
    r = CliRunner().invoke(main, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert len(calls) == 2 and "Resuming the validation" in r.output  # the third and the fourth condition only
    resumed = json.loads((tmp_path / "val" / "validation.json").read_text())
    monkeypatch.setattr(lm_eval, "simple_evaluate", real)
    (tmp_path / "val" / CONDITIONS_FILE).unlink()
    r = CliRunner().invoke(main, args[:-1] + [str(tmp_path / "fresh")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    fresh = json.loads((tmp_path / "fresh" / "validation.json").read_text())
    assert resumed["rows"] == fresh["rows"] and resumed["verdict"] == fresh["verdict"]  # resumed = run in one go

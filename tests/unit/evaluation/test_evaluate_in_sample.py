"""evaluate with a locate run's heads file evaluates the first documents of each task, some of which the run scored
(and chose its set on): the table says how many, and where held-out numbers come from."""

from __future__ import annotations

import json

from click.testing import CliRunner

from capsense.cli import main
from capsense.core.heads import HeadsFile, write_heads_file


def test_evaluate_says_which_documents_the_locate_run_scored(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    run.mkdir()
    heads = write_heads_file(run / "heads.json", HeadsFile("tiny", [{"layer": 1, "head": 2}], {"task": "capsense_arithmetic"}))
    (run / "manifest.json").write_text(json.dumps({"probes": {"capsense_arithmetic": {"doc_ids": [0, 1, 7]},
                                                              "capsense_prose": {"doc_ids": [9]}}}))
    base = ["evaluate", str(tiny_model_dir), "--heads", str(heads), "--tasks", "capsense_arithmetic,capsense_prose"]
    r = CliRunner().invoke(main, [*base, "--limit", "3"])
    assert r.exit_code == 0, r.output
    assert ("In-sample: the locate run behind the heads file scored documents evaluated here (capsense_arithmetic 2 "
            "of the first 3); for held-out numbers use capsense validate.") in r.output
    spec = CliRunner().invoke(main, [*base[:3], "L1H2", *base[4:], "--limit", "3"])
    assert spec.exit_code == 0 and "In-sample" not in spec.output  # a spec has no run behind it
    (run / "manifest.json").write_text(json.dumps({"probes": {"capsense_arithmetic": {"doc_ids": [5]}}}))
    r = CliRunner().invoke(main, [*base, "--limit", "3"])
    assert r.exit_code == 0 and "In-sample" not in r.output  # none of the first 3 scored

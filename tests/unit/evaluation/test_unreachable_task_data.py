"""Evaluating a task whose data must be downloaded where it cannot be (HF_HUB_OFFLINE, no network): one error naming
the task and why; lm-eval's simple_evaluate raised datasets' ConnectionError as a traceback after the model loaded.
And validate given a head spec says it needs a run's heads.json (and what takes a spec), not 'file not found'."""

from __future__ import annotations

from click.testing import CliRunner

from capsense.cli import main

REMOTE = ("task: my_remote\ndataset_path: nobody/no_such_dataset\noutput_type: loglikelihood\ntest_split: test\n"
          "doc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n")


def test_evaluate_of_a_task_whose_data_cannot_be_reached_is_one_error(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "remote.yaml").write_text(REMOTE)
    r = CliRunner().invoke(main, ["evaluate", str(tiny_model_dir), "--tasks", "my_remote", "--include-path",
                                  str(tmp_path), "--limit", "2", "--heads", "L0H1"])
    assert r.exit_code == 1, r.output
    assert "task 'my_remote': its data could not be loaded (ConnectionError" in r.output
    assert "HF_HUB_OFFLINE is set" in r.output and "Traceback" not in r.output


def test_validate_given_a_head_spec_names_what_it_needs(tmp_path, tiny_model_dir):
    r = CliRunner().invoke(main, ["validate", str(tiny_model_dir), "--heads", "L0H1+L1H2", "--tasks",
                                  "capsense_arithmetic", "--out", str(tmp_path / "v")])
    assert r.exit_code == 1 and "--heads 'L0H1+L1H2' is a head spec; validation needs a locate run's heads.json" in r.output
    assert "capsense evaluate MODEL --heads L0H1+L1H2" in r.output and not (tmp_path / "v").exists()
    r = CliRunner().invoke(main, ["validate", str(tiny_model_dir), "--heads", str(tmp_path / "runs" / "heads"),
                                  "--tasks", "capsense_arithmetic", "--out", str(tmp_path / "v")])
    assert r.exit_code == 1 and "not found" in r.output, r.output  # a missing file's path is not taken for a spec

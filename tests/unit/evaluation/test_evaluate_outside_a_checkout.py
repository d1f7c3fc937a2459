"""capsense's own lm-eval calls outside a git checkout: lm-eval asks git for the working directory's commit, and git's
"fatal: not a git repository" reached the terminal once per condition, a line that reads like a failure."""

from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner

from capsense.cli import main


@pytest.mark.skipif(shutil.which("git") is None, reason="git is what prints the line")
def test_evaluate_outside_a_checkout_prints_no_git_error(tmp_path, tiny_model_dir, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["evaluate", str(tiny_model_dir), "--tasks", "capsense_arithmetic", "--limit", "2",
                                  "--heads", "L0H1"])
    assert r.exit_code == 0, r.output
    assert "| capsense_arithmetic | acc |" in r.output
    assert "not a git repository" not in capfd.readouterr().err + r.output

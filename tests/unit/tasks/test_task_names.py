"""Task names checked without lm-eval (capsense's own, include_path folders), and lm-eval's repeated hint silenced."""

from __future__ import annotations

import logging
import sys

import pytest

from capsense.tasks import check_task_names, local_task_names, quiet_lm_eval_hints
from capsense.errors import UnknownTaskError


def test_capsense_names_are_checked_without_lm_eval(tmp_path):
    assert {"capsense_induction", "capsense_prose"} <= local_task_names()
    assert check_task_names(["capsense_induction", "hellaswag"]) == ["hellaswag"]  # only lm-eval can confirm it
    with pytest.raises(UnknownTaskError, match=r"unknown task 'capsense_inducton' \(did you mean capsense_induction\?\)"):
        check_task_names(["capsense_inducton"])
    with pytest.raises(UnknownTaskError, match="no tasks given"):
        check_task_names([])
    (tmp_path / "mine.yaml").write_text("task: my_task\ndataset_path: x\n")
    assert check_task_names(["my_task"], [str(tmp_path)]) == []


def test_no_lm_eval_import_for_the_check():
    import subprocess

    code = ("import sys; from capsense.tasks import check_task_names; check_task_names(['capsense_prose']); "
            "print('lm_eval' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_custom_kwargs_hint_is_dropped(caplog):
    quiet_lm_eval_hints()
    quiet_lm_eval_hints()  # idempotent
    logger = logging.getLogger("lm_eval.api.task")
    assert len(logger.filters) == len({type(f) for f in logger.filters})
    with caplog.at_level(logging.WARNING, logger="lm_eval.api.task"):
        logger.warning("capsense_prose: Custom kwargs can be passed to `--metadata` in console (as json string)")
        logger.warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]

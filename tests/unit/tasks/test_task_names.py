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


def test_lm_eval_s_index_is_built_once_per_folders_and_each_manager_keeps_its_own_metadata(tmp_path):
    """A command asked for lm-eval's whole index (about 6 s) at each step that named a task only lm-eval declares;
    now once per process and folders. Each manager still hands its tasks its own metadata (the tokenizer capsense's
    tasks count with), and a folder whose YAMLs change is read again."""
    from lm_eval.tasks import get_task_dict

    from capsense.tasks import _lm_eval_index, task_manager
    from capsense.tasks.common import SharedTokenizer
    from conftest import make_char_tokenizer

    (tmp_path / "mine.yaml").write_text("task: my_task\ndataset_path: x\n")
    _lm_eval_index.cache_clear()
    plain = task_manager([str(tmp_path)], ["wikitext", "my_task"])
    tok = make_char_tokenizer()
    with_tok = task_manager([str(tmp_path)], ["wikitext"], metadata={"tokenizer": tok})
    assert _lm_eval_index.cache_info().misses == 1 and _lm_eval_index.cache_info().hits == 1
    given = get_task_dict(["capsense_arithmetic"], with_tok)["capsense_arithmetic"].config.metadata["tokenizer"]
    assert isinstance(given, SharedTokenizer) and given.tokenizer is tok
    assert "tokenizer" not in (get_task_dict(["capsense_arithmetic"], plain)["capsense_arithmetic"].config.metadata or {})
    (tmp_path / "more.yaml").write_text("task: my_other_task\ndataset_path: x\n")
    assert "my_other_task" in task_manager([str(tmp_path)], ["wikitext", "my_other_task"]).all_tasks
    assert _lm_eval_index.cache_info().misses == 2

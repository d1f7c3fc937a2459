"""Control suites: spec expansion, and the suite tasks' data."""

from __future__ import annotations

import importlib

import pytest

from capsense.tasks import local_task_names
from capsense.tasks.suite import HELD_OUT, SCREEN, expand_controls, held_out_controls, suite_of
from capsense.errors import CapsenseError


def test_default_expands_without_the_target_and_keeps_named_tasks():
    assert expand_controls(["default"], "capsense_induction") == list(SCREEN)
    got = expand_controls("default,capsense_arithmetic", "capsense_prose")
    assert "capsense_prose" not in got and got[-1] == "capsense_arithmetic" and len(got) == len(SCREEN)
    assert expand_controls(["default", "-capsense_dates"], "t") == [c for c in SCREEN if c != "capsense_dates"]
    assert expand_controls(["capsense_arithmetic", "default"], "t")[0] == "capsense_arithmetic"
    assert expand_controls(["none"], "t") == [] and expand_controls([], "t") == []


def test_a_suite_leaves_out_tasks_built_on_the_target_but_keeps_them_when_named():
    got = expand_controls("default", "capsense_arithmetic")
    assert "capsense_conversions" not in got and len(got) == len(SCREEN) - 1
    assert "capsense_conversions" in expand_controls("default", "capsense_induction")
    assert expand_controls("default,capsense_conversions", "capsense_arithmetic")[-1] == "capsense_conversions"
    assert "capsense_math_problems" not in held_out_controls("capsense_arithmetic", [])
    assert "capsense_math_problems" in held_out_controls("capsense_induction", [])


@pytest.mark.parametrize("spec,match", [
    (["none", "capsense_prose"], "stands alone"),
    (["-capsense_prose"], "not among the controls"),
    (["default", "-default"], "leaves no control"),
])
def test_bad_specs_are_refused(spec, match):
    with pytest.raises(CapsenseError, match=match):
        expand_controls(spec, "capsense_induction")


def test_held_out_suite_is_disjoint_from_the_screen_and_from_what_the_search_used():
    assert not set(SCREEN) & set(HELD_OUT)
    assert {"capsense_translation", "capsense_agreement", "capsense_letters"} <= set(HELD_OUT)  # round 17's families
    assert held_out_controls("capsense_qa", ["capsense_recall"]) == [t for t in HELD_OUT if t not in ("capsense_qa", "capsense_recall")]
    assert suite_of("capsense_facts") == "default" and suite_of("capsense_qa") == "held-out" and suite_of("x") is None


def test_every_suite_task_is_declared():
    assert set(SCREEN) | set(HELD_OUT) <= local_task_names()


@pytest.mark.parametrize("module", ["facts", "names", "dates", "syntax", "dialogue", "recall", "conversions", "categories",
                                    "translation", "letters"])
def test_suite_task_documents(module):
    docs = importlib.import_module(f"capsense.tasks.{module}").make_docs()
    assert len(docs) >= 30
    assert [d["id"] for d in docs] == list(range(len(docs)))
    pairs = [(d["context"], d["continuation"]) for d in docs]
    assert len(set(pairs)) == len(pairs)  # no document twice
    for c, t in pairs:
        assert c and t.strip() and not c.endswith(" ")  # lm-eval moves trailing context spaces anyway

"""capsense validate: held-out documents, top-K vs random K, table/JSON/chart, bad input."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from capsense.cli import main
from capsense.evaluation.validate import held_out_documents, note_strong_random_heads, random_head_sets, strong_heads_in
from capsense.core.heads import HeadSet, HeadsFile
from _toy_task import TOY_CONTROL, TOY_GEN, TOY_TASK, make_toy_setup


@pytest.fixture(scope="module")
def located(tmp_path_factory):
    root = tmp_path_factory.mktemp("val")
    model, tasks = make_toy_setup(root)
    run = root / "run"
    r = CliRunner().invoke(main, [
        "locate", str(model), "--task", TOY_TASK, "--controls", TOY_CONTROL, "--include-path", str(tasks),
        "--limit", "15", "--method", "cs", "--masks", "10", "--heads-per-mask", "2", "--no-progress", "--out", str(run),
    ], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return model, tasks, run


def test_validate_uses_held_out_documents_and_writes_the_table(located, tmp_path):
    model, tasks, run = located
    out = tmp_path / "val"
    r = CliRunner().invoke(main, [
        "validate", str(model), "--heads", str(run / "heads.json"), "--top-k", "2", "--tasks",
        f"{TOY_TASK},{TOY_CONTROL}", "--random", "2", "--limit", "10", "--include-path", str(tasks), "--out", str(out),
    ], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "| task | metric | base | ablated | change | random-K mean (sd) |" in r.output
    data = json.loads((out / "validation.json").read_text())
    manifest = json.loads((run / "manifest.json").read_text())
    for task in (TOY_TASK, TOY_CONTROL):
        held = set(data["samples"][task])
        assert len(held) == 10
        assert not held & set(manifest["probes"][task]["doc_ids"])
    assert {row["task"] for row in data["rows"]} == {TOY_TASK, TOY_CONTROL}
    row = data["rows"][0]
    assert len(row["random_values"]) == 2 and row["change"] == pytest.approx(row["ablated"] - row["base"])
    top2 = [f"L{h['layer']}H{h['head']}" for h in json.loads((run / "heads.json").read_text())["heads"][:2]]
    assert data["heads"] == "+".join(top2)
    assert data["versions"] == manifest["versions"] and data["host"]["cpu"] == manifest["host"]["cpu"]  # one record
    assert {k: data["host"][k] for k in ("device", "device_map")} == {"device": "cpu", "device_map": None}
    assert (out / "validation.png").stat().st_size > 1000 and (out / "validation.md").is_file()
    assert f"- model: `{model}`" in (out / "validation.md").read_text().splitlines()  # which model, no revision
    assert isinstance(data["verdict"]["random_strong_heads"], list)  # each random set's strongest heads, if any


def test_lm_eval_warnings_after_a_validation_reach_the_stderr_of_their_moment(located, tmp_path, monkeypatch, caplog,
                                                                              capsys):
    """A validation run with a borrowed stderr (click's runner here; a notebook's capture, ``redirect_stderr``) leaves
    no lm-eval handler on it: a later lm-eval warning is a record the process's handlers get, not text written to
    the borrowed stream (or, once that is closed, a "--- Logging error ---" traceback). lm-eval's logging starts as
    in a fresh process."""
    import logging

    import lm_eval.utils

    model, tasks, run = located
    lm_logger = logging.getLogger("lm_eval")
    monkeypatch.setattr(lm_eval.utils, "_LOGGING_CONFIGURED", False)
    monkeypatch.setattr(lm_logger, "handlers", [])
    monkeypatch.setattr(lm_logger, "propagate", True)
    monkeypatch.setattr(lm_logger, "level", logging.NOTSET)
    r = CliRunner().invoke(main, [
        "validate", str(model), "--heads", str(run / "heads.json"), "--top-k", "2", "--tasks", TOY_TASK, "--random", "0",
        "--limit", "4", "--include-path", str(tasks), "--no-progress", "--out", str(tmp_path / "val"),
    ], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert lm_logger.handlers == [] and lm_logger.level == logging.NOTSET  # nothing left behind
    capsys.readouterr()
    with caplog.at_level(logging.WARNING):
        logging.getLogger("lm_eval.api.task").warning("a later lm-eval warning")
    assert "a later lm-eval warning" in caplog.text
    assert "Logging error" not in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--top-k", "13", "--tasks", TOY_TASK], "--top-k 13 is more than the 12 heads"),
    (["--top-k", "2", "--tasks", "no_such_task_xyz"], "no_such_task_xyz"),
])
def test_validate_bad_input(located, tmp_path, extra, message):
    model, tasks, run = located
    r = CliRunner().invoke(main, ["validate", str(model), "--heads", str(run / "heads.json"), "--include-path",
                                  str(tasks), "--out", str(tmp_path / "v"), *extra])
    assert r.exit_code == 1 and message in r.output, r.output


def test_a_task_the_locate_run_used_up_is_refused_before_the_model_loads(located, tmp_path, monkeypatch):
    """A locate run that scored every document of a task leaves none to validate on: one error naming the counts
    and what to do, before the model loads (a 70B load takes minutes)."""
    import shutil

    from capsense.evaluation import evaluate

    model, tasks, run = located
    used_up = tmp_path / "run"
    shutil.copytree(run, used_up)
    manifest = json.loads((used_up / "manifest.json").read_text())
    manifest["probes"][TOY_TASK]["doc_ids"] = list(range(40))  # the toy task's 40 documents
    (used_up / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(evaluate, "load_lm", lambda *a, **k: pytest.fail("the model was loaded"))
    r = CliRunner().invoke(main, ["validate", str(model), "--heads", str(used_up / "heads.json"), "--top-k", "2",
                                  "--tasks", TOY_TASK, "--include-path", str(tasks), "--out", str(tmp_path / "v")])
    assert r.exit_code == 1, r.output
    assert (f"task '{TOY_TASK}': no documents left after excluding the 40 the locate run scored (of 40): locate with "
            "fewer documents (its limit, or control_limit for a control) to hold some out, or leave the task out of "
            "--tasks") in r.output
    assert not (tmp_path / "v").exists()


def test_held_out_and_random_sets():
    docs = held_out_documents(50, used=range(0, 50, 2), limit=10, seed=0)
    assert len(docs) == 10 and all(d % 2 for d in docs)
    assert docs == held_out_documents(50, used=range(0, 50, 2), limit=10, seed=0)
    avoid = HeadSet.from_spec("L0H0+L0H1")
    sets = random_head_sets(3, 4, 2, 5, 0, avoid)
    assert len(sets) == 5 and all(len(s) == 2 and not set(s) & set(avoid) for s in sets)


def test_each_validated_set_gets_its_own_reproducible_random_draw():
    """Keyed on the set under test (its heads, in any order) and the seed. Keyed on the seed alone, every set on
    Gemma 3's 18 x 4 heads got random sets at the same pool positions: two of three held an L11 head each time."""
    a, b = HeadSet.from_spec("L5H1+L6H1+L17H0+L15H0+L10H3"), HeadSet.from_spec("L13H1+L13H2+L2H1+L1H3+L0H1")
    draw = random_head_sets(18, 4, 5, 3, 0, a)
    assert draw == random_head_sets(18, 4, 5, 3, 0, HeadSet.from_spec("L10H3+L15H0+L17H0+L6H1+L5H1"))
    assert draw != random_head_sets(18, 4, 5, 3, 1, a)
    other = random_head_sets(18, 4, 5, 3, 0, b)
    assert all(not set(s) & set(b) for s in other) and other != draw
    # two sets that differ in one head of the last layers leave the same pool up to its end: a draw keyed on the
    # seed alone gave both the same three random sets
    c, d = HeadSet.from_spec("L17H0+L17H1+L17H2+L17H3+L16H3"), HeadSet.from_spec("L17H0+L17H1+L17H2+L17H3+L16H2")
    assert random_head_sets(18, 4, 5, 3, 0, c) != random_head_sets(18, 4, 5, 3, 0, d)


def test_random_sets_holding_the_runs_strongest_single_heads_are_named_in_the_verdict():
    """Gemma 3's mean-ablation run (round 33): L11H2, the #1 single head on induction, set aside by the screen
    for conversions, sat in two of the three random sets; the verdict's line now says so."""
    eff = {"L11H2": 237.0, "L4H1": 51.8, "L10H1": 47.5, "L5H1": 29.1, "L8H1": 3.0, "L0H0": 0.5, "L3H3": None}
    hf = HeadsFile("m", [{"layer": int(h[1:h.index("H")]), "head": int(h[h.index("H") + 1:]), "target_effect": e}
                         for h, e in eff.items()],
                   {"screen": {"excluded": [{"head": "L11H2", "control": "conversions", "damage": 0.317}]}})
    randoms = [HeadSet.from_spec(s) for s in ("L0H0+L3H3+L2H2", "L11H2+L7H2+L6H3", "L8H1+L10H1+L1H1")]
    found = strong_heads_in(hf, randoms, 5)
    assert found == [
        {"random_set": 2, "heads": [{"head": "L11H2", "rank": 1, "target_effect": 237.0,
                                     "set_aside_for": "conversions", "control_damage": 0.317}]},
        {"random_set": 3, "heads": [{"head": "L8H1", "rank": 5, "target_effect": 3.0},
                                    {"head": "L10H1", "rank": 3, "target_effect": 47.5}]}]  # L0H0 is #6: not named
    verdict = {"line": "NOT selective: the target itself is not clearly hurt"}
    note_strong_random_heads(verdict, found)
    assert verdict["random_strong_heads"] == found
    assert verdict["line"].endswith(
        "random 2 holds L11H2 (the run's #1 single head on the target, +23700%, set aside by the collateral screen "
        "for conversions +31.7%); random 3 holds L8H1 (the run's #5 single head on the target, +300%), "
        "L10H1 (the run's #3 single head on the target, +4750%)")
    plain = {"line": "selective"}
    note_strong_random_heads(plain, strong_heads_in(hf, randoms[:1], 5))
    assert plain == {"line": "selective", "random_strong_heads": []}


def test_validate_on_a_model_split_over_devices_gives_the_same_table(located, tmp_path):
    """--device-map (lm-eval's parallelize=True): layers on cpu and offloaded to disk, same numbers."""
    model, tasks, run = located
    split = json.dumps({"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                        "model.layers.2": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"})
    tables = []
    for extra in ([], ["--device-map", split]):
        out = tmp_path / f"val{len(extra)}"
        r = CliRunner().invoke(main, [
            "validate", str(model), "--heads", str(run / "heads.json"), "--top-k", "2", "--tasks", TOY_GEN,
            "--random", "1", "--limit", "6", "--include-path", str(tasks), "--out", str(out), *extra,
        ], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        tables.append(json.loads((out / "validation.json").read_text())["rows"])
    assert tables[0] == tables[1]
    assert any(row["ablated"] != row["base"] for row in tables[0])  # graded char_code: the table is not trivially equal


def test_validate_refuses_a_device_that_does_not_exist(located, tmp_path):
    model, tasks, run = located
    r = CliRunner().invoke(main, [
        "validate", str(model), "--heads", str(run / "heads.json"), "--tasks", TOY_TASK, "--include-path", str(tasks),
        "--out", str(tmp_path / "v"), "--device-map", '{"": "cuda:5"}',
    ])
    assert r.exit_code != 0 and "device 'cuda:5' does not exist on this machine" in r.output
    assert not (tmp_path / "v").exists()


def test_tasks_without_accuracy_get_no_acc_row():
    """capsense_prose's lm-eval ``acc`` (greedy match of whole sentences) is 0 for every head set:
    the table used to print it as an ``acc`` row of zeros."""
    from capsense.evaluation.evaluate import MetricRow
    from capsense.evaluation.validate import format_validation, validation_rows

    def row(task, metric, v):
        return MetricRow(task=task, metric=metric, values={"base": v, "ablated": v, "random1": v})

    raw = [row("capsense_prose", "acc", 0.0), row("capsense_prose", "nats_per_token", 3.3),
           row("capsense_arithmetic", "acc", 0.0), row("capsense_arithmetic", "nats_per_token", 1.0)]
    rows = validation_rows(raw, 1)
    assert [(r.task, r.metric) for r in rows] == [
        ("capsense_prose", "nats_per_token"), ("capsense_arithmetic", "acc"), ("capsense_arithmetic", "nats_per_token")]
    assert "| capsense_prose | acc |" not in format_validation(rows)


def test_no_progress_prints_a_line_for_the_phase_instead_of_a_bar(located, tmp_path):
    """``--no-progress`` on validate, as on locate and run (round 28: a script's log filled with bar redraws)."""
    model, tasks, run = located
    args = ["validate", str(model), "--heads", str(run / "heads.json"), "--top-k", "2", "--tasks", TOY_TASK,
            "--random", "1", "--limit", "4", "--include-path", str(tasks)]
    bar = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "bar")], catch_exceptions=False)
    quiet = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "quiet"), "--no-progress"], catch_exceptions=False)
    assert bar.exit_code == 0 == quiet.exit_code, quiet.output
    assert "%|" in bar.output and "%|" not in quiet.output
    assert "validate: 3 conditions" in quiet.output and "Verdict:" in quiet.output

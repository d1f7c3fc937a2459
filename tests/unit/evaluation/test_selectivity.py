"""The selectivity verdict of a validation, and which tasks a validation runs by default."""

from __future__ import annotations

import pytest

from capsense.core.heads import HeadsFile
from capsense.evaluation.selectivity import judge, target_hit
from capsense.evaluation.validate import ValidationRow, validation_tasks
from capsense.tasks.suite import HELD_OUT


def row(task, metric, base, ablated, randoms=(), hib=None):
    return ValidationRow(task, metric, base, ablated, ablated - base, None, None, None, None, None, list(randoms), hib)


def test_selective_only_when_every_off_target_row_is_within_tolerance():
    rows = [
        row("capsense_induction", "acc", 0.70, 0.02, [0.69, 0.70]),  # the target: never judged
        row("capsense_prose", "acc", 0.0, 0.0),  # no usable accuracy: prose is judged by its nats/token
        row("capsense_prose", "nats_per_token", 3.3, 3.35, [3.31, 3.32]),  # +1.5%
        row("capsense_qa", "acc", 0.60, 0.57, [0.60, 0.58]),  # 5% worse
        row("capsense_qa", "nats_per_token", 0.9, 1.2),  # +33%, but qa is judged by its accuracy
    ]
    v = judge(rows, "capsense_induction", ["capsense_prose"], tolerance=0.10)
    assert v["selective"] and v["line"].startswith("selective")
    assert v["worst"]["task"] == "capsense_qa" and v["worst"]["role"] == "held-out"
    assert v["worst"]["worsening"] == pytest.approx(0.05)
    assert {r["task"] for r in v["rows"]} == {"capsense_prose", "capsense_qa"}

    rows.append(row("capsense_sequence", "acc", 0.36, 0.32, [0.36, 0.32, 0.40]))  # -11%, as a random set did
    v = judge(rows, "capsense_induction", ["capsense_prose"], tolerance=0.10)
    assert v["selective"] and "beyond tolerance but within noise (the random-K band, or one document): capsense_sequence acc" in v["line"]
    rows.append(row("capsense_recall", "acc", 0.65, 0.25, [0.66, 0.62]))  # a held-out control wrecked
    v = judge(rows, "capsense_induction", ["capsense_prose"], tolerance=0.10)
    assert not v["selective"]
    assert v["line"].startswith("NOT selective") and "capsense_recall acc +61.5% worse (held-out" in v["line"]
    assert v["worst_held_out"]["task"] == "capsense_recall"


def test_a_band_of_zero_width_is_one_document_wide():
    """Every random set left dates where it was (a band of zero width): a one-document loss, beyond the tolerance
    (1 of 9 correct: -11.1%), is the row's resolution and passes with its caveat; two documents fail."""
    target = row("t", "acc", 0.7, 0.1, [0.7, 0.68, 0.7])
    one = judge([target, row("dates", "acc", 9 / 25, 8 / 25, [9 / 25] * 3)], "t", [], documents={"dates": 25})
    assert one["selective"] and one["rows"][0]["documents_net"] == 1 and one["rows"][0]["random_band"] == 0.0
    assert "within noise (the random-K band, or one document): dates acc" in one["line"]
    two = judge([target, row("dates", "acc", 9 / 25, 7 / 25, [9 / 25] * 3)], "t", [], documents={"dates": 25})
    assert not two["selective"] and "net 2 of 25 documents" in two["line"]
    lost_one = judge([row("t", "acc", 0.7, 0.7 - 1 / 40, [0.7] * 3), row("x", "acc", 0.5, 0.5, [0.5] * 3)], "t", [],
                     documents={"t": 40, "x": 40})
    assert not lost_one["selective"]  # a target down by one document is not clearly hurt either


def test_direction_low_accuracies_and_the_random_band():
    rows = [
        row("t", "acc", 0.7, 0.1, [0.7, 0.68]),  # the target, wrecked
        row("a", "acc", 0.05, 0.0),  # too low a base to judge an accuracy: a is judged by its nats/token
        row("a", "nats_per_token", 3.0, 3.03),
        row("b", "nats_per_token", 2.0, 1.9),  # lower is better: an improvement
        row("c", "exact_match", 0.5, 0.48, hib=True),  # declared higher-is-better: 4% worse
        row("c", "nats_per_token", 1.0, 1.3),  # reported, not judged: c has a usable accuracy
        row("d", "nats_per_token", 2.0, 2.1, [2.0, 2.0, 2.001]),  # 5% worse, random sets ~0: above the random band
    ]
    v = judge(rows, "t", [], tolerance=0.10)
    judged = {r["task"]: r for r in v["rows"]}
    assert [(r["task"], r["metric"]) for r in v["rows"]] == [("a", "nats_per_token"), ("b", "nats_per_token"),
                                                             ("c", "exact_match"), ("d", "nats_per_token")]
    assert judged["b"]["worsening"] == pytest.approx(-0.05)
    assert judged["c"]["worsening"] == pytest.approx(0.04)
    assert v["selective"] and not judged["d"]["within_random"] and "within tolerance but above the random-K band: d" in v["line"]
    no_random = judge([row("x", "acc", 0.5, 0.3)], "t", [])  # 40% worse and no random set to call it noise
    assert not no_random["selective"]
    assert not judge([row("t", "acc", 0.7, 0.0)], "t", [])["selective"]  # nothing off-target: not judged


def test_default_validation_tasks_add_the_held_out_suite():
    hf = HeadsFile(model="m", heads=[{"layer": 0, "head": 0}], meta={"task": "capsense_induction",
                                                                     "controls": ["capsense_facts", "capsense_qa"]})
    tasks = validation_tasks(hf, None)
    assert tasks[:3] == ["capsense_induction", "capsense_facts", "capsense_qa"]
    assert tasks[3:] == [t for t in HELD_OUT if t != "capsense_qa"]  # the search scored qa: not held out
    assert validation_tasks(hf, ["capsense_induction", "held-out"]) == ["capsense_induction", *HELD_OUT]


def test_a_set_that_spares_the_target_is_not_selective():
    rows = [row("t", "acc", 1.0, 1.0, [1.0, 1.0, 1.0]),  # the target untouched (Gemma 3, a saturated copy task)
            row("c", "acc", 0.5, 0.49, [0.3, 0.35, 0.4])]
    v = judge(rows, "t", [], tolerance=0.10)
    assert not v["selective"] and v["line"].startswith("NOT selective: the target itself is not clearly hurt")
    assert v["target"]["worsening"] == 0.0


def test_target_hit_is_the_one_rule_judge_and_the_audits_use():
    assert target_hit(0.5, None, 0.10)  # no random set to compare with: the tolerance decides
    assert target_hit(0.5, False, 0.10)
    assert not target_hit(0.5, True, 0.10)  # within what random heads do
    assert not target_hit(0.10, False, 0.10) and not target_hit(None, False, 0.10)
    rows = [row("t", "acc", 1.0, 0.2, [1.0, 0.9, 0.95]), row("c", "acc", 0.5, 0.5, [0.5, 0.5, 0.5])]
    v = judge(rows, "t", [], tolerance=0.10)
    assert v["selective"] == target_hit(v["target"]["worsening"], v["target"]["within_random"], 0.10) is True


def test_accuracy_rows_count_the_documents_their_change_is():
    """Round 18's antonyms set: held-out translation 0.25 -> 0.125 on 40 documents is 5 documents, where
    the worst random set moved 3; the count is quoted, the verdict rule is unchanged."""
    rows = [row("t", "acc", 0.925, 0.8, [0.925, 0.9, 0.925]),
            row("tr", "acc", 0.25, 0.125, [0.225, 0.175, 0.25]),
            row("tr", "nats_per_token", 2.30, 2.36),
            row("p", "nats_per_token", 3.27, 3.24, [3.3, 3.28, 3.27]),
            row("q", "acc", 0.55, 0.53, [0.55, 0.55, 0.5])]  # 0.53 x 40 is no whole count: no documents quoted
    docs = {"t": 40, "tr": 40, "p": 40, "q": 40}
    v = judge(rows, "t", [], tolerance=0.10, documents=docs)
    judged = {r["task"]: r for r in v["rows"]}
    assert (judged["tr"]["documents_net"], judged["tr"]["documents"]) == (5, 40)
    assert judged["p"]["documents_net"] is None and judged["q"]["documents_net"] is None  # nats/token; no whole count
    assert v["target"]["documents_net"] == 5
    assert not v["selective"] and "capsense" not in v["line"]
    assert "tr acc +50.0% worse (held-out, random-K worst +30.0%, net 5 of 40 documents, z 1.4)" in v["line"]
    assert judged["tr"]["z"] == pytest.approx(1.43, abs=0.01) and judged["p"]["z"] is None
    gained = judge([row("t", "acc", 0.9, 0.1, [0.9]), row("g", "acc", 0.5, 0.6, [0.5])], "t", [], documents={"g": 20})
    assert gained["rows"][0]["documents_net"] == -2  # two documents gained
    plain = judge(rows, "t", [], tolerance=0.10)  # no counts given: the same verdict, no counts quoted
    assert plain["selective"] == v["selective"] and "of 40 documents" not in plain["line"]
    assert plain["line"] == v["line"].replace(", net 5 of 40 documents, z 1.4", "")


def test_a_loss_beyond_its_documents_noise_fails_inside_a_wide_random_band():
    """Round 32, Gemma 3's sequence set: held-out letters 0.95 -> 0.325 on 40 documents (25 lost, z 5.8)
    passed because random 5-head sets cost letters 68-89% too; "barely moves" was false, so it fails now.
    A one-document flip inside the band (dates 0.36 -> 0.32 on 25) stays noise, as does a row whose
    documents are not given (the band alone decides, as before)."""
    from capsense.evaluation.selectivity import NOISE_Z, document_z

    rows = [row("t", "acc", 0.70, 0.05, [0.70, 0.68, 0.69]),  # the target, wrecked
            row("letters", "acc", 0.95, 0.325, [0.10, 0.10, 0.30]),
            row("dates", "acc", 0.36, 0.32, [0.36, 0.32, 0.40])]
    docs = {"t": 40, "letters": 40, "dates": 25}
    v = judge(rows, "t", [], tolerance=0.10, documents=docs)
    judged = {r["task"]: r for r in v["rows"]}
    assert judged["letters"]["within_random"] and judged["letters"]["z"] == pytest.approx(5.8, abs=0.05)
    assert judged["letters"]["fails"] and not judged["dates"]["fails"]  # each row records how it was judged
    assert judged["letters"]["z"] >= NOISE_Z > judged["dates"]["z"]
    assert not v["selective"]
    assert v["line"].startswith("NOT selective: 1 off-target row(s) beyond the 10% tolerance and beyond noise")
    assert "letters acc +65.8% worse (held-out, random-K worst +89.5%, net 25 of 40 documents, z 5.8)" in v["line"]
    without_letters = judge([rows[0], rows[2]], "t", [], tolerance=0.10, documents=docs)
    assert without_letters["selective"] and "beyond tolerance but within noise (the random-K band, or one document): dates acc" in without_letters["line"]
    assert judge(rows, "t", [], tolerance=0.10)["selective"]  # no documents given: the band alone, as before
    assert document_z(0.5, 0.5, 40) == 0.0 and document_z(1.0, 1.0, 40) == 0.0 and document_z(0.5, 0.6, 40) < 0

"""What the chosen set does to the target's accuracy when the run chose it by a loss (round 27's multiple-choice task)."""

from __future__ import annotations

from capsense.localize.choice import ACCURACY_SHOWS, accuracy_line, chosen_accuracy
from capsense.localize.config import LocateConfig
from capsense.localize.store import Evaluation


def _ev(i: int, heads: list[int], acc: float, round_: int = 0, choices: bool = False) -> Evaluation:
    scores = {"nll": 1.0 + len(heads), "acc": acc, **({"choice_nll": 0.1 + len(heads)} if choices else {})}
    return Evaluation(i, heads, {"t": scores}, round=round_)


def test_nll_damage_that_accuracy_does_not_show_is_said(tmp_path):
    cfg = LocateConfig(model="m", task="t", out=str(tmp_path))
    search_clean, refine_clean = _ev(0, [], 0.5), _ev(9, [], 1.0, -1)  # refine's own precision comes last
    kept = chosen_accuracy(cfg, [search_clean, _ev(1, [3, 1], 0.0), refine_clean, _ev(10, [1, 3], 0.92, -1)], [1, 3])
    # the set measured last, against refine's clean
    assert kept == {"clean": 1.0, "chosen": 0.92, "nll_only": True, "metric": "nll", "choices": False}
    line = accuracy_line(kept)
    assert line.startswith("the chosen set takes the target's accuracy on the run's documents from 1.000 to 0.920, "
                           f"less than {100 * ACCURACY_SHOWS:.0f}% down: its nll damage does not show as accuracy")
    assert "choice_nll" not in line  # a target without choices has no choice_nll to point to
    wrecked = chosen_accuracy(cfg, [refine_clean, _ev(10, [1, 3], 0.1, -1)], [3, 1])
    assert wrecked["nll_only"] is False and "does not show" not in accuracy_line(wrecked)
    assert chosen_accuracy(cfg, [_ev(0, [], 0.0), _ev(1, [1, 3], 0.0)], [1, 3]) is None  # no accuracy to lose
    assert chosen_accuracy(cfg, [refine_clean], [1, 3]) is None  # the set was never measured
    cfg.metric = "acc"  # chosen by accuracy itself: nothing to add
    assert chosen_accuracy(cfg, [refine_clean, _ev(10, [1, 3], 0.92, -1)], [1, 3]) is None


def test_a_multiple_choice_target_chosen_by_nll_is_pointed_to_choice_nll(tmp_path):
    """By nll, a multiple-choice target whose accuracy did not move is pointed to choice_nll; chosen by choice_nll,
    the same line names that loss and points nowhere else."""
    cfg = LocateConfig(model="m", task="t", out=str(tmp_path))
    evals = [_ev(0, [], 1.0, choices=True), _ev(1, [1, 3], 0.95, choices=True)]
    by_nll = chosen_accuracy(cfg, evals, [1, 3])
    assert by_nll["choices"] is True and "metric choice_nll scores the choice" in accuracy_line(by_nll)
    cfg.metric = "choice_nll"
    by_choice = chosen_accuracy(cfg, evals, [1, 3])
    line = accuracy_line(by_choice)
    assert by_choice["metric"] == "choice_nll" and "its choice_nll damage does not show as accuracy" in line
    assert "metric choice_nll scores" not in line and line.endswith("validate before relying on it")

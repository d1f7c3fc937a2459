"""recipes/bench/record_perdoc_sweep.py (per-document sweeps) and replay_racing.py (raced singles) on a
tiny model and on synthetic effects."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from capsense.scoring.cost import mask_cost

from conftest import load_bench_script


def _rows(path: Path) -> tuple[dict, list[dict]]:
    return load_bench_script("record_perdoc_sweep").read_rows(path)


def test_perdoc_sweep_matches_the_exhaustive_run_and_resumes(tiny_model_dir, tmp_path):
    """The recorder's aggregate equals the library's exhaustive sweep (same probe, same scorer), its
    per-document nats add up to that aggregate, and a cut run resumes to the same file."""
    task = "capsense_induction"
    load_bench_script("bench_locate_recovery").main(["--model", str(tiny_model_dir), "--root", str(tmp_path / "runs"), "--tasks", task,
                                         "--stages", "sweep", "--sweeps-json", str(tmp_path / "ref.json"),
                                         "--results", str(tmp_path / "recovery")])
    ref = json.loads((tmp_path / "ref.json").read_text())[task]
    rec = load_bench_script("record_perdoc_sweep")
    out = tmp_path / "perdoc.jsonl"
    argv = ["--model", str(tiny_model_dir), "--task", task, "--out", str(out)]
    rec.main([*argv, "--max-masks", "5"])
    head, rows = _rows(out)
    assert len(rows) == 5 and head["reuse_share"] == 1.0 and head["scorer"] == "PrefixReuseScorer"
    rec.main([*argv, "--fold-into", str(tmp_path / "mine.json")])  # resumes: the other 8 evaluations
    head, rows = _rows(out)
    assert [r["heads"] for r in rows] == [[]] + [[h] for h in range(12)]
    tokens = np.array(head["tokens"])
    for r in rows:  # token-weighted per-document nats give the scorer's own nll
        assert abs(sum(r["nats"]) / tokens.sum() - r["nll"]) < 1e-6
    mine = json.loads((tmp_path / "mine.json").read_text())[task]
    assert mine["top5"] == ref["top5"] and mine["forward_equivalents"] == ref["forward_equivalents"]
    assert max(abs(mine["effects"][h] - ref["effects"][h]) for h in ref["effects"]) < 1e-5
    assert abs(mine["clean_nll"] - ref["clean_nll"]) < 1e-6
    check = rec.compare(out, tmp_path / "ref.json")
    assert check["max_abs_effect_diff"] < 1e-5 and check["top5"] == ref["top5"] and check["fe"] == ref["forward_equivalents"]
    with pytest.raises(SystemExit, match="another probe"):
        rec.main([*argv, "--limit", "6"])


def test_multiple_choice_counts_the_gold_choice_per_document(tiny_model_dir, tmp_path):
    rec = load_bench_script("record_perdoc_sweep")
    out = tmp_path / "mc.jsonl"
    rec.main(["--model", str(tiny_model_dir), "--task", "capsense_antonyms", "--limit", "5", "--out", str(out),
              "--max-masks", "8"])
    head, rows = _rows(out)
    assert head["kind"] == "multiple_choice" and len(head["tokens"]) == 5
    assert head["reuse_share"] == 1.0 and head["scorer"] == "SharedPrefixScorer"  # knockouts start at their layer
    for r in rows:
        assert abs(sum(r["nats"]) / sum(head["tokens"]) - r["nll"]) < 1e-6
        assert all(c in (0.0, 1.0) for c in r["correct"]) and r["cpu_s"] > 0
        want = mask_cost(r["heads"], head["n_layers"], head["n_heads"], 1.0)
        assert r["fe"] == pytest.approx(want)
    assert rows[0]["fe"] == 1.0 and min(r["fe"] for r in rows) < 1.0  # the clean forward, then cheaper knockouts


def _replay(n_heads: int = 4, folded: float = 0.0):
    bench, racing = load_bench_script("bench_locate_recovery"), load_bench_script("replay_racing")
    eff = np.zeros(4 * n_heads)
    eff[[1, 6, 9, 12, 15]] = [2.0, 1.5, 1.2, 1.0, 0.9]
    eff[[0, 3]] = [0.3, 0.2]
    return bench, racing, racing.Replay(eff, 4, n_heads, 1.0, bench.overlap, folded=folded)


def test_without_racing_the_replay_is_replay_prior():
    from capsense.localize.prior import PriorSettings

    for folded in (0.0, 1.0):  # the clean forward paid (before round 10) or folded into the attribution's
        bench, racing, rp = _replay(folded=folded)
        est = rp.eff.copy()
        est[9] = 0.0  # a miss of the estimate, found by a group split
        ref = load_bench_script("replay_prior").replay(est, rp.eff, bench.Layout(4, 4), 1.0, PriorSettings(top_m=32, group_size=16),
                                           bench.overlap, folded)
        mine = racing.racing(rp, racing.single_order(est, rp.cost, 32), None, 1.0)
        assert (mine["fe_4of5"], mine["fe_5of5"], mine["spent"]) == (ref["fe_4of5"], ref["fe_5of5"], ref["spent"])


def test_racing_parks_small_heads_at_their_subset_cost():
    _, racing, rp = _replay()
    order = racing.single_order(rp.eff + 0.01, rp.cost, 32)  # every head, largest first
    today = racing.racing(rp, order, None, 1.0)
    raced = racing.racing(rp, order, rp.eff.copy(), 0.25)  # the subset tells the truth
    assert raced["parked"] == 11 and raced["parked_true_top5"] == 0  # all but the top 5
    assert raced["fe_5of5"] == today["fe_5of5"] and raced["spent"] < today["spent"]
    late = [0, 3, 12, 6, 1, 9, 15]  # the first five are measured in full whatever their subset says
    noisy = rp.eff.copy()
    noisy[15] = 0.0  # the subset misses a true top-5 head: it is parked and 5/5 is never reached
    lost = racing.racing(rp, late, noisy, 0.25)
    assert lost["parked"] == 1 and lost["parked_true_top5"] == 1
    assert lost["fe_5of5"] is None and lost["fe_4of5"] is not None
    # parked heads kept in the group knockouts: the lost head is found by a split of its group (on 32
    # heads, whose sweep cost caps the budget above what the splits need)
    _, _, rp = _replay(n_heads=8)
    lost = racing.racing(rp, late, np.array(noisy[:16].tolist() + [0.0] * 16), 0.25)
    assert lost["parked_true_top5"] == 1 and lost["fe_5of5"] is None
    saved = racing.racing(rp, late, np.array(noisy[:16].tolist() + [0.0] * 16), 0.25, racing.Rule(to_groups=True))
    assert saved["parked"] == 1 and saved["parked_true_top5"] == 0 and saved["fe_5of5"] is not None
    assert saved["fe_5of5"] > lost["fe_4of5"]


def test_the_subset_rule_compares_subset_damages():
    _, racing, _ = _replay()
    full, raced = [2.0, 1.5, 1.2, 1.0, 0.9], [0.2, 0.1, 0.1, 0.1, 0.05]
    assert not racing.promoted(racing.Rule("full", 0.5), 0.3, full, raced, 5)  # 0.3 < 0.5 x 0.9
    assert racing.promoted(racing.Rule("subset", 0.5), 0.3, full, raced, 5)  # 0.3 >= 0.5 x 0.05
    assert racing.promoted(racing.Rule("full", 0.5), -1.0, full[:4], raced, 5)  # fewer than 5 measured in full

"""The attribution and prior-guided methods on a tiny model: outputs, cost, resume, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from capsense.cli import main
from capsense.core.heads import load_heads_file
from capsense.localize.store import read_evaluations
from capsense.scoring.cost import ATTRIBUTION, mask_cost
from _toy_task import TOY_CONTROL, TOY_MC, TOY_TASK, make_toy_setup

N_LAYERS, N_HEADS = 3, 4


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_setup(tmp_path_factory.mktemp("toy"))


def _locate(toy, out, *extra):
    model, tasks = toy
    args = [str(model), "--task", TOY_TASK, "--include-path", str(tasks), "--limit", "12", "--no-progress", "--out", str(out),
            "--controls", "none", *extra]  # a later --controls overrides none
    return CliRunner().invoke(main, ["locate", *args], catch_exceptions=False)


def _fe(out) -> float:
    cost_model = json.loads((out / "manifest.json").read_text())["cost_model"]
    share, folded = cost_model["reuse_share"], cost_model["clean_forward_folded"]
    # the attribution's forward stands in for the search's clean forward, not for measure-and-choose's
    # (in float32 after a bfloat16 search: a real forward)
    tokens = cost_model["token_share"]  # a group scored on the target alone costs the target's share
    return ATTRIBUTION + sum(sum(tokens[t] for t in e.scores) * mask_cost(e.heads, N_LAYERS, N_HEADS, share,
                                                                          folded if e.round == 0 else 0.0)
                             for e in read_evaluations(out))


def _fe_every_probe(out) -> float:
    """What the run would have cost with every mask scored on every probe (before round 14)."""
    cost_model = json.loads((out / "manifest.json").read_text())["cost_model"]
    share, folded = cost_model["reuse_share"], cost_model["clean_forward_folded"]
    return ATTRIBUTION + sum(mask_cost(e.heads, N_LAYERS, N_HEADS, share, folded if e.round == 0 else 0.0)
                             for e in read_evaluations(out))


def test_prior_guided_is_the_default_and_hands_on_measured_heads(toy, tmp_path):
    out = tmp_path / "run"
    r = _locate(toy, out, "--top-m", "4", "--group-size", "3", "--top-k", "3")
    assert r.exit_code == 0, r.output
    hf = load_heads_file(out / "heads.json")
    assert hf.meta["method"] == "prior-guided"
    evals = read_evaluations(out)
    singles = {e.heads[0] for e in evals if len(e.heads) == 1}
    assert len(singles) >= 4 and any(len(e.heads) > 1 for e in evals)  # singles and group tests
    for rec in hf.heads[:3]:  # every handed-on head was knocked out alone; estimate kept beside it
        assert rec["layer"] * N_HEADS + rec["head"] in singles
        assert rec["target_effect"] is not None and rec["estimate"] is not None
    unmeasured = [r for r in hf.heads if r["layer"] * N_HEADS + r["head"] not in singles]
    assert all(r["target_effect"] is None for r in unmeasured)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["forward_equivalents"] == hf.meta["forward_equivalents"] == pytest.approx(_fe(out), abs=0.01)
    report = (out / "report.md").read_text()
    assert "forward-equivalents" in report
    assert "measured single-head knockouts" in report and "gradient estimate" in report
    assert "exhaustive sweep" not in report and "regression estimate" not in report
    est = json.loads((out / "attribution.json").read_text())["estimate"][TOY_TASK]
    assert len(est) == N_LAYERS * N_HEADS
    # Rerunning resumes: nothing new evaluated, the same heads.json.
    r2 = _locate(toy, out, "--top-m", "4", "--group-size", "3", "--top-k", "3")
    assert r2.exit_code == 0 and f"{len(evals)} masks already evaluated" in r2.output
    assert load_heads_file(out / "heads.json").heads == hf.heads
    # ... and counts what the first attempt paid: its clean evaluation came from the attribution's forward
    assert json.loads((out / "attribution.json").read_text())["clean_forward_folded"] == 1.0
    assert load_heads_file(out / "heads.json").meta["forward_equivalents"] == hf.meta["forward_equivalents"]


def test_budget_caps_the_forward_equivalents(toy, tmp_path):
    out = tmp_path / "small"
    assert _locate(toy, out, "--fe-budget", "6").exit_code == 0
    assert _fe(out) <= 6 + 1e-9  # the clean forward and a few knockouts after the attribution


def test_attribution_alone_ranks_by_the_estimate(toy, tmp_path):
    out = tmp_path / "att"
    assert _locate(toy, out, "--method", "attribution").exit_code == 0
    hf = load_heads_file(out / "heads.json")
    est = json.loads((out / "attribution.json").read_text())["estimate"][TOY_TASK]
    ranked = [r["layer"] * N_HEADS + r["head"] for r in hf.heads]
    assert [est[h] for h in ranked] == sorted(est, reverse=True)
    # the attribution's forward is the clean evaluation: no second forward
    assert hf.meta["n_evaluations"] == 1 and hf.meta["forward_equivalents"] == pytest.approx(ATTRIBUTION)


def test_selective_prior_guided_keeps_control_estimates_and_chooses_a_set(toy, tmp_path):
    out = tmp_path / "sel"
    r = _locate(toy, out, "--controls", TOY_CONTROL, "--top-k", "2", "--refine", "6", "--top-m", "4")
    assert r.exit_code == 0, r.output
    hf = load_heads_file(out / "heads.json")
    assert hf.meta["refine"]["n_evaluations"] <= 6
    chosen = hf.meta["refine"]["heads"]
    assert [f"L{r['layer']}H{r['head']}" for r in hf.heads[:2]] == chosen
    assert all(TOY_CONTROL in r["control_estimates"] for r in hf.heads)
    assert hf.meta["forward_equivalents"] == pytest.approx(_fe(out), abs=0.01)  # refine's sets counted too
    # target first: group knockouts on the target alone; a single head on the target, then its control (one
    # stored evaluation each: a single's controls are scored until one excludes it); refine's sets on every probe
    evals = read_evaluations(out)
    groups = [e for e in evals if len(e.heads) > 1 and e.round == 0]
    assert groups and all(set(e.scores) == {TOY_TASK} for e in groups)
    stored = [e for e in read_evaluations(out, joined=False) if len(e.heads) == 1 and e.round == 0]
    assert all(len(e.scores) == 1 for e in stored) and len(stored) == 2 * len({e.heads[0] for e in stored})
    singles = [e for e in evals if len(e.heads) == 1 and e.round == 0]  # read joined: one per head
    assert sorted(e.heads[0] for e in singles) == sorted({e.heads[0] for e in stored})
    assert all(set(e.scores) == {TOY_TASK, TOY_CONTROL} for e in singles)  # one control: nothing to stop before
    assert all(set(e.scores) == {TOY_TASK, TOY_CONTROL} for e in evals if not e.heads or e.round != 0)
    assert "scored cheapest first until one was beyond its threshold" in (out / "report.md").read_text()
    assert "not measured" in hf.meta["screen"]["rule"]
    assert hf.meta["forward_equivalents"] < _fe_every_probe(out) - 0.01
    r2 = _locate(toy, out, "--controls", TOY_CONTROL, "--top-k", "2", "--refine", "6", "--top-m", "4")
    assert r2.exit_code == 0 and f"{len(evals)} masks already evaluated" in r2.output  # resumed: the same search
    assert load_heads_file(out / "heads.json").heads == hf.heads
    assert load_heads_file(out / "heads.json").meta["forward_equivalents"] == hf.meta["forward_equivalents"]


@pytest.mark.parametrize("method", ["prior-guided", "attribution"])
def test_metric_without_gradient_is_one_message_and_writes_nothing(toy, tmp_path, method):
    out = tmp_path / "bad"
    model, tasks = toy
    r = CliRunner().invoke(main, ["locate", str(model), "--task", TOY_TASK, "--include-path", str(tasks), "--limit", "4",
                                  "--no-progress", "--out", str(out), "--method", method, "--metric", "acc"])
    assert r.exit_code == 1, r.output
    assert "nll" in r.output and "exhaustive" in r.output and "cs" in r.output and "Traceback" not in r.output
    assert not out.exists()


def test_heatmap_leaves_heads_never_measured_alone_unpainted(tmp_path):
    """prior-guided ranks unmeasured heads with a sentinel below the measured ones (min - 1): the
    heatmap painted it as a small negative importance and let it set the colour scale."""
    import matplotlib.image
    import numpy as np

    from capsense.core.arch import HeadLayout
    from capsense.localize.fit import single_head_scores
    from capsense.localize.outputs import heatmap, heatmap_grid
    from capsense.localize.store import Evaluation

    layout = HeadLayout(2, 2, 4)
    evals = [Evaluation(index=i, heads=h, scores={}) for i, h in enumerate(([], [0], [3]))]
    imp, seen = single_head_scores(evals, np.array([1.0, 3.0, 1.5]), 4)
    unmeasured = seen == 0
    assert unmeasured.tolist() == [False, True, True, False] and imp[1] < min(imp[0], imp[3])  # the sentinel
    grid, lim = heatmap_grid(imp, layout, unmeasured)
    assert grid.mask.tolist() == [[False, True], [True, False]]
    assert lim == max(abs(imp[0]), abs(imp[3]))  # the scale of the measured heads alone
    heatmap(tmp_path / "h.png", imp, layout, "t", unmeasured=unmeasured)
    rgb = (matplotlib.image.imread(tmp_path / "h.png")[..., :3] * 255).round()
    grey = (np.abs(rgb - 211).max(axis=-1) < 1).mean()
    assert grey > 0.05, grey  # two lightgrey cells (without them: a few anti-aliased pixels, about 0.01%)


def test_budget_never_exceeds_the_exhaustive_sweep(toy, tmp_path):
    # 12 heads: the sweep (clean forward + every head alone with prefix reuse) costs far less than 500
    out = tmp_path / "big"
    r = _locate(toy, out, "--fe-budget", "500", "--top-m", "12")
    assert r.exit_code == 0, r.output
    share = json.loads((out / "manifest.json").read_text())["cost_model"]["reuse_share"]
    sweep = 1.0 + sum(mask_cost([h], N_LAYERS, N_HEADS, share) for h in range(N_LAYERS * N_HEADS))
    assert "the cost of measuring every head alone" in r.output
    assert _fe(out) <= sweep + 1e-9


def test_coverage_reports_what_was_not_measured_alone(toy, tmp_path):
    out = tmp_path / "cov"
    assert _locate(toy, out, "--top-m", "3", "--group-size", "4", "--top-k", "2").exit_code == 0
    cov = load_heads_file(out / "heads.json").meta["coverage"]
    evals = read_evaluations(out)
    singles = {e.heads[0] for e in evals if len(e.heads) == 1}
    assert cov["measured_alone"] == len(singles) and cov["not_measured_alone"] == N_LAYERS * N_HEADS - len(singles)
    assert "## What the search did not measure" in (out / "report.md").read_text()


def test_bf16_search_measures_the_chosen_set_in_float32(toy, tmp_path):
    out = tmp_path / "bf16"
    r = _locate(toy, out, "--controls", TOY_CONTROL, "--top-k", "2", "--top-m", "4", "--dtype", "bfloat16")
    assert r.exit_code == 0, r.output
    assert "refine: measuring sets in float32 (the search ran in bfloat16)" in r.output
    evals = read_evaluations(out)
    refine_round = [e for e in evals if e.round != 0]
    assert refine_round[0].heads == []  # the clean model again, in float32: the base of every set's damage
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["identity"]["refine_dtype"] == "float32" and manifest["args"]["dtype_resolved"] == "bfloat16"
    r2 = _locate(toy, out, "--controls", TOY_CONTROL, "--top-k", "2", "--top-m", "4", "--dtype", "bfloat16")
    assert r2.exit_code == 0 and f"{len(evals)} masks already evaluated" in r2.output  # resumes, nothing new


def test_gpu_memory_rules_turn_off_prefix_reuse_and_the_float32_recast(toy, tmp_path, monkeypatch):
    """Where the prefix cache or a float32 copy of the model would not fit on the GPU (simulated here),
    the run says so, keeps no cache and measures the set in the search's precision; both are recorded."""
    from capsense.core import placement

    monkeypatch.setattr(placement, "prefix_cache_fits", lambda model, n_tokens, memory_fraction=0.5: False)
    monkeypatch.setattr(placement, "recast_fits", lambda model, dtype, memory_fraction=0.5: False)
    out = tmp_path / "gpu-rules"
    r = _locate(toy, out, "--controls", TOY_CONTROL, "--top-k", "2", "--top-m", "4", "--dtype", "bfloat16")
    assert r.exit_code == 0, r.output
    assert "prefix reuse off: its cache of clean block inputs" in r.output
    assert "refine: measuring sets in bfloat16: the model in float32 would take more than half" in r.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["args"]["prefix_reuse_resolved"] is False and manifest["args"]["refine_dtype_resolved"] == "bfloat16"
    assert manifest["identity"]["refine_dtype"] is None  # the run's own dtype, as in folders from before it
    assert manifest["cost_model"]["reuse_share"] == 0.0  # every knockout priced as the full forward it ran
    assert all(e.round == 0 or e.heads for e in read_evaluations(out))  # no clean re-evaluation in another dtype


def test_refine_dtype_without_refine_is_refused(toy, tmp_path):
    r = CliRunner().invoke(main, ["locate", str(toy[0]), "--task", TOY_TASK, "--include-path", str(toy[1]), "--controls", "none",
                                  "--refine-dtype", "float32", "--out", str(tmp_path / "x")])
    assert r.exit_code != 0 and "`refine_dtype` applies to measure-and-choose" in r.output.replace("--refine-dtype", "`refine_dtype`")


def test_refine_search_predicted_is_the_default_recorded_resumed_and_refused_without_refine(toy, tmp_path):
    out = tmp_path / "pred"
    args = ("--controls", TOY_CONTROL, "--top-k", "2", "--refine", "6", "--top-m", "4", "--tolerance", "0")
    r = _locate(toy, out, *args)
    assert r.exit_code == 0, r.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["identity"]["refine_search"] == "predicted"
    ref = load_heads_file(out / "heads.json").meta["refine"]
    assert ref["stopped"] in ("start within tolerance", "budget", "candidates", "prediction settled")
    assert ref["search"] == "predicted" and ref["n_evaluations"] <= 6
    if ref["stopped"] == "start within tolerance":  # (the toy's first set spares its control: nothing searched after it)
        assert [m["found_by"] for m in ref["measured"]] == ["start"]
        assert "sets measured; a set is within tolerance" in (out / "report.md").read_text()
    else:
        assert "sets measured (predicted search: " in (out / "report.md").read_text()
    assert _locate(toy, out, *args, "--refine-search", "predicted").exit_code == 0  # the same run, resumed
    r2 = _locate(toy, out, *args, "--refine-search", "swaps")  # the swap search would measure other sets
    assert r2.exit_code != 0 and "refine_search" in r2.output
    del manifest["identity"]["refine_search"]  # a folder from before round 30 searched by swaps
    (out / "manifest.json").write_text(json.dumps(manifest))
    r3 = _locate(toy, out, *args)
    assert r3.exit_code != 0 and "give --refine-search swaps" in r3.output.replace("`refine_search`", "--refine-search")
    r4 = CliRunner().invoke(main, ["locate", str(toy[0]), "--task", TOY_TASK, "--include-path", str(toy[1]), "--controls",
                                   "none", "--refine-search", "predicted", "--out", str(tmp_path / "x")])
    assert r4.exit_code != 0 and "--refine-search predicted applies to measure-and-choose" in r4.output


def test_prior_score_documents_orders_singles_by_the_per_document_magnitude(toy, tmp_path):
    """The default order (documents): singles by each document's |gradient| summed, per FE."""
    import numpy as np

    from capsense.scoring.cost import mask_cost

    out = tmp_path / "docs"
    r = _locate(toy, out, "--top-m", "4", "--group-size", "3", "--top-k", "3")
    assert r.exit_code == 0, r.output
    att = json.loads((out / "attribution.json").read_text())
    est, mag = np.array(att["estimate"][TOY_TASK]), np.array(att["magnitude"][TOY_TASK])
    assert (mag >= np.abs(est) - 1e-7).all() and (mag > np.abs(est) + 1e-7).any()
    share = json.loads((out / "manifest.json").read_text())["cost_model"]["reuse_share"]
    first = [e.heads[0] for e in read_evaluations(out)[1:5]]  # the singles come first, by magnitude per FE
    top4 = sorted(np.argsort(-mag, kind="stable")[:4].tolist(), key=lambda h: -mag[h] / mask_cost([h], N_LAYERS, N_HEADS, share))
    assert first == top4
    # the folder is a documents-ordered search: resuming it with the other order is refused
    r2 = _locate(toy, out, "--top-m", "4", "--group-size", "3", "--top-k", "3", "--prior-score", "estimate")
    assert r2.exit_code != 0 and "prior_score" in r2.output


def test_a_folder_from_before_the_documents_order_resumes_with_prior_score_estimate(toy, tmp_path):
    """A prior-guided folder written before `prior_score` existed (|estimate| order, no key in its
    identity) is refused by the default command with one error naming `--prior-score estimate`,
    which resumes it without new masks."""
    import numpy as np

    from capsense.scoring.cost import mask_cost

    out, opts = tmp_path / "old", ("--top-m", "4", "--group-size", "3", "--top-k", "3")
    assert _locate(toy, out, *opts, "--prior-score", "estimate").exit_code == 0
    est = np.abs(json.loads((out / "attribution.json").read_text())["estimate"][TOY_TASK])
    share = json.loads((out / "manifest.json").read_text())["cost_model"]["reuse_share"]
    top4 = sorted(np.argsort(-est, kind="stable")[:4].tolist(), key=lambda h: -est[h] / mask_cost([h], N_LAYERS, N_HEADS, share))
    assert [e.heads[0] for e in read_evaluations(out)[1:5]] == top4  # that order: |estimate| per FE
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["identity"]["prior_score"]  # as the earlier release wrote it
    (out / "manifest.json").write_text(json.dumps(manifest))
    n_lines = len((out / "evaluations.jsonl").read_text().splitlines())
    r = _locate(toy, out, *opts)
    assert r.exit_code == 1 and "to resume it give --prior-score estimate" in r.output, r.output
    assert len((out / "evaluations.jsonl").read_text().splitlines()) == n_lines  # nothing written
    r = _locate(toy, out, *opts, "--prior-score", "estimate")
    assert r.exit_code == 0 and f"{n_lines} masks already evaluated" in r.output


def test_prior_score_with_another_method_is_refused(toy, tmp_path):
    r = _locate(toy, tmp_path / "cs", "--method", "cs", "--prior-score", "estimate")  # (the default cannot be told from unset)
    assert r.exit_code != 0 and "--prior-score does not apply to --method cs" in r.output


def _groups(out) -> int:
    return sum(1 for e in read_evaluations(out) if len(e.heads) > 1 and e.round == 0)


def test_group_price_target_buys_more_groups_within_the_same_budget_and_identifies_the_folder(toy, tmp_path):
    """A selective run scores groups on the target alone; priced at that (``target``), the search's budget
    buys more of them than priced as on every probe (``full``, the default), and stays within it. The price
    changes the masks, so a folder made with one is refused by the other, naming it."""
    args = ("--controls", TOY_CONTROL, "--top-m", "0", "--group-size", "2", "--fe-budget", "5.5", "--refine", "0")
    full, target = tmp_path / "full", tmp_path / "target"
    assert _locate(toy, full, *args).exit_code == 0
    r = _locate(toy, target, *args, "--group-price", "target")
    assert r.exit_code == 0, r.output
    assert _groups(target) > _groups(full) > 0
    assert _fe(full) <= 5.5 + 1e-9 and _fe(target) <= 5.5 + 1e-9  # (refine 0: all of it is the search's)
    assert load_heads_file(target / "heads.json").meta["forward_equivalents"] == pytest.approx(_fe(target), abs=0.01)
    again = _locate(toy, target, *args)
    assert again.exit_code != 0 and "group_price" in again.output and "'target' there, None now" in again.output


@pytest.mark.parametrize("option, extra, message", [
    (("--group-price", "target"), ("--method", "cs", "--controls", TOY_CONTROL), "--group-price does not apply to --method cs"),
    (("--group-price", "target"), (), "--group-price target applies to a run with --controls"),
    (("--single-controls", "all"), ("--method", "cs", "--controls", TOY_CONTROL),
     "--single-controls does not apply to --method cs"),
    (("--single-controls", "all"), (), "--single-controls all applies to a run with --controls"),
])
def test_prior_guided_options_where_they_do_not_apply_are_refused(toy, tmp_path, option, extra, message):
    out = tmp_path / "run"
    r = _locate(toy, out, *option, *extra)
    assert r.exit_code != 0 and message in r.output, r.output
    assert not out.exists()


def test_a_multiple_choice_target_located_by_choice_nll(toy, tmp_path):
    """``--metric choice_nll``: the target is attributed and measured by the gold choice's share of its document's
    choices, the controls by nll; a target without choices is refused before the model loads (round 28)."""
    from _toy_task import TOY_MC

    out = tmp_path / "mc"
    r = _locate(toy, out, "--task", TOY_MC, "--metric", "choice_nll", "--controls", TOY_CONTROL, "--top-m", "3",
                "--top-k", "2", "--refine", "3")
    assert r.exit_code == 0, r.output
    hf = load_heads_file(out / "heads.json")
    assert hf.meta["metric"] == "choice_nll" and hf.meta["control_metric"] == "nll"
    assert "nll scores its gold choice alone" not in r.output  # the note is for a target scored by nll
    att = json.loads((out / "attribution.json").read_text())
    evals = read_evaluations(out)
    clean = evals[0].scores
    assert att["clean_nll"][TOY_MC] == pytest.approx(clean[TOY_MC]["choice_nll"], rel=1e-4)
    assert att["clean_nll"][TOY_CONTROL] == pytest.approx(clean[TOY_CONTROL]["nll"], rel=1e-4)
    assert "choice_nll" not in clean[TOY_CONTROL]
    ref = hf.meta["refine"]
    heads = sorted(int(h[1:].split("H")[0]) * N_HEADS + int(h.split("H")[1]) for h in ref["heads"])
    chosen = [e for e in evals if sorted(e.heads) == heads][-1].scores[TOY_MC]
    base = [e for e in evals if not e.heads][-1].scores[TOY_MC]["choice_nll"]  # refine's clean model
    assert ref["chosen"]["target_damage"] == pytest.approx((chosen["choice_nll"] - base) / base, abs=1e-4)
    assert ref["target_accuracy"]["metric"] == "choice_nll"
    bad = _locate(toy, tmp_path / "bad", "--metric", "choice_nll")
    assert bad.exit_code == 1 and "'toy_copy' is a loglikelihood task, without choices" in bad.output
    assert not (tmp_path / "bad").exists()


def test_autocast_search_measures_the_chosen_set_without_it(toy, tmp_path, kernel_calls):
    """``--autocast bfloat16``: the search's products in bf16 over float32 weights (its clean scores move), then
    measure-and-choose leaves autocast, drops the search's prefix caches and evaluates the clean model again:
    exactly a float32 run's clean scores. Recorded in the identity (a resume in float32 alone is refused), with
    the attention kernel's float32 on a CPU (a folder of rounds 39-40, whose autocast ran it in bfloat16, is refused)."""
    args = ("--controls", TOY_CONTROL, "--top-k", "2", "--top-m", "4", "--dtype", "float32")
    plain, mixed = tmp_path / "fp32", tmp_path / "autocast"
    assert _locate(toy, plain, *args).exit_code == 0
    kernel_calls.clear()  # the float32 run's
    r = _locate(toy, mixed, *args, "--autocast", "bfloat16")
    assert r.exit_code == 0, r.output
    # the search's attention too, under autocast (measure-and-choose's float32 calls add the same)
    assert kernel_calls and set(kernel_calls) == {(torch.float32, torch.float32, torch.float32, False)}
    assert ("refine: measuring sets in float32 (the search ran in float32 weights with bfloat16 autocast (float32 "
            "attention))") in r.output
    evals, ref = read_evaluations(mixed), read_evaluations(plain)
    refine_round = [e for e in evals if e.round != 0]
    assert refine_round[0].heads == [] and refine_round[0].scores == ref[0].scores
    assert evals[0].scores != ref[0].scores  # the search did run in bfloat16 products
    manifest = json.loads((mixed / "manifest.json").read_text())
    assert manifest["identity"]["autocast"] == "bfloat16" and manifest["args"]["dtype_resolved"] == "float32"
    assert manifest["identity"]["autocast_attention"] == "float32"
    assert json.loads((plain / "manifest.json").read_text())["identity"]["autocast"] is None
    assert json.loads((plain / "manifest.json").read_text())["identity"]["autocast_attention"] is None
    report = (mixed / "report.md").read_text()
    assert "- precision: float32 weights with bfloat16 autocast (float32 attention); sets measured in float32" in report
    again = _locate(toy, mixed, *args, "--autocast", "bfloat16")
    assert again.exit_code == 0 and f"{len(evals)} masks already evaluated" in again.output
    refused = CliRunner().invoke(main, ["locate", str(toy[0]), "--task", TOY_TASK, "--include-path", str(toy[1]),
                                        "--limit", "12", "--no-progress", "--out", str(mixed), *args])
    assert refused.exit_code != 0 and "autocast: 'bfloat16' there, None now" in refused.output
    manifest["identity"].pop("autocast_attention")  # as a folder of rounds 39-40 records it
    (mixed / "manifest.json").write_text(json.dumps(manifest))
    older = _locate(toy, mixed, *args, "--autocast", "bfloat16")
    assert older.exit_code != 0 and "autocast_attention: not recorded there" in older.output
    assert "no setting of this release computes autocast_attention as that one did" in " ".join(older.output.split())


def test_auto_on_a_cpu_with_native_bf16_searches_a_float32_model_under_autocast(toy, tmp_path, monkeypatch):
    """``--dtype auto`` (the default) on a CPU with native bf16 runs as ``--dtype float32 --autocast bfloat16`` and
    says so; without native bf16 it is float32 alone. A folder written with a bfloat16 model (an earlier release's
    ``auto`` there) resumes under ``auto`` with its bfloat16 model instead of being refused."""
    import capsense.core.models as models
    from capsense.core.provenance import cpu_info

    native = "model name\t: AMD EPYC\nflags\t\t: avx512f avx512_bf16\n"
    without = "model name\t: Intel(R) Xeon(R)\nflags\t\t: avx512f\n"
    monkeypatch.setattr(models, "cpu_info", lambda text=None: cpu_info(native))
    r = _locate(toy, tmp_path / "auto", "--top-m", "4")
    assert r.exit_code == 0 and "dtype auto on this CPU (native bf16): a float32 model" in " ".join(r.output.split()), r.output
    manifest = json.loads((tmp_path / "auto" / "manifest.json").read_text())
    assert (manifest["identity"]["dtype"], manifest["identity"]["autocast"]) == ("float32", "bfloat16")
    older = _locate(toy, tmp_path / "older", "--top-m", "4", "--dtype", "bfloat16")
    assert older.exit_code == 0, older.output
    again = _locate(toy, tmp_path / "older", "--top-m", "4")
    assert again.exit_code == 0 and "masks already evaluated" in again.output, again.output
    assert "dtype auto on this CPU" not in again.output
    assert json.loads((tmp_path / "older" / "manifest.json").read_text())["identity"]["dtype"] == "bfloat16"
    monkeypatch.setattr(models, "cpu_info", lambda text=None: cpu_info(without))
    r = _locate(toy, tmp_path / "plain", "--top-m", "4")
    assert r.exit_code == 0 and "dtype auto on this CPU" not in r.output
    manifest = json.loads((tmp_path / "plain" / "manifest.json").read_text())
    assert (manifest["identity"]["dtype"], manifest["identity"]["autocast"]) == ("float32", None)


def test_autocast_needs_a_float32_model(toy, tmp_path):
    for dtype in ("auto", "bfloat16"):
        r = CliRunner().invoke(main, ["locate", str(toy[0]), "--task", TOY_TASK, "--include-path", str(toy[1]),
                                      "--autocast", "bfloat16", "--dtype", dtype, "--out", str(tmp_path / dtype)])
        assert r.exit_code != 0 and "give `dtype` float32" in r.output.replace("--dtype", "`dtype`"), r.output
        assert not (tmp_path / dtype).exists()  # refused before anything is written


def test_a_failed_scorer_check_prices_a_resumed_run_as_it_priced_the_first(toy, tmp_path, monkeypatch):
    """Where the multiple-choice control's shared-context check fails (simulated), its knockouts run in full and
    cost more. A resumed run must price them the same before it replays anything: the search orders its singles
    and spends its budget by that price. (Before round 39 a resume checked only when it first scored a mask, so it
    priced every replayed knockout with sharing on.)"""
    from capsense.scoring.shared_context import SharedContextScorer

    def failing_check(self):
        self._checked, self.enabled = True, False

    monkeypatch.setattr(SharedContextScorer, "_check", failing_check)
    out = tmp_path / "mc"
    args = ("--controls", f"{TOY_CONTROL},{TOY_MC}", "--top-k", "2", "--top-m", "4", "--dtype", "float32")
    assert _locate(toy, out, *args).exit_code == 0
    first = json.loads((out / "manifest.json").read_text())
    assert first["cost_model"]["reuse_share"] < 1.0  # the control's knockouts priced as full forwards
    again = _locate(toy, out, *args)
    assert again.exit_code == 0 and "masks already evaluated" in again.output, again.output
    resumed = json.loads((out / "manifest.json").read_text())
    assert resumed["cost_model"]["reuse_share"] == first["cost_model"]["reuse_share"]
    assert resumed["forward_equivalents"] == first["forward_equivalents"]


def test_a_failed_replay_check_prices_a_resumed_run_as_it_priced_the_first(toy, tmp_path, monkeypatch):
    """The log-likelihood scorers' replay check fails (simulated): their knockouts run full forwards. A resume
    prices and counts them as the first run did (before the checks ran ahead of pricing: FE 8.64 in the first
    run, 7.64 after the resume)."""
    from capsense.scoring.prefix import PrefixReuseScorer

    replay = PrefixReuseScorer._replay

    def off_until_checked(self, calls, start):  # the check compares a replay from block 0 with the clean forward
        return replay(self, calls, start) + (0.0 if self._checked else 1.0)

    monkeypatch.setattr(PrefixReuseScorer, "_replay", off_until_checked)
    out = tmp_path / "ll"
    args = ("--controls", TOY_CONTROL, "--top-k", "2", "--top-m", "4", "--dtype", "float32")
    assert _locate(toy, out, *args).exit_code == 0
    first = json.loads((out / "manifest.json").read_text())
    assert first["cost_model"]["reuse_share"] == 0.0  # every check failed: full forwards
    assert _locate(toy, out, *args).exit_code == 0
    resumed = json.loads((out / "manifest.json").read_text())
    assert resumed["forward_equivalents"] == first["forward_equivalents"]


def test_a_failed_cache_rebuild_check_prices_a_resumed_run_as_it_priced_the_first(toy, tmp_path, monkeypatch):
    """The multiple-choice control's cache-rebuild check fails (simulated): its knockouts run without prefix reuse.
    ``check_scorers`` must run that check before anything is priced, so the first run prices the control's singles as
    they run and a resume prices them alike. (Round 39's ``SharedPrefixScorer.check_replay`` ran a clean shared pass
    instead of the check, so a run priced knockouts with reuse on until it first scored one.)"""
    from capsense.scoring.shared_prefix import SharedPrefixScorer

    monkeypatch.setattr(SharedPrefixScorer, "_replay_matches", lambda self, clean: False)
    out = tmp_path / "rebuild"
    args = ("--controls", f"{TOY_CONTROL},{TOY_MC}", "--top-k", "2", "--top-m", "4", "--dtype", "float32")
    assert _locate(toy, out, *args).exit_code == 0
    first = json.loads((out / "manifest.json").read_text())
    assert 0.0 < first["cost_model"]["reuse_share"] < 1.0  # the control's knockouts priced as full forwards
    assert _locate(toy, out, *args).exit_code == 0
    resumed = json.loads((out / "manifest.json").read_text())
    assert resumed["cost_model"]["reuse_share"] == first["cost_model"]["reuse_share"]
    assert resumed["forward_equivalents"] == first["forward_equivalents"]


def test_the_manifest_and_report_say_where_the_wall_time_went(toy, tmp_path):
    """Timing per phase: the attribution, the search after it, measure-and-choose, and the scorers' self-checks
    within them (they cost no forward-equivalents, so only the timing shows them). A resume that replays
    everything spends nothing on the attribution (read from the folder) and says so."""
    out = tmp_path / "timed"
    args = ("--controls", f"{TOY_CONTROL},{TOY_MC}", "--top-k", "2", "--top-m", "4", "--dtype", "float32")
    assert _locate(toy, out, *args).exit_code == 0
    timing = json.loads((out / "manifest.json").read_text())["timing"]
    assert timing["attribution_s"] > 0 and timing["search_s"] > 0 and timing["refine_s"] > 0
    assert 0 < timing["checks_s"] < timing["search_s"] + timing["refine_s"]
    phases = timing["attribution_s"] + timing["search_s"] + timing["refine_s"]
    assert phases <= timing["evaluate_s_this_attempt"] + 0.05
    report = (out / "report.md").read_text()
    assert f"- wall time of this attempt: load {timing['load_s']:.1f} s, attribution {timing['attribution_s']:.1f} s" in report
    assert _locate(toy, out, *args).exit_code == 0
    again = json.loads((out / "manifest.json").read_text())["timing"]
    assert again["new_evaluations_this_attempt"] == 0 and again["attribution_s"] == 0
    assert "attribution" not in (out / "report.md").read_text().split("- wall time of this attempt:")[1].split("\n")[0]


def test_a_check_that_fails_only_in_the_refine_precision_prices_a_resumed_run_alike(toy, tmp_path, monkeypatch):
    """Under autocast the search's replay checks pass; in float32, measure-and-choose's, failing (simulated), turn
    its reuse off, so its sets run full forwards. The refine evaluator checks after its clean forward and before
    it prices a set: a resume, which replays the sets from the folder, prices them as the first run did."""
    from capsense.core.precision import computes_in_float32
    from capsense.scoring.prefix import PrefixReuseScorer

    replay, failed = PrefixReuseScorer._replay, []

    def fails_in_float32(self, calls, start):
        off = 1.0 if computes_in_float32(self.model) and not self._checked else 0.0
        failed.append(off)
        return replay(self, calls, start) + off

    monkeypatch.setattr(PrefixReuseScorer, "_replay", fails_in_float32)
    out = tmp_path / "refine_check"
    args = ("--controls", TOY_CONTROL, "--top-k", "2", "--top-m", "4", "--dtype", "float32", "--autocast", "bfloat16")
    assert _locate(toy, out, *args).exit_code == 0
    assert 1.0 in failed  # the refine evaluator's checks ran and failed
    first = json.loads((out / "manifest.json").read_text())
    failed.clear()
    assert _locate(toy, out, *args).exit_code == 0
    assert 1.0 in failed
    resumed = json.loads((out / "manifest.json").read_text())
    assert resumed["forward_equivalents"] == first["forward_equivalents"]


def test_single_controls_identify_the_folder_and_all_scores_every_single_on_every_probe(toy, tmp_path):
    """``--single-controls all`` scores each single on every probe in one evaluation (as before round 42); a folder
    made one way is refused by the other, naming the setting (a folder from before it resumes with ``all``)."""
    args = ("--controls", TOY_CONTROL, "--top-m", "3", "--top-k", "2", "--refine", "2")
    out = tmp_path / "all"
    r = _locate(toy, out, *args, "--single-controls", "all")
    assert r.exit_code == 0, r.output
    singles = [e for e in read_evaluations(out) if len(e.heads) == 1 and e.round == 0]
    assert len(singles) == 3 and all(set(e.scores) == {TOY_TASK, TOY_CONTROL} for e in singles)
    assert "Each single's controls were scored cheapest first" not in (out / "report.md").read_text()
    assert "cheapest first" not in load_heads_file(out / "heads.json").meta["screen"]["rule"]
    again = _locate(toy, out, *args)
    assert again.exit_code != 0 and "single_controls" in again.output and "'cheapest-first'" in again.output


def test_a_folder_of_rounds_42_to_44_resumes_with_single_controls_until_excluded(toy, tmp_path):
    """``until-excluded`` (the target first, rounds 42-44) identifies its folder: the default (cheapest-first) refuses
    it naming both, and the setting resumes it without a knockout."""
    args = ("--controls", TOY_CONTROL, "--top-m", "3", "--top-k", "2", "--refine", "2")
    out = tmp_path / "target_first"
    assert _locate(toy, out, *args, "--single-controls", "until-excluded").exit_code == 0
    singles = [e for e in read_evaluations(out, joined=False) if len(e.heads) == 1 and e.round == 0]
    assert singles[0].scores.keys() == {TOY_TASK}  # the target's call came first
    refused = _locate(toy, out, *args)
    assert refused.exit_code != 0 and "'until-excluded' there, 'cheapest-first' now" in refused.output
    n = len(read_evaluations(out, joined=False))
    assert _locate(toy, out, *args, "--single-controls", "until-excluded").exit_code == 0
    assert len(read_evaluations(out, joined=False)) == n


def test_set_controls_until_beyond_identify_the_folder_and_the_chosen_set_is_scored_on_every_control(toy, tmp_path):
    """``--set-controls until-beyond`` (the default): the report and heads.json say how the sets were scored, the
    chosen set holds every control, and a folder made one way is refused by the other, naming the setting (a
    folder from before it resumes with ``all``)."""
    args = ("--controls", f"{TOY_CONTROL},{TOY_MC}", "--top-m", "4", "--top-k", "2", "--refine", "3")
    out = tmp_path / "lazy"
    r = _locate(toy, out, *args)
    assert r.exit_code == 0, r.output
    ref = load_heads_file(out / "heads.json").meta["refine"]
    assert ref["set_controls"] == "until-beyond"
    assert set(ref["chosen"]["control_damage"]) == {TOY_CONTROL, TOY_MC} and "all_controls" not in ref["chosen"]
    assert "until the first beyond the tolerance or the worst control" in (out / "report.md").read_text()
    from capsense.core.heads import Head

    chosen = [e for e in read_evaluations(out) if {str(Head.from_index(h, N_HEADS)) for h in e.heads} == set(ref["heads"])]
    assert chosen and set(chosen[-1].scores) == {TOY_TASK, TOY_CONTROL, TOY_MC}  # read joined: one per set
    again = _locate(toy, out, *args, "--set-controls", "all")
    assert again.exit_code != 0 and "set_controls" in again.output and "'until-beyond'" in again.output


def test_a_run_killed_between_a_singles_controls_resumes_to_the_same_result(toy, tmp_path):
    """A single's target and controls are stored one call each; a run killed after the targets and part of the
    first control's block resumes from there and ends as the uninterrupted run did."""
    args = ("--controls", f"{TOY_CONTROL},{TOY_MC}", "--top-m", "4", "--top-k", "2", "--refine", "3")
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert _locate(toy, whole, *args).exit_code == 0
    stored = (whole / "evaluations.jsonl").read_text().splitlines()
    records = [json.loads(ln) for ln in stored]
    first_control = next(i for i, r in enumerate(records) if len(r["heads"]) == 1 and TOY_TASK not in r["scores"])
    cut.mkdir()
    for f in ("manifest.json", "attribution.json"):
        (cut / f).write_text((whole / f).read_text())
    (cut / "evaluations.jsonl").write_text("\n".join(stored[: first_control + 2]) + "\n")
    r = _locate(toy, cut, *args)
    assert r.exit_code == 0, r.output
    assert "masks already evaluated" in r.output
    again, before = read_evaluations(cut, joined=False), read_evaluations(whole, joined=False)
    assert [(e.heads, e.scores) for e in again] == [(e.heads, e.scores) for e in before]
    assert load_heads_file(cut / "heads.json").heads == load_heads_file(whole / "heads.json").heads

"""capsense locate on a tiny model: run folder, methods, selective mode, resume, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from click.testing import CliRunner

from capsense.cli import main
from capsense.core.heads import load_heads_file
from _toy_task import TOY_CONTROL, TOY_MC, TOY_TASK, make_toy_setup


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_setup(tmp_path_factory.mktemp("toy"))


def _args(toy, out, *extra):
    model, tasks = toy
    method = extra[list(extra).index("--method") + 1] if "--method" in extra else "cs"
    per_mask = ["--heads-per-mask", "2"] if method in ("cs", "thompson") else []  # read by random-mask methods only
    return [str(model), "--task", TOY_TASK, "--include-path", str(tasks), "--limit", "12", "--method", "cs",
            *per_mask, "--no-progress", "--out", str(out), "--controls", "none", *extra]  # later options override


def _locate(toy, out, *extra):
    result = CliRunner().invoke(main, ["locate", *_args(toy, out, *extra)], catch_exceptions=False)
    return result


def test_cs_writes_the_run_folder(toy, tmp_path):
    out = tmp_path / "run"
    r = _locate(toy, out, "--masks", "16")
    assert r.exit_code == 0, r.output
    for name in ("manifest.json", "evaluations.jsonl", "heads.json", "scores.csv", "heatmap.png", "report.md"):
        assert (out / name).is_file(), name
    lines = (out / "evaluations.jsonl").read_text().splitlines()
    assert len(lines) == 17  # the clean model + 16 masks
    assert all(len(json.loads(ln)["heads"]) == 2 for ln in lines[1:])
    hf = load_heads_file(out / "heads.json")
    assert len(hf.heads) == 12 and [r["rank"] for r in hf.heads] == list(range(1, 13))
    assert hf.meta["task"] == TOY_TASK and hf.meta["method"] == "cs" and hf.meta["n_evaluations"] == 17
    assert {"importance", "confidence", "target_effect", "control_effect"} <= hf.heads[0].keys()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["content_sha256"] and manifest["versions"]["torch"]
    assert len(manifest["probes"][TOY_TASK]["doc_ids"]) == 12
    # The same command again resumes and evaluates nothing new.
    r2 = _locate(toy, out, "--masks", "16")
    assert r2.exit_code == 0 and "17 masks already evaluated" in r2.output
    assert load_heads_file(out / "heads.json").heads == hf.heads


def test_selective_mode_records_control_effects(toy, tmp_path):
    out = tmp_path / "sel"
    r = _locate(toy, out, "--masks", "16", "--controls", TOY_CONTROL, "--design", "bernoulli")
    assert r.exit_code == 0, r.output
    hf = load_heads_file(out / "heads.json")
    assert hf.meta["controls"] == [TOY_CONTROL] and hf.meta["selective"]
    head = hf.heads[0]
    assert set(head["control_effects"]) == {TOY_CONTROL}
    assert head["control_effect"] == head["control_effects"][TOY_CONTROL]
    assert "raw_importance" in head
    line = json.loads((out / "evaluations.jsonl").read_text().splitlines()[1])
    assert set(line["scores"]) == {TOY_TASK, TOY_CONTROL}


def test_no_set_within_tolerance_is_said_plainly(toy, tmp_path, monkeypatch):
    # the toy model's random heads leave some set within any tolerance (one helps the control): here none is, as on
    # Gemma 3 induction (round 20); the run still hands a set on, and says plainly what it is
    from capsense.localize.head_sets import SetQuality

    monkeypatch.setattr(SetQuality, "feasible", property(lambda self: False))
    out = tmp_path / "strict"
    r = _locate(toy, out, "--masks", "16", "--controls", TOY_CONTROL, "--top-k", "3", "--refine", "4")
    assert r.exit_code == 0, r.output
    ref = load_heads_file(out / "heads.json").meta["refine"]
    assert ref["within_tolerance"] is False and not ref["chosen"]["feasible"]
    worst = f"{TOY_CONTROL} {100 * ref['chosen']['control_damage'][TOY_CONTROL]:+.1f}%"
    assert ref["stopped"] == "budget" and ref["n_evaluations"] == 4 and 1 <= ref["choice_settled_at"] <= 4
    ended = f"(4 measured; the budget ran out with the choice unchanged since set {ref['choice_settled_at']})"
    for text in (r.output, (out / "report.md").read_text()):
        assert "NO measured set is within tolerance " + ended in text and worst in text and "NOT a selective set" in text


def test_selective_mode_measures_and_chooses_the_top_k_set(toy, tmp_path):
    out = tmp_path / "refine"
    r = _locate(toy, out, "--masks", "16", "--controls", TOY_CONTROL, "--top-k", "3", "--refine", "10", "--tolerance", "0.02")
    assert r.exit_code == 0, r.output
    assert "refine:" in r.output
    hf = load_heads_file(out / "heads.json")
    ref = hf.meta["refine"]
    lines = [json.loads(ln) for ln in (out / "evaluations.jsonl").read_text().splitlines()]
    # dtype auto on a CPU with native bf16 searches under bfloat16 autocast (a bfloat16 model before round 47): the
    # clean model is then measured again in float32 first
    identity = json.loads((out / "manifest.json").read_text())["identity"]
    recast = identity["refine_dtype"] is not None or identity["autocast"] is not None  # the clean model again, in float32
    assert len(lines) == 17 + recast + ref["n_evaluations"] and 1 <= ref["n_evaluations"] <= 10
    assert hf.meta["n_evaluations"] == len(lines)
    extra = lines[17 + recast:]
    assert all(ln["round"] == -1 for ln in lines[17:]) and all(ln["round"] >= 0 for ln in lines[:17])
    base = lines[17] if recast else lines[0]
    # the chosen set leads the ranking, and its recorded damage is what its evaluation measured
    assert [f"L{h['layer']}H{h['head']}" for h in hf.heads[:3]] == ref["heads"]
    chosen = next(ln for ln in extra if sorted(ln["heads"]) == sorted(ref["heads"]))
    base = base["scores"]
    for task, got in [(TOY_TASK, ref["chosen"]["target_damage"]), (TOY_CONTROL, ref["chosen"]["control_damage"][TOY_CONTROL])]:
        want = (chosen["scores"][task]["nll"] - base[task]["nll"]) / base[task]["nll"]
        assert got == pytest.approx(want, abs=1e-4)
    assert ref["chosen"]["feasible"] == (ref["chosen"]["control_damage"][TOY_CONTROL] <= 0.02)
    assert base[TOY_TASK]["acc"] == 0 and "target_accuracy" not in ref  # the random model copies nothing: no accuracy
    assert len(ref["start"]["heads"]) == 3 and sorted(extra[0]["heads"]) == sorted(ref["start"]["heads"])  # the fit's top 3 first
    report = (out / "report.md").read_text()
    assert "Chosen top-3 set" in report
    # a chosen set beyond the tolerance is said plainly, in the log, the report and heads.json
    assert ref["within_tolerance"] == ref["chosen"]["feasible"]
    for text in (r.output, report):
        assert ("NO measured set is within tolerance" in text) == (not ref["chosen"]["feasible"])
    # the wording follows the method (cs: regression estimate; refine: sets measured together), one order
    assert "regression estimate" in report and "exhaustive sweep" not in report
    assert "measured: each candidate set was knocked out together" in report
    chosen_row = next(ln for ln in report.splitlines() if ln.startswith("| chosen |"))
    assert chosen_row.split("|")[2].strip() == ", ".join(ref["heads"])
    from capsense.localize.store import read_evaluations

    assert len(read_evaluations(out)) == len(lines) and len(read_evaluations(out, design_only=True)) == 17
    # the same command resumes: nothing new, the same heads.json
    r2 = _locate(toy, out, "--masks", "16", "--controls", TOY_CONTROL, "--top-k", "3", "--refine", "10", "--tolerance", "0.02")
    assert r2.exit_code == 0 and f"{len(lines)} masks already evaluated" in r2.output
    assert load_heads_file(out / "heads.json").heads == hf.heads
    assert len((out / "evaluations.jsonl").read_text().splitlines()) == len(lines)


@pytest.mark.parametrize("method, n_evals", [("exhaustive", 13), ("greedy", 13 + 11 + 10), ("thompson", 13)])
def test_baselines(toy, tmp_path, method, n_evals):
    out = tmp_path / method
    masks = ["--masks", "12"] if method == "thompson" else []  # the baselines that sweep every head take none
    r = _locate(toy, out, "--method", method, *masks, "--top-k", "3")
    assert r.exit_code == 0, r.output
    hf = load_heads_file(out / "heads.json")
    assert hf.meta["method"] == method and hf.meta["n_evaluations"] == n_evals
    assert len({(h["layer"], h["head"]) for h in hf.heads}) == 12


def test_exhaustive_effects_are_measured_single_head_changes(toy, tmp_path):
    out = tmp_path / "ex"
    assert _locate(toy, out, "--method", "exhaustive").exit_code == 0
    evals = [json.loads(ln) for ln in (out / "evaluations.jsonl").read_text().splitlines()]
    base = evals[0]["scores"][TOY_TASK]["nll"]
    by_head = {e["heads"][0]: e["scores"][TOY_TASK]["nll"] for e in evals[1:]}
    for rec in load_heads_file(out / "heads.json").heads:
        name = f"L{rec['layer']}H{rec['head']}"
        assert rec["target_effect"] == pytest.approx((by_head[name] - base) / base, abs=1e-4)


@pytest.mark.parametrize("extra, message", [
    (["--task", "no_such_task_xyz"], "no_such_task_xyz"),
    (["--controls", "no_such_control_xyz"], "no_such_control_xyz"),
    (["--metric", "bleu"], "unknown --metric 'bleu' for task 'toy_copy': valid metrics are nll"),
    (["--sparsity", "0"], "--sparsity must be strictly between 0 and 1, got 0.0"),
    (["--sparsity", "1.5"], "--sparsity must be strictly between 0 and 1, got 1.5"),
    (["--heads-per-mask", "13"], "--heads-per-mask 13 is more than the model's 12 heads"),
    (["--design", "sobol"], "unknown design 'sobol': valid values are balanced, bernoulli, adaptive"),
    (["--solver", "ridge"], "unknown solver 'ridge': valid values are lasso, lasso-cv, omp, stability"),
    (["--method", "random"], "unknown --method 'random': valid methods are cs, exhaustive, greedy, thompson, attribution, prior-guided"),
    (["--refine", "-1"], "--refine must be 0 (off) or a number of evaluations, got -1"),
    (["--tolerance", "-0.1"], "--tolerance must be a relative worsening >= 0"),
    (["--top-k", "0"], "--top-k must be at least 1, got 0"),
    (["--method", "greedy", "--refine", "4"], "--refine does not apply to --method greedy"),
    (["--method", "prior-guided", "--masks", "5", "--heads-per-mask", "999"],
     "Error: --masks, --heads-per-mask do not apply to --method prior-guided: --masks is read by cs, thompson"),
])
def test_bad_input_is_one_clear_message(toy, tmp_path, extra, message):
    args = _args(toy, tmp_path / "bad", *(["--masks", "4"] if "--masks" not in extra else []))
    if "--sparsity" in extra:  # replace --heads-per-mask 2
        i = args.index("--heads-per-mask")
        del args[i : i + 2]
    if "--heads-per-mask" in extra:
        i = args.index("--heads-per-mask")
        del args[i : i + 2]
    r = CliRunner().invoke(main, ["locate", *args, *extra])
    assert r.exit_code == 1, r.output
    assert message in r.output
    if "no_such" in message:
        assert "unknown task" in r.output and "capsense_induction" in r.output
    assert "Traceback" not in r.output


def test_out_holding_a_different_run_is_refused(toy, tmp_path):
    out = tmp_path / "run"
    assert _locate(toy, out, "--masks", "4").exit_code == 0
    r = CliRunner().invoke(main, ["locate", *_args(toy, out, "--masks", "4", "--seed", "1")])
    assert r.exit_code == 1 and "holds a different run (seed: 0 there, 1 now" in r.output
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("x")
    r = CliRunner().invoke(main, ["locate", *_args(toy, tmp_path / "other", "--masks", "4")])
    assert r.exit_code == 1 and "not a capsense run folder" in r.output


def test_a_folder_from_the_previous_release_resumes_with_its_settings(toy, tmp_path):
    """A selective run folder written before the collateral screen existed (its manifest's
    identity has no `screen`, its heads.json no screen fields) is refused by the default
    command with one error naming `--screen 0`, and `--screen 0` resumes it without new masks."""
    out = tmp_path / "old"
    sel = ("--masks", "8", "--controls", TOY_CONTROL, "--top-k", "3", "--refine", "6")
    assert _locate(toy, out, *sel, "--screen", "0").exit_code == 0
    manifest = json.loads((out / "manifest.json").read_text())  # as the previous release wrote it
    del manifest["identity"]["screen"], manifest["args"]["screen"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    heads = json.loads((out / "heads.json").read_text())
    heads.pop("screen", None)
    for h in heads["heads"]:
        h.pop("collateral", None)
    (out / "heads.json").write_text(json.dumps(heads))
    n_lines = len((out / "evaluations.jsonl").read_text().splitlines())

    r = CliRunner().invoke(main, ["locate", *_args(toy, out, *sel)])  # the default screen is 3
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "screen: not recorded there (written by an earlier release), 3.0 now" in r.output
    assert "to resume it give --screen 0 (no collateral screen, as that release ran), or choose another --out" in r.output
    assert len((out / "evaluations.jsonl").read_text().splitlines()) == n_lines  # nothing written

    r = _locate(toy, out, *sel, "--screen", "0")
    assert r.exit_code == 0 and f"{n_lines} masks already evaluated" in r.output
    assert len((out / "evaluations.jsonl").read_text().splitlines()) == n_lines
    assert json.loads((out / "manifest.json").read_text())["identity"]["screen"] is None  # recorded from now on
    assert [h["rank"] for h in load_heads_file(out / "heads.json").heads] == [h["rank"] for h in heads["heads"]]


def _cli(toy, out, masks: int) -> list[str]:
    return [sys.executable, "-c", "from capsense.cli import main; main()", "locate", *_args(toy, out, "--masks", str(masks), "--limit", "40",
                                                                  "--controls", TOY_CONTROL)]


def test_sigkill_then_rerun_gives_the_same_heads_json(toy, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    masks = 150
    full = tmp_path / "full"
    subprocess.run(_cli(toy, full, masks), check=True, env=env, capture_output=True)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cli(toy, killed, masks), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    evals = killed / "evaluations.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if evals.is_file() and evals.read_text().count("\n") >= 10:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "locate finished before it could be killed: raise --masks"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    n_before = evals.read_text().count("\n")
    assert 10 <= n_before < masks + 1
    assert not (killed / "heads.json").exists()
    rerun = subprocess.run(_cli(toy, killed, masks), env=env, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert "already evaluated" in rerun.stderr
    n_refine = load_heads_file(full / "heads.json").meta["refine"]["n_evaluations"]
    assert 1 <= n_refine <= 24
    identity = json.loads((full / "manifest.json").read_text())["identity"]
    recast = identity["refine_dtype"] is not None or identity["autocast"] is not None  # the clean model again, in float32
    assert len(evals.read_text().splitlines()) == masks + 1 + recast + n_refine
    assert json.loads((killed / "heads.json").read_text()) == json.loads((full / "heads.json").read_text())


def test_many_masks_per_forward_gives_the_same_scores(toy, tmp_path):
    one, many = tmp_path / "one", tmp_path / "many"
    assert _locate(toy, one, "--masks", "7", "--no-prefix-reuse").exit_code == 0
    assert _locate(toy, many, "--masks", "7", "--masks-per-forward", "3").exit_code == 0
    a = [json.loads(ln) for ln in (one / "evaluations.jsonl").read_text().splitlines()]
    b = [json.loads(ln) for ln in (many / "evaluations.jsonl").read_text().splitlines()]
    assert [e["heads"] for e in a] == [e["heads"] for e in b]
    for x, y in zip(a, b):
        assert x["scores"][TOY_TASK]["nll"] == pytest.approx(y["scores"][TOY_TASK]["nll"], abs=1e-5)


def test_a_multiple_choice_target_reports_what_the_chosen_set_does_to_its_accuracy(toy, tmp_path):
    """Chosen by nll, the set's effect on the target's accuracy (against refine's clean model) is in the log,
    heads.json and the report (round 27: +90% gold-choice nll left a plural task's accuracy unmoved)."""
    out = tmp_path / "mc"
    r = _locate(toy, out, "--task", TOY_MC, "--masks", "8", "--controls", TOY_CONTROL, "--top-k", "2", "--refine", "3")
    assert r.exit_code == 0, r.output
    ref = load_heads_file(out / "heads.json").meta["refine"]
    lines = [json.loads(ln) for ln in (out / "evaluations.jsonl").read_text().splitlines()]
    clean = [ln for ln in lines if not ln["heads"]][-1]["scores"][TOY_MC]["acc"]
    chosen = [ln for ln in lines if sorted(ln["heads"]) == sorted(ref["heads"])][-1]["scores"][TOY_MC]["acc"]
    assert clean > 0 and ref["target_accuracy"] == {"clean": round(clean, 4), "chosen": round(chosen, 4),
                                                    "nll_only": (clean - chosen) / clean < 0.10, "metric": "nll",
                                                    "choices": True}
    line = f"takes the target's accuracy on the run's documents from {clean:.3f} to {chosen:.3f}"
    assert line in r.output and line in (out / "report.md").read_text()
    assert f"note: {TOY_MC} is multiple choice and nll scores its gold choice alone" in r.output  # said before the search


def test_batch_size_auto_resolves_to_the_cpu_figure_and_is_recorded(toy, tmp_path):
    """``--batch-size auto`` on a CPU runs at 16 requests per forward and says so in the manifest; scores do not
    depend on the batch (here against 3 per forward)."""
    auto, three = tmp_path / "auto", tmp_path / "three"
    assert _locate(toy, auto, "--masks", "5", "--batch-size", "auto").exit_code == 0
    assert _locate(toy, three, "--masks", "5", "--batch-size", "3").exit_code == 0
    args = json.loads((auto / "manifest.json").read_text())["args"]
    assert (args["batch_size"], args["batch_size_resolved"], args["attribution_batch_size_resolved"]) == ("auto", 16, 16)
    assert json.loads((three / "manifest.json").read_text())["args"]["batch_size_resolved"] == 3
    a = [json.loads(ln) for ln in (auto / "evaluations.jsonl").read_text().splitlines()]
    b = [json.loads(ln) for ln in (three / "evaluations.jsonl").read_text().splitlines()]
    assert [e["heads"] for e in a] == [e["heads"] for e in b]
    for x, y in zip(a, b):
        assert x["scores"][TOY_TASK]["nll"] == pytest.approx(y["scores"][TOY_TASK]["nll"], abs=1e-5)


def test_task_metric_is_lm_eval_under_each_mask(toy, tmp_path):
    # --metric names the task's own metric: every mask runs the generation task through lm-eval
    # (capsense-masked) on the run's documents; the values equal a direct lm-eval evaluation.
    from _toy_task import TOY_GEN
    from capsense.evaluation.evaluate import evaluate_head_sets, load_lm
    from capsense.core.heads import HeadSet

    model, tasks = toy
    out = tmp_path / "gen"
    args = [str(model), "--task", TOY_GEN, "--include-path", str(tasks), "--limit", "6", "--heads-per-mask", "3",
            "--masks", "4", "--method", "cs", "--metric", "char_code", "--controls", TOY_CONTROL, "--refine", "0", "--no-progress", "--out", str(out)]
    r = CliRunner().invoke(main, ["locate", *args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    lines = [json.loads(ln) for ln in (out / "evaluations.jsonl").read_text().splitlines()]
    assert len(lines) == 5
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["task_metric"][TOY_GEN] == {"metric": "char_code", "label": "char_code,first", "higher_is_better": False,
                                                "scored_by": "lm-eval under each mask (capsense-masked)"}
    docs = manifest["probes"][TOY_GEN]["doc_ids"]
    assert {"char_code", "nll", "acc"} <= set(lines[0]["scores"][TOY_GEN])
    assert set(lines[0]["scores"][TOY_CONTROL]) == {"nll", "acc"}  # controls fall back to nll
    values = {ln["scores"][TOY_GEN]["char_code"] for ln in lines}
    assert len(values) > 1, "masks should change the generations"
    lm = load_lm(str(model), batch_size=4)
    sets = {str(i): HeadSet.parse("+".join(ln["heads"])) if ln["heads"] else HeadSet() for i, ln in enumerate(lines)}
    rows = evaluate_head_sets(lm, sets, [TOY_GEN], samples={TOY_GEN: sorted(set(docs))}, include_path=[str(tasks)])
    direct = next(r for r in rows if r.metric == "char_code,first")
    for i, ln in enumerate(lines):
        assert ln["scores"][TOY_GEN]["char_code"] == pytest.approx(direct.values[str(i)], abs=1e-9)
    # char_code is lower-is-better (the task says so): a mask that raises it damages the target
    from capsense.localize.config import LocateConfig
    from capsense.localize.fit import damage
    from capsense.localize.store import Evaluation

    cfg = LocateConfig(model=str(model), task=TOY_GEN, out=str(out), controls=[TOY_CONTROL], metric="char_code", method="cs",
                       task_metric_higher_is_better=manifest["task_metric"][TOY_GEN]["higher_is_better"])
    evs = [Evaluation.from_dict(ln, 3) for ln in lines]
    d = damage(evs, TOY_GEN, cfg, evs[0])
    v = np.array([ln["scores"][TOY_GEN]["char_code"] for ln in lines])
    assert np.allclose(d, (v - v[0]) / abs(v[0]))
    assert np.allclose(damage(evs, TOY_CONTROL, cfg, evs[0]),
                       [(ln["scores"][TOY_CONTROL]["nll"] - lines[0]["scores"][TOY_CONTROL]["nll"]) / lines[0]["scores"][TOY_CONTROL]["nll"] for ln in lines])
    hf = load_heads_file(out / "heads.json")
    assert hf.meta["metric"] == "char_code" and hf.meta["control_metric"] == "nll"


def test_unknown_task_metric_lists_the_tasks_own(toy, tmp_path):
    from _toy_task import TOY_GEN

    model, tasks = toy
    args = [str(model), "--task", TOY_GEN, "--include-path", str(tasks), "--limit", "4", "--masks", "2",
            "--method", "cs", "--metric", "bleu", "--no-progress", "--out", str(tmp_path / "x")]
    r = CliRunner().invoke(main, ["locate", *args])
    assert r.exit_code == 1
    assert "unknown --metric 'bleu' for task 'toy_copy_gen'" in r.output
    assert "exact_match,first, char_code,first" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "x").exists()


def test_task_metric_named_at_run_time(toy, tmp_path):
    # A metric function may report under another name (HumanEval: pass_at_k -> pass@1): the
    # name is found by running the clean model once, whose result is then the first evaluation.
    from _toy_task import TOY_GEN_FN

    model, tasks = toy
    out = tmp_path / "fn"
    args = [str(model), "--task", TOY_GEN_FN, "--include-path", str(tasks), "--limit", "4", "--heads-per-mask", "3",
            "--masks", "2", "--method", "cs", "--metric", "len@chars", "--controls", "none", "--no-progress", "--out", str(out)]
    r = CliRunner().invoke(main, ["locate", *args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    lines = [json.loads(ln) for ln in (out / "evaluations.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and all(0 <= ln["scores"][TOY_GEN_FN]["len@chars"] <= 64 for ln in lines)
    assert json.loads((out / "manifest.json").read_text())["task_metric"][TOY_GEN_FN]["label"] == "len@chars"

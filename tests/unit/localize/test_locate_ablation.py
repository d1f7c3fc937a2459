"""``locate --ablation mean``: every knockout, the attribution and the handed-on set replace a head by its mean;
heads.json records it, a folder of the other ablation is refused, and validate applies it by default."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from capsense.cli import main
from capsense.core.heads import load_heads_file
from _toy_task import TOY_CONTROL, TOY_TASK, make_toy_setup


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_setup(tmp_path_factory.mktemp("toy_mean"))


def _locate(toy, out, *extra):
    """A run in float32, the precision the tests score the same knockouts in directly (``auto`` is bfloat16 on a
    CPU with native bf16: there the runs' scores differed from float32 ones by 3e-5 and more, round 38)."""
    model, tasks = toy
    args = ["locate", str(model), "--task", TOY_TASK, "--include-path", str(tasks), "--limit", "12", "--controls",
            "none", "--dtype", "float32", "--no-progress", "--out", str(out), *extra]
    return CliRunner().invoke(main, args, catch_exceptions=False)


def _locate_mean(toy, out, *extra):
    """A run under mean ablation over a reference file of two sentences (written beside ``out``); it and the file."""
    reference = out.parent / f"{out.name}-reference.txt"
    reference.write_text("The river runs past the old mill.\nA cat sleeps on the warm step.\n")
    r = _locate(toy, out, "--ablation", "mean", "--mean-reference", str(reference), *extra)
    assert r.exit_code == 0, r.output
    return r, reference


def _nll(out):
    evals = [json.loads(ln) for ln in (out / "evaluations.jsonl").read_text().splitlines()]
    return evals[0]["scores"][TOY_TASK]["nll"], {e["heads"][0]: e["scores"][TOY_TASK]["nll"] for e in evals[1:]}


def test_mean_ablation_knockouts_replace_each_head_by_its_mean(toy, tmp_path):
    """Each single knockout of an exhaustive run under --ablation mean is the probe scored with the head's slice
    replaced by its mean over the neutral prose (core.ablation.HeadAblator), and not the zeroed head's score."""
    from capsense.core.ablation import HeadAblator, reference_means
    from capsense.core.arch import head_layout
    from capsense.core.models import load_model
    from capsense.scoring.probe import ProbeScorer, build_probe

    mean_run, zero_run = tmp_path / "mean", tmp_path / "zero"
    assert _locate(toy, mean_run, "--method", "exhaustive", "--ablation", "mean").exit_code == 0
    assert _locate(toy, zero_run, "--method", "exhaustive").exit_code == 0
    base, mean_nll = _nll(mean_run)
    zero_base, zero_nll = _nll(zero_run)
    assert base == pytest.approx(zero_base, abs=1e-6)  # the clean model is the clean model
    model, tokenizer = load_model(str(toy[0]), "float32", "cpu")
    probe = build_probe(TOY_TASK, tokenizer, 12, 0, [str(toy[1])])
    ablator = HeadAblator(model, "mean", reference_means(model, tokenizer, "mean"))
    scorer = ProbeScorer(model, probe, ablator=ablator)
    for name in ("L0H0", "L1H2", "L2H3"):
        got = float(scorer.score(ablator.knockouts(name))["nll"][0])
        assert mean_nll[name] == pytest.approx(got, rel=1e-5)
    assert max(abs(mean_nll[h] - zero_nll[h]) for h in mean_nll) > 1e-3  # the option changes what is measured
    hf = load_heads_file(mean_run / "heads.json")
    assert hf.meta["ablation"] == "mean" and hf.meta["mean_reference"] is None
    # the layout that tells this model from another of its shape (key/value heads, width, type) travels with the heads
    assert hf.made_for.to_dict() == head_layout(model).to_dict() and hf.made_for.n_kv_heads and hf.made_for.family
    assert load_heads_file(zero_run / "heads.json").meta["ablation"] == "zero"
    assert "- ablation: mean (head means over capsense neutral prose)" in (mean_run / "report.md").read_text()


def test_prior_guided_under_mean_ablation_attributes_and_measures_mean_knockouts(toy, tmp_path):
    out = tmp_path / "pg"
    r, reference = _locate_mean(toy, out, "--method", "prior-guided", "--fe-budget", "6")
    assert json.loads((out / "attribution.json").read_text())  # the gradient pass ran under the same hooks
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["identity"]["ablation"].startswith("mean (sha256 ")
    assert manifest["args"]["ablation"] == "mean" and manifest["args"]["mean_reference"] == str(reference)
    # resuming with another reference text is refused: the means, so every knockout, would differ
    reference.write_text("Numbers: 1 2 3 4 5 6 7 8 9.\n")
    r = _locate(toy, out, "--method", "prior-guided", "--ablation", "mean", "--mean-reference", str(reference),
                "--fe-budget", "6")
    assert r.exit_code == 1 and "holds a different run (ablation: 'mean (sha256 " in r.output


def test_a_folder_of_the_other_ablation_is_refused(toy, tmp_path):
    out = tmp_path / "run"
    assert _locate(toy, out, "--method", "cs", "--masks", "4", "--heads-per-mask", "2").exit_code == 0
    r = CliRunner().invoke(main, ["locate", str(toy[0]), "--task", TOY_TASK, "--include-path", str(toy[1]), "--limit",
                                  "12", "--controls", "none", "--method", "cs", "--masks", "4", "--heads-per-mask", "2",
                                  "--ablation", "mean", "--dtype", "float32", "--out", str(out)])
    assert r.exit_code == 1
    assert "holds a different run (ablation: None there, 'mean (capsense.tasks.prose.PASSAGES)' now)" in r.output


def test_a_mean_reference_without_mean_ablation_is_one_clear_error(toy, tmp_path):
    reference = tmp_path / "ref.txt"
    reference.write_text("Some prose.\n")
    r = CliRunner().invoke(main, ["locate", str(toy[0]), "--task", TOY_TASK, "--include-path", str(toy[1]),
                                  "--mean-reference", str(reference), "--out", str(tmp_path / "x")])
    assert r.exit_code == 1 and "--mean-reference only applies to --ablation mean" in r.output
    assert not (tmp_path / "x").exists() and "Traceback" not in r.output


def test_validate_applies_the_runs_ablation_by_default(toy, tmp_path):
    """A heads file located under mean ablation is validated under mean ablation unless --ablation says
    otherwise; validation.json and .md say which, and the ablated scores differ from zero ablation's (prose's
    nats: the toy model copies nothing, so its accuracy is 0 either way)."""
    run = tmp_path / "run"
    r = _locate(toy, run, "--method", "exhaustive", "--ablation", "mean", "--controls", TOY_CONTROL, "--refine", "0")
    assert r.exit_code == 0, r.output
    tables = {}
    for name, extra in (("default", []), ("zero", ["--ablation", "zero"])):
        out = tmp_path / name
        r = CliRunner().invoke(main, [
            "validate", str(toy[0]), "--heads", str(run / "heads.json"), "--top-k", "2", "--tasks",
            f"{TOY_TASK},capsense_prose", "--random", "1", "--limit", "4", "--include-path", str(toy[1]), "--no-progress", "--out", str(out), *extra,
        ], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        tables[name] = json.loads((out / "validation.json").read_text())
    assert tables["default"]["ablation"] == "mean" and tables["zero"]["ablation"] == "zero"
    md = (tmp_path / "zero" / "validation.md").read_text()
    assert "- ablation: zero (zeroed); the heads were located under mean ablation" in md
    assert "- ablation: mean (mean over capsense neutral prose)\n" in (tmp_path / "default" / "validation.md").read_text()
    by = {name: {(row["task"], row["metric"]): row for row in t["rows"]} for name, t in tables.items()}
    assert by["default"].keys() == by["zero"].keys()
    assert all(by["default"][k]["base"] == pytest.approx(by["zero"][k]["base"]) for k in by["zero"])
    assert any(by["default"][k]["ablated"] != pytest.approx(by["zero"][k]["ablated"], rel=1e-6) for k in by["zero"])


def test_evaluate_and_capsense_masked_apply_the_runs_ablation_by_default(toy, tmp_path):
    """evaluate and capsense-masked zeroed a mean-located set by default (validate and export applied the run's mean):
    the same heads file gave two commands' numbers for two different edits. Now all apply the run's ablation unless
    told otherwise, and evaluate's table says mean-ablated."""
    from capsense.evaluation.lm_eval_model import CapsenseMaskedLM

    run = tmp_path / "run"
    r, reference = _locate_mean(toy, run, "--method", "exhaustive", "--refine", "0")
    heads = str(run / "heads.json")
    base = ["evaluate", str(toy[0]), "--heads", heads, "--top-k", "2", "--tasks", "capsense_prose", "--limit", "3"]
    tables = {}
    for name, extra in (("default", []), ("zero", ["--ablation", "zero"])):
        r = CliRunner().invoke(main, [*base, *extra, "--out", str(tmp_path / f"{name}.json")], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        tables[name] = r.output
    assert "| mean-ablated (" in tables["default"] and "| ablated (" in tables["zero"] and "mean-ablated" not in tables["zero"]
    assert tables["default"] != tables["zero"]
    lm = CapsenseMaskedLM(pretrained=str(toy[0]), heads=heads, top_k="2")
    assert (lm.ablation, lm.mean_reference) == ("mean", str(reference))
    assert CapsenseMaskedLM(pretrained=str(toy[0]), heads=heads, top_k="2", ablation="zero").ablation == "zero"
    assert CapsenseMaskedLM(pretrained=str(toy[0]), heads="L0H1").ablation == "zero"  # a spec: zero


def test_a_sets_ablation_defaults_to_its_runs(tmp_path):
    """core.ablation.resolve_ablation: what validate and export apply to a heads file's set."""
    from capsense.core.ablation import resolve_ablation
    from capsense.errors import CapsenseError

    located = {"ablation": "mean", "mean_reference": "ref.txt"}
    assert resolve_ablation({}, None) == ("zero", None)  # a file from before the setting
    with pytest.raises(CapsenseError, match="mean_reference file 'ref.txt' not found"):
        resolve_ablation(located, None)  # the run's reference comes along, and must exist here
    assert resolve_ablation(located, "zero") == ("zero", None)
    reference = tmp_path / "ref.txt"
    reference.write_text("Some prose.\n")
    assert resolve_ablation({"ablation": "mean", "mean_reference": str(reference)}, None) == ("mean", str(reference))
    assert resolve_ablation({"ablation": "mean"}, None) == ("mean", None)  # capsense's neutral prose
    with pytest.raises(CapsenseError, match="`mean_reference` only applies to `ablation` mean"):
        resolve_ablation(located, "zero", str(reference))


def test_a_task_metric_is_scored_under_the_runs_mean_ablation(toy, tmp_path, monkeypatch):
    """--metric names the task's own metric: each mask runs lm-eval through capsense-masked, with the run's
    ablation; the values equal a direct capsense-masked evaluation under mean ablation. The lm-eval model shares
    the run's ablator, so the head means are computed once (round 33 computed them twice)."""
    from _toy_task import TOY_GEN
    import capsense.core.ablation as ablation
    from capsense.core.heads import HeadSet
    from capsense.evaluation.evaluate import evaluate_head_sets, load_lm

    model, tasks = toy
    out = tmp_path / "gen"
    computed = []
    real = ablation.compute_head_means
    monkeypatch.setattr(ablation, "compute_head_means", lambda *a, **k: computed.append(1) or real(*a, **k))
    r = _locate(toy, out, "--task", TOY_GEN, "--limit", "6", "--method", "cs", "--heads-per-mask", "3", "--masks", "4",
                "--metric", "char_code", "--refine", "0", "--ablation", "mean")
    assert r.exit_code == 0, r.output
    assert len(computed) == 1
    lines = [json.loads(ln) for ln in (out / "evaluations.jsonl").read_text().splitlines()]
    docs = json.loads((out / "manifest.json").read_text())["probes"][TOY_GEN]["doc_ids"]
    sets = {str(i): HeadSet.parse("+".join(ln["heads"])) if ln["heads"] else HeadSet() for i, ln in enumerate(lines)}
    rows = {}
    for mode in ("mean", "zero"):
        lm = load_lm(str(model), mode, batch_size=4)
        got = evaluate_head_sets(lm, sets, [TOY_GEN], samples={TOY_GEN: sorted(set(docs))}, include_path=[str(tasks)])
        rows[mode] = next(r for r in got if r.metric == "char_code,first").values
    for i, ln in enumerate(lines):
        assert ln["scores"][TOY_GEN]["char_code"] == pytest.approx(rows["mean"][str(i)], abs=1e-9)
    assert any(rows["mean"][k] != pytest.approx(rows["zero"][k], abs=1e-9) for k in rows["mean"])  # mean, not zero


def test_the_lm_eval_model_refuses_an_ablator_of_another_mode(toy):
    """capsense-masked shares a locate run's ablator only where it ablates the same model the same way."""
    import torch
    import transformers

    from capsense.core.ablation import HeadAblator
    from capsense.errors import CapsenseError
    from capsense.evaluation.lm_eval_model import CapsenseMaskedLM

    model, _ = toy
    lm = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(model)
    with pytest.raises(CapsenseError, match="`ablator` must ablate this model under ablation 'mean'; got one for 'zero'"):
        CapsenseMaskedLM(pretrained=lm, tokenizer=tok, ablation="mean", ablator=HeadAblator(lm, "zero"))
    other = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with pytest.raises(CapsenseError, match="got one for another model"):
        CapsenseMaskedLM(pretrained=lm, tokenizer=tok, ablator=HeadAblator(other, "zero"))

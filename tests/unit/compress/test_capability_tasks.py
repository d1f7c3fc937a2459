"""Capabilities beyond capsense's short names: any of capsense's tasks, a user's (``include_path``), lm-eval's own,
perplexity tasks among them (measured on whole texts, cut at the model's length as lm-eval cuts them)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from capsense.cli import main
from capsense.compress.capabilities import parse_capabilities
from capsense.errors import CapsenseError
from _toy_task import TOY_MC, TOY_ROLLING, make_toy_setup


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_setup(tmp_path_factory.mktemp("toy_capabilities"))


def test_any_task_capsense_or_a_folder_declares_is_a_capability_and_a_tag_or_typo_is_refused_at_once(toy):
    _, tasks = toy
    assert parse_capabilities("text,capsense_dates,math") == ["text", "capsense_dates", "math"]
    assert parse_capabilities([TOY_ROLLING, TOY_MC, "qa"], [tasks]) == [TOY_ROLLING, TOY_MC, "qa"]
    with pytest.raises(CapsenseError, match="'capsense' is a tag .* the short names are math, code, qa"):
        parse_capabilities("math,capsense")
    with pytest.raises(CapsenseError, match=r"unknown capability 'mathh' \(did you mean math\?\)"):
        parse_capabilities("mathh")
    with pytest.raises(CapsenseError, match=r"unknown capability: unknown task 'capsense_datez' \(did you mean capsense_dates\?\)"):
        parse_capabilities("capsense_datez")


def test_lm_eval_s_own_tasks_are_capabilities_and_a_name_no_index_holds_is_refused(toy):
    """lm-eval's index confirms names capsense does not declare (wikitext's YAML ships with lm-eval); a user's task
    without its folder is one of those names, unknown."""
    assert parse_capabilities("math,wikitext") == ["math", "wikitext"]
    with pytest.raises(CapsenseError, match=f"unknown capability: unknown task.*{TOY_ROLLING}.*short names are math"):
        parse_capabilities(f"math,{TOY_ROLLING}")


def test_measure_scores_a_user_s_perplexity_task_as_lm_eval_hf_does(toy):
    """``capsense measure --include-path``: each document's nats are lm-eval's ``loglikelihood_rolling`` through
    capsense-masked, on windows of the model's length (128 here; the long documents take several), and the
    capability has no accuracy (there is no answer to match)."""
    from capsense.evaluation.lm_eval_model import CapsenseMaskedLM
    from capsense.scoring.requests import load_task

    model_dir, tasks = toy
    out = model_dir.parent / "measure.json"
    r = CliRunner().invoke(main, ["measure", str(model_dir), "--capabilities", f"{TOY_ROLLING},math", "--probes", "12",
                                  "--include-path", str(tasks), "--per-doc", "--no-progress", "--out", str(out)])
    assert r.exit_code == 0, r.output
    text = json.loads(out.read_text())["capabilities"][TOY_ROLLING]
    assert text["acc"] is None and text["n_docs"] == 12
    line = next(x[x.index(f"{TOY_ROLLING} "):] for x in r.output.splitlines() if f"{TOY_ROLLING} " in x)
    assert "nats/token" in line and "acc" not in line

    lm = CapsenseMaskedLM(pretrained=str(model_dir), batch_size=4, device="cpu")
    task = load_task(TOY_ROLLING, [str(tasks)], lm.tokenizer)
    task.build_all_requests(samples=list(range(12)), rank=0, world_size=1)
    theirs = lm.loglikelihood_rolling(task.instances, disable_tqdm=True)
    assert max(len(lm.tokenizer.encode(task.eval_docs[i]["text"])) for i in range(12)) > 128  # some take several windows
    assert text["doc_nats"] == pytest.approx([-x for x in theirs], rel=1e-4, abs=1e-3)
    assert text["nll"] == pytest.approx(-sum(theirs) / sum(text["doc_tokens"]), rel=1e-5)


def test_a_perplexity_task_calibrates_on_its_texts_as_lm_eval_scores_them(toy):
    """Calibration (and the Fisher of a kept capability) reads a perplexity task's last documents, each its text
    alone: what ``loglikelihood_rolling`` scores, not a prompt, a delimiter and a target."""
    from capsense.compress.calibration import calibration_samples
    from capsense.scoring.requests import load_task
    from conftest import make_char_tokenizer

    _, tasks = toy
    tok = make_char_tokenizer()
    samples, info = calibration_samples(TOY_ROLLING, tok, 3, include_path=[str(tasks)])
    docs = load_task(TOY_ROLLING, [str(tasks)], tok).eval_docs
    assert info[0]["kind"] == "task" and info[0]["doc_ids"] == [len(docs) - 1, len(docs) - 2, len(docs) - 3]
    assert samples == [tok.encode(docs[i]["text"])[:512] for i in info[0]["doc_ids"]]
    with pytest.raises(CapsenseError, match="did you mean capsense_text"):
        calibration_samples("capsense_textt", tok, 3)
    # without its folder, the task's name was one calibration text reading "toy_text"
    with pytest.raises(CapsenseError, match=f"calibration source '{TOY_ROLLING}': unknown capability.*more than one word"):
        calibration_samples(TOY_ROLLING, tok, 3)
    assert calibration_samples(f"{TOY_ROLLING} is not a task", tok, 3)[1][0]["kind"] == "text"


def test_a_capability_s_probes_and_calibration_documents_must_not_meet():
    """40 paragraphs: 32 probes and 8 calibration texts are apart, 9 share one; the calibration's share of each
    source counts (two sources split 18 texts 9 and 9), and so does an alias of the same task."""
    from capsense.compress.calibration import calibration_documents
    from capsense.compress.capabilities import check_held_out
    from capsense.compress.distill import DistillConfig, check_distill_held_out

    check_held_out({"text": (32, 8), "math": (64, 64)}, "fix")
    with pytest.raises(CapsenseError, match="'text' has 40 documents: its first 32 measure it and its last 9 calibrate the "
                                            "run, so 1 would do both.*beside 32 probe documents it can calibrate on at most 8: lower it"):
        check_held_out({"text": (32, 9)}, "lower it")
    assert calibration_documents(["text", "math", "code"], "capsense_text,prose", 18) == {"text": 9, "math": 0, "code": 0}
    assert calibration_documents(["text"], "text,text,prose", 5) == {"text": 4}
    with pytest.raises(CapsenseError, match="lower `probes` or `texts`"):
        check_distill_held_out(DistillConfig("s", "t", sources="text,prose", n_texts=20), ["text", "math"], 32)
    check_distill_held_out(DistillConfig("s", "t", sources="text,prose", n_texts=16), ["text", "math"], 32)


def test_a_guided_compression_whose_probes_meet_its_calibration_is_refused_before_the_model_loads(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["compress", str(tiny_model_dir), "--method", "rtn", "--bits", "4", "--keep", "text",
                                  "--calibration-samples", "16", "--out", str(out)])
    assert r.exit_code == 1 and "'text' has 40 documents: its first 32 measure it and its last 16" in r.output, r.output
    assert "lower --calibration-samples" in r.output and not out.exists()  # (the CLI names its flags)


def test_a_grid_calibrating_on_a_capability_it_measures_keeps_its_probes_apart(tmp_path, tiny_model_dir):
    """Wanda calibrates: 32 probes of text and text's share (20 of 40 texts) of the calibration meet; magnitude and SVD
    read no calibration (given to them it is refused), so their grid runs, and its records and fits carry no accuracy
    for a perplexity task."""
    args = ["grid", str(tiny_model_dir), "--densities", "0.5", "--capabilities", "text", "--probes", "32", "--no-progress"]
    calibration = ["--calibration", "text,prose", "--calibration-samples", "40"]
    r = CliRunner().invoke(main, [*args, *calibration, "--methods", "wanda", "--out", str(tmp_path / "g.jsonl")])
    assert r.exit_code == 1 and "'text' has 40 documents: its first 32 measure it and its last 20" in r.output, r.output
    assert "lower --probes or --calibration-samples" in r.output
    grid = tmp_path / "m.jsonl"
    r = CliRunner().invoke(main, [*args, "--methods", "magnitude,svd", "--ratios", "0.8,0.6,0.4", "--out", str(grid)])
    assert r.exit_code == 0, r.output
    records = [json.loads(x) for x in grid.read_text().splitlines()]
    assert len(records) == 5 and all(x["acc"] is None and x["dacc"] is None and x["nll"] > 0 for x in records)
    r = CliRunner().invoke(main, ["fit", str(grid), "--report", str(tmp_path / "report")])  # no accuracy to fit or print
    assert r.exit_code == 0, r.output
    assert "text " in (tmp_path / "report" / "report.md").read_text()


def test_compress_keeps_a_user_s_perplexity_task_and_states_its_measured_dl(toy, tmp_path):
    """``capsense compress --keep toy_text --include-path``: GPTQ calibrates on the default mix plus the kept task's
    last texts, the Fisher reads them, the checkpoint's dL is what ``capsense measure`` gives on the written model,
    and no folder of this machine is recorded."""
    model_dir, tasks = toy
    out, ckpt_m = tmp_path / "out", tmp_path / "ckpt.json"
    r = CliRunner().invoke(main, ["compress", str(model_dir), "--method", "gptq", "--bits", "3", "--group-size", "32",
                                  "--keep", TOY_ROLLING, "--calibration-samples", "8", "--save-dtype", "float32",
                                  "--include-path", str(tasks), "--out", str(out)])
    assert r.exit_code == 0, r.output
    text = (out / "capsense.json").read_text()
    meta = json.loads(text)
    kept = meta["measured"]["capabilities"][TOY_ROLLING]
    assert kept["acc"] is None and kept["dL"] == pytest.approx(kept["nll"] - kept["nll0"]) and kept["dL"] != 0
    calibrated = next(c for c in meta["calibration"] if c["source"] == TOY_ROLLING)
    assert calibrated["kind"] == "task" and calibrated["doc_ids"] == [39]  # 8 texts over five sources: the last 1 is its share
    assert str(tasks) not in text
    card = (out / "README.md").read_text()  # the card states dL with its standard error
    assert f"| {TOY_ROLLING} | {kept['nll0']:.4f} | {kept['nll']:.4f} | {kept['dL']:+.4f} | {kept['dL_se']:.4f} |" in card
    r = CliRunner().invoke(main, ["measure", str(out), "--capabilities", TOY_ROLLING, "--probes", "32",
                                  "--include-path", str(tasks), "--out", str(ckpt_m)])
    assert r.exit_code == 0, r.output
    assert json.loads(ckpt_m.read_text())["capabilities"][TOY_ROLLING]["nll"] == pytest.approx(kept["nll"], abs=1e-4)


def test_grid_and_distill_measure_a_user_s_task_from_its_folder(toy, tmp_path):
    """``capsense grid`` and ``capsense distill`` take ``--include-path`` for their capabilities (and the grid for its
    calibration): a user's perplexity task is measured in both, and no folder of this machine is recorded."""
    model_dir, tasks = toy
    grid = tmp_path / "g.jsonl"
    r = CliRunner().invoke(main, ["grid", str(model_dir), "--methods", "wanda", "--densities", "0.5", "--capabilities",
                                  f"{TOY_ROLLING},{TOY_MC}", "--probes", "8", "--calibration", TOY_ROLLING,
                                  "--calibration-samples", "4", "--include-path", str(tasks), "--out", str(grid),
                                  "--no-progress"])
    assert r.exit_code == 0, r.output
    records = [json.loads(x) for x in grid.read_text().splitlines()]
    assert {(x["capability"], x["label"]) for x in records} == {(c, m) for c in (TOY_ROLLING, TOY_MC)
                                                                for m in ("dense", "wanda@d0.5")}
    wanda = next(x for x in records if x["capability"] == TOY_ROLLING and x["label"] != "dense")
    assert wanda["calibration"][0]["source"] == TOY_ROLLING and wanda["dL"] != 0 and wanda["acc"] is None
    assert str(tasks) not in grid.read_text()
    student = tmp_path / "student"
    r = CliRunner().invoke(main, ["compress", str(model_dir), "--method", "magnitude", "--density", "0.5", "--out", str(student)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["distill", str(student), "--teacher", str(model_dir), "--epochs", "1", "--texts", "3",
                                  "--gen-tokens", "2", "--seq-len", "24", "--capabilities", TOY_ROLLING, "--probes", "4",
                                  "--sources", f"{TOY_ROLLING},prose", "--include-path", str(tasks),
                                  "--out", str(tmp_path / "distilled")])
    assert r.exit_code == 0, r.output
    text = (tmp_path / "distilled" / "capsense.json").read_text()
    assert json.loads(text)["distill"]["config"]["sources"] == f"{TOY_ROLLING},prose"
    epochs = json.loads(text)["distill"]["epochs"]
    assert [set(e["dL"]) for e in epochs] == [{TOY_ROLLING}] * 2 and epochs[0]["dL"][TOY_ROLLING] != 0
    assert str(tasks) not in text


def test_a_distillation_trains_on_the_sources_it_names_and_a_misspelt_source_is_refused_before_a_model_loads(toy, tmp_path):
    """``capsense distill --sources``: a user's task (``--include-path``) gives its last documents as training texts,
    each its text alone (a perplexity task's); a source that names no task is refused before anything loads (it was
    refused once both models had loaded) and nothing is written."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from capsense.compress.distill import DistillConfig, build_corpus
    from capsense.scoring.requests import load_task

    model_dir, tasks = toy
    out = tmp_path / "never"
    r = CliRunner().invoke(main, ["distill", str(model_dir), "--teacher", str(model_dir), "--sources", "prose,capsense_datez",
                                  "--capabilities", "math", "--out", str(out)])
    assert r.exit_code != 0 and "calibration source 'capsense_datez'" in r.output and "did you mean capsense_dates" in r.output
    assert not out.exists() and not (tmp_path / "never.partial").exists()
    r = CliRunner().invoke(main, ["distill", str(model_dir), "--teacher", str(model_dir), "--sources", TOY_ROLLING,
                                  "--capabilities", "math", "--out", str(out)])
    assert r.exit_code != 0 and f"calibration source '{TOY_ROLLING}': unknown capability" in r.output

    teacher, tok = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    cfg = DistillConfig("s", "t", sources=TOY_ROLLING, n_texts=3, gen_tokens=0, seq_len=40)
    docs = load_task(TOY_ROLLING, [str(tasks)], tok).eval_docs
    assert build_corpus(teacher, tok, cfg, [str(tasks)]) == [tok.encode(docs[-1 - i]["text"])[:40] for i in range(3)]


def test_a_loss_change_states_its_standard_error_over_the_shared_documents():
    """Equal token counts: the sample standard deviation of the per-document differences in nats per token over
    sqrt(n); None where the two measured different tokens (two tokenizers) or one document."""
    import numpy as np

    from capsense.compress.capability_loss import CapabilityLoss, loss_change

    def loss(nats, tokens):
        return CapabilityLoss("math", "capsense_math_problems", sum(nats) / sum(tokens), 0.5, len(nats), sum(tokens),
                              list(nats), list(tokens))

    before, after = loss([10.0, 12.0, 9.0, 11.0], [5] * 4), loss([12.0, 12.5, 10.0, 14.0], [5] * 4)
    change = loss_change({"math": after}, {"math": before})["math"]
    per_doc = (np.array(after.doc_nats) - np.array(before.doc_nats)) / 5
    assert change["dL"] == pytest.approx(per_doc.mean()) and change["dL_se"] == pytest.approx(per_doc.std(ddof=1) / 2)
    assert loss_change({"math": loss([12.0] * 4, [6] * 4)}, {"math": before})["math"]["dL_se"] is None
    assert loss_change({"math": loss([12.0], [5])}, {"math": loss([10.0], [5])})["math"]["dL_se"] is None


def test_fewer_probes_leave_a_small_task_more_calibration_documents(tmp_path, tiny_model_dir):
    """``--probes 8``: capsense_text's 40 paragraphs take 32 calibration texts beside 8 probes (the default 32 probes
    leave 8); the record says 8 probes. Without ``--keep`` there is nothing to probe: an error, nothing written."""
    out = tmp_path / "out"
    args = ["compress", str(tiny_model_dir), "--method", "rtn", "--bits", "4", "--group-size", "32"]
    r = CliRunner().invoke(main, [*args, "--keep", "text", "--calibration-samples", "32", "--out", str(out)])
    assert r.exit_code == 1 and "beside 32 probe documents it can calibrate on at most 8" in r.output, r.output
    r = CliRunner().invoke(main, [*args, "--keep", "text", "--probes", "8", "--calibration-samples", "32", "--out", str(out)])
    assert r.exit_code == 0, r.output
    measured = json.loads((out / "capsense.json").read_text())["measured"]
    assert measured["probes"] == 8 and measured["capabilities"]["text"]["n_docs"] == 8
    r = CliRunner().invoke(main, [*args, "--probes", "8", "--out", str(tmp_path / "plain")])
    assert r.exit_code == 1 and "--probes shape(s) a guided allocation: give --keep" in r.output, r.output
    assert not (tmp_path / "plain").exists()


def test_a_generation_task_is_measured_on_its_reference_answers(toy):
    """A generation task (GSM8K's kind) as a capability: each of its first documents' prompt and reference answer,
    scored as capsense-masked scores that pair (it was refused: 'probes score log-likelihood ... tasks')."""
    from lm_eval.api.instance import Instance

    from capsense.evaluation.lm_eval_model import CapsenseMaskedLM
    from capsense.scoring.requests import load_task
    from _toy_task import TOY_GEN

    model_dir, tasks = toy
    out = model_dir.parent / "measure_gen.json"
    r = CliRunner().invoke(main, ["measure", str(model_dir), "--capabilities", TOY_GEN, "--probes", "6",
                                  "--include-path", str(tasks), "--per-doc", "--out", str(out)])
    assert r.exit_code == 0, r.output
    gen = json.loads(out.read_text())["capabilities"][TOY_GEN]
    assert gen["n_docs"] == 6 and gen["acc"] is not None
    lm = CapsenseMaskedLM(pretrained=str(model_dir), batch_size=4, device="cpu")
    task = load_task(TOY_GEN, [str(tasks)], lm.tokenizer)
    docs = [task.eval_docs[i] for i in range(6)]
    pairs = [Instance("loglikelihood", d, (task.doc_to_text(d), task.config.target_delimiter + task.doc_to_target(d)), 0)
             for d in docs]
    theirs = [ll for ll, _ in lm.loglikelihood(pairs, disable_tqdm=True)]
    assert gen["doc_nats"] == pytest.approx([-x for x in theirs], rel=1e-4, abs=1e-4)
    from capsense.compress.calibration import calibration_samples

    samples, info = calibration_samples(TOY_GEN, lm.tokenizer, 2, include_path=[str(tasks)])  # its last two, whole
    last = [task.eval_docs[i] for i in info[0]["doc_ids"]]
    assert info[0]["doc_ids"] == [39, 38] and samples == [
        lm.tokenizer.encode(task.doc_to_text(d) + task.config.target_delimiter + task.doc_to_target(d)) for d in last]


def test_the_held_out_check_loads_tasks_without_a_word_about_token_counts(caplog):
    """The check counts documents with no tokenizer; capsense's builders then warn that nats_per_token will be NaN,
    which a compression printed once per task about scores it never computes. A scorer's own load still warns."""
    import logging

    from capsense.compress.capabilities import check_held_out
    from capsense.tasks.common import to_dataset

    with caplog.at_level(logging.WARNING):
        check_held_out({"text": (32, 8), "math": (32, 8)}, "fix")
    assert not [r for r in caplog.records if "no tokenizer" in r.getMessage()]
    with caplog.at_level(logging.WARNING):
        to_dataset([{"context": "a", "continuation": " b"}], {})
    assert [r for r in caplog.records if "no tokenizer" in r.getMessage()]


def test_a_task_whose_data_cannot_be_reached_is_one_error_naming_it(tmp_path, monkeypatch):
    """A task that downloads its data (lm-eval's, or a user's from the Hub) where the Hub cannot be reached: one
    error naming the task and why, not datasets' traceback."""
    from capsense.scoring.requests import load_task

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "remote.yaml").write_text("task: my_remote\ndataset_path: nobody/no_such_dataset\noutput_type: "
                                          "loglikelihood\ntest_split: test\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n")
    with pytest.raises(CapsenseError, match="task 'my_remote': its data could not be loaded.*HF_HUB_OFFLINE is set"):
        load_task("my_remote", [str(tmp_path)])

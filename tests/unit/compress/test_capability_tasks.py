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
                                  "--include-path", str(tasks), "--per-doc", "--out", str(out)])
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

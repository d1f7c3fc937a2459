"""Perplexity tasks (lm-eval's ``loglikelihood_rolling``, wikitext's kind) as probes: lm-eval hf's windows and numbers,
as a locate run's control, and ``acc`` refused for them."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from click.testing import CliRunner

from capsense.cli import main
from capsense.errors import CapsenseError
from capsense.scoring.probe import KeepsRequestScores, ProbeScorer, build_probe, model_max_length
from capsense.scoring.requests import check_accuracy_metric, encode_pair, load_task, rolling_requests
from _toy_task import TOY_CONTROL, TOY_ROLLING, TOY_TASK, make_toy_setup
from conftest import make_char_tokenizer


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return make_toy_setup(tmp_path_factory.mktemp("toy_rolling"))


def test_a_text_is_its_tokens_predicted_once_in_windows_of_the_given_length():
    tok = make_char_tokenizer()
    short = "the cat sat"
    assert rolling_requests(tok, short, 128) == [encode_pair(tok, "", short)]  # one window: the prefix, then every token
    long = " ".join(["the cat sat on a mat"] * 20)  # 419 characters
    windows = rolling_requests(tok, long, 128)
    assert len(windows) == 4 and windows[0][0] == [tok.bos_token_id]
    assert [t for _, t in windows for t in t] == tok.encode(long)  # every token predicted, once, in order
    assert all(len(c) + len(t) <= 128 + 1 for c, t in windows)  # each fits the model after the usual shift


@pytest.mark.parametrize("full_logits", [True, False])
def test_a_perplexity_probe_scores_what_lm_eval_hf_scores(toy, full_logits, capfd):
    """The probe's summed log-likelihood per document equals lm-eval's ``loglikelihood_rolling`` through
    capsense-masked, on hf's own path (``full_logits``) and on capsense's: the same windows at the model's length, the
    same tokens. Asked for no bars, lm-eval's rolling draws none per batch of windows either."""
    from capsense.evaluation.lm_eval_model import CapsenseMaskedLM

    model_dir, tasks = toy
    lm = CapsenseMaskedLM(pretrained=str(model_dir), batch_size=3, device="cpu", full_logits=full_logits)
    probe = build_probe(TOY_ROLLING, lm.tokenizer, None, 0, [str(tasks)], window=model_max_length(lm.model))
    assert probe.kind == "loglikelihood" and probe.n_requests > probe.n_docs  # the long documents took two windows
    scorer = type("Kept", (KeepsRequestScores, ProbeScorer), {})(lm.model, probe)
    nll = float(scorer.score()["nll"][0])
    per_request = scorer.last[0][0]
    mine = np.bincount(probe.doc_of, weights=per_request, minlength=probe.n_docs)

    task = load_task(TOY_ROLLING, [str(tasks)], lm.tokenizer)
    task.build_all_requests(samples=sorted(probe.doc_ids), rank=0, world_size=1)
    capfd.readouterr()
    theirs = dict(zip(sorted(probe.doc_ids), lm.loglikelihood_rolling(task.instances, disable_tqdm=True)))
    assert "Running loglikelihood requests" not in capfd.readouterr().err
    assert mine == pytest.approx([theirs[d] for d in probe.doc_ids], rel=1e-5)
    n_tokens = sum(len(t) for t in probe.continuation_ids)
    assert nll == pytest.approx(-sum(theirs.values()) / n_tokens, rel=1e-5)


def test_a_locate_run_takes_a_perplexity_control(toy, tmp_path):
    model_dir, tasks = toy
    out = tmp_path / "run"
    args = ["locate", str(model_dir), "--task", TOY_TASK, "--controls", f"{TOY_CONTROL},{TOY_ROLLING}", "--include-path",
            str(tasks), "--limit", "12", "--method", "exhaustive", "--dtype", "float32", "--no-progress", "--out", str(out)]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    clean = json.loads((out / "evaluations.jsonl").read_text().splitlines()[0])["scores"][TOY_ROLLING]["nll"]
    from capsense.core.models import load_model

    model, tokenizer = load_model(str(model_dir), "float32", "cpu")
    probe = build_probe(TOY_ROLLING, tokenizer, 12, 0, [str(tasks)], window=model_max_length(model))
    assert clean == pytest.approx(float(ProbeScorer(model, probe).score()["nll"][0]), rel=1e-6)
    assert TOY_ROLLING in json.loads((out / "heads.json").read_text())["controls"]
    clean_line = next(ln for ln in (out / "report.md").read_text().splitlines() if ln.startswith("Clean model:"))
    assert f"{TOY_TASK} nll" in clean_line and ", acc" in clean_line  # a log-likelihood task's accuracy
    assert re.search(rf"{TOY_ROLLING} nll [0-9.]+(;|$)", clean_line)  # none for the perplexity task's windows


def test_accuracy_is_refused_for_a_run_with_a_perplexity_task(toy, tmp_path):
    model_dir, tasks = toy
    check_accuracy_metric([TOY_TASK, TOY_CONTROL], [str(tasks)])  # log-likelihood tasks have an accuracy
    with pytest.raises(CapsenseError, match=rf"'{TOY_ROLLING}' is a perplexity task .*use nll"):
        check_accuracy_metric([TOY_TASK, TOY_ROLLING], [str(tasks)])
    args = ["locate", str(model_dir), "--task", TOY_TASK, "--controls", TOY_ROLLING, "--include-path", str(tasks),
            "--metric", "acc", "--method", "exhaustive", "--no-progress", "--out", str(tmp_path / "acc")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0 and "is a perplexity task" in result.output
    assert not (tmp_path / "acc").exists()  # refused before anything was written


def test_the_parity_bench_reports_both_paths_agreeing(toy, monkeypatch, capsys):
    """recipes/bench/rolling_parity.py, run on the tiny model: both paths, every document within float32 rounding."""
    from conftest import load_bench_script

    model_dir, tasks = toy
    bench = load_bench_script("rolling_parity")
    monkeypatch.setattr("sys.argv", ["rolling_parity.py", "--model", str(model_dir), "--task", TOY_ROLLING,
                                     "--include-path", str(tasks), "--limit", "8"])
    bench.main()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "largest per-document" in ln]
    assert len(lines) == 2 and "hf path" in lines[0] and "capsense path" in lines[1]
    assert all(float(re.search(r"\|difference\| (\S+) nats", ln).group(1)) < 1e-4 for ln in lines)
    assert all("8 documents" in ln and "windows at 128 tokens" in ln for ln in lines)


def test_a_perplexity_task_without_text_is_refused(tmp_path):
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    (tmp_path / "blank.yaml").write_text(
        f"task: blank_text\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'blank.jsonl'}\n"
        'test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: bits_per_byte\n")
    with pytest.raises(CapsenseError, match="'blank_text': its documents have no text to score"):
        build_probe("blank_text", make_char_tokenizer(), None, 0, [str(tmp_path)])

"""Distillation: KD lowers the student's divergence, keeps pruning masks, resumes after a kill exactly."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from conftest import make_char_tokenizer, make_tiny_model

from capsense.compress.engine import compress_model
from capsense.compress.budget import uniform_budget
from capsense.compress.distill import DistillConfig, epoch_order, kd_loss, run_distill
from capsense.compress.study.epochs import effective_epochs, fit_log_epochs, fit_reuse_penalty
from capsense.errors import CapsenseError
from capsense.compress.targets import find_targets


@pytest.fixture()
def setup(tmp_path):
    teacher = make_tiny_model("llama")
    student = copy.deepcopy(teacher)
    compress_model(student, uniform_budget({"method": "magnitude", "density": 0.4}))
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"Sample {i}: the cat sat on mat {i * 3} and then ran." for i in range(8)))
    cfg = DistillConfig(student="tiny-student", teacher="tiny-teacher", sources=str(text), n_texts=6, gen_tokens=4,
                        seq_len=40, epochs=2, lr=1e-3)
    tok = make_char_tokenizer()
    held_out = torch.tensor([tok.encode("Sample 97: the cat sat on mat 12 and then ran.")])  # not a training text

    def evaluate(model):
        with torch.no_grad():
            return {"x": float(kd_loss(model(input_ids=held_out).logits, teacher(input_ids=held_out).logits))}

    return teacher, student, tok, cfg, evaluate


def test_distillation_lowers_divergence_and_keeps_masks(setup, tmp_path):
    teacher, student, tok, cfg, evaluate = setup
    zeros = {t.name: t.get() == 0 for t in find_targets(student)}
    records = run_distill(cfg, tmp_path / "out", evaluate, progress=False, models=(student, teacher, tok))
    assert [r["epoch"] for r in records] == [0, 1, 2]
    assert records[-1]["dL"]["x"] < records[0]["dL"]["x"]
    assert all(torch.equal(t.get() == 0, zeros[t.name]) for t in find_targets(student))  # mask kept, exact size holds
    meta = json.loads((tmp_path / "out" / "capsense.json").read_text())
    assert meta["distill"]["config"]["epochs"] == 2 and not (tmp_path / "out.partial").exists()
    assert meta["distill"]["versions"]["torch"] == torch.__version__ and meta["distill"]["host"]["device"] == "cpu"


def test_a_killed_run_resumes_to_the_same_weights(setup, tmp_path):
    teacher, student, tok, cfg, evaluate = setup
    s1, s2 = copy.deepcopy(student), copy.deepcopy(student)
    run_distill(cfg, tmp_path / "a", evaluate, progress=False, models=(s1, teacher, tok))
    assert run_distill(cfg, tmp_path / "b", evaluate, save_every=2, progress=False, models=(s2, teacher, tok),
                       stop_after=7) is None  # killed in the second epoch (6 texts per epoch)
    assert not (tmp_path / "b").exists() and (tmp_path / "b.partial" / "state.pt").is_file()
    s3 = copy.deepcopy(student)  # a restarted process starts from the checkpoint again
    records = run_distill(cfg, tmp_path / "b", evaluate, progress=False, models=(s3, teacher, tok))
    assert [r["epoch"] for r in records] == [0, 1, 2]
    for t1, t3 in zip(find_targets(s1), find_targets(s3)):
        assert torch.equal(t1.get(), t3.get())
    other = DistillConfig(**{**cfg.__dict__, "lr": 5e-4})
    run_distill(other, tmp_path / "c", None, progress=False, models=(copy.deepcopy(student), teacher, tok), stop_after=1)
    with pytest.raises(CapsenseError, match="holds another distillation"):
        run_distill(cfg, tmp_path / "c", None, progress=False, models=(copy.deepcopy(student), teacher, tok))


def test_bfloat16_run_trains_float32_masters_and_resumes_exactly(setup, tmp_path):
    """A bfloat16 run: Adam updates float32 masters of the trained matrices and the student's bfloat16 matrices are
    those masters rounded. At the default lr, Adam's first step (~lr per weight) moves every unpruned master, while
    most bfloat16 weights of the same matrices could not move by that much (below half their spacing); a killed run
    resumes from the masters to the same weights; pruned zeros stay zero; the divergence still drops."""
    teacher, student, tok, cfg, evaluate = setup
    t16, s16 = copy.deepcopy(teacher).to(torch.bfloat16), copy.deepcopy(student).to(torch.bfloat16)
    start = [t.get().float() for t in find_targets(s16)]
    slow = DistillConfig(**{**cfg.__dict__, "lr": 2e-5, "dtype": "bfloat16"})
    assert run_distill(slow, tmp_path / "slow", None, progress=False, models=(s16, t16, tok), stop_after=1) is None
    masters = torch.load(tmp_path / "slow.partial" / "state.pt", weights_only=False)["weights"]
    moved = kept = 0
    for t, m, w0 in zip(find_targets(s16), masters, start):
        assert m.dtype == torch.float32 and torch.equal(t.get(), m.to(torch.bfloat16))  # the student follows them
        live = w0 != 0
        assert torch.equal(m != 0, live)  # pruned zeros held
        moved += int(((m - w0).abs() > 0)[live].sum())
        half_spacing = torch.finfo(torch.bfloat16).eps * w0.abs() / 2
        kept += int(((m - w0).abs() < half_spacing)[live].sum())
    n_live = sum(int((w0 != 0).sum()) for w0 in start)
    assert moved > 0.95 * n_live and kept > 0.5 * n_live  # every master moved; in place, most would not have

    bf = DistillConfig(**{**cfg.__dict__, "dtype": "bfloat16"})
    s1, s2 = copy.deepcopy(student).to(torch.bfloat16), copy.deepcopy(student).to(torch.bfloat16)
    records = run_distill(bf, tmp_path / "a", evaluate, progress=False, models=(s1, t16, tok))
    assert records[-1]["dL"]["x"] < records[0]["dL"]["x"]
    assert run_distill(bf, tmp_path / "b", None, save_every=2, progress=False, models=(s2, t16, tok), stop_after=7) is None
    s3 = copy.deepcopy(student).to(torch.bfloat16)  # a restarted process: the checkpoint's masters, not its rounding
    run_distill(bf, tmp_path / "b", None, progress=False, models=(s3, t16, tok))
    assert all(torch.equal(t1.get(), t3.get()) for t1, t3 in zip(find_targets(s1), find_targets(s3)))
    saved = json.loads((tmp_path / "b" / "capsense.json").read_text())["distill"]["config"]
    assert saved["dtype"] == "bfloat16"


def test_distillation_dtype_is_checked():
    with pytest.raises(CapsenseError, match="valid are float32, bfloat16 .float16 trains without a loss scale"):
        DistillConfig(student="s", teacher="t", dtype="float16")


def test_models_in_another_dtype_than_the_run_are_refused(setup, tmp_path):
    teacher, student, tok, cfg, evaluate = setup
    with pytest.raises(CapsenseError, match="the student is bfloat16, the run's `dtype` is float32"):
        run_distill(cfg, tmp_path / "o", None, progress=False, models=(student.to(torch.bfloat16), teacher, tok))


def test_log_epoch_fit_recovers_its_coefficients():
    es = [0, 1, 2, 4, 8]
    fit = fit_log_epochs(es, [0.3 - 0.05 * torch.log1p(torch.tensor(float(e))).item() for e in es])
    assert fit["a"] == pytest.approx(-0.05, abs=1e-9) and fit["d0"] == pytest.approx(0.3, abs=1e-9) and fit["rms"] < 1e-9
    with pytest.raises(CapsenseError, match="epochs must be at least 1"):
        DistillConfig(student="s", teacher="t", epochs=0)


def test_fresh_epochs_read_new_texts_and_never_one_twice(setup, tmp_path):
    teacher, student, tok, cfg, evaluate = setup
    text = tmp_path / "many.txt"
    text.write_text("\n".join(f"Line {i}: a dog ran past the {i} red doors." for i in range(12)))
    fresh = DistillConfig(**{**cfg.__dict__, "sources": str(text), "n_texts": 5, "fresh": True})
    orders = [epoch_order(fresh, 10, e) for e in range(2)]
    assert [len(o) for o in orders] == [5, 5] and sorted(orders[0] + orders[1]) == list(range(10))
    reused = DistillConfig(**{**fresh.__dict__, "fresh": False})
    assert sorted(epoch_order(reused, 5, 0)) == sorted(epoch_order(reused, 5, 1)) == list(range(5))
    records = run_distill(fresh, tmp_path / "f", evaluate, progress=False, models=(student, teacher, tok))
    assert [r["epoch"] for r in records] == [0, 1, 2]
    seen = [r["unique_tokens_seen"] for r in records]
    assert seen[0] == 0 < seen[1] < seen[2] == records[-1]["tokens"]  # every epoch added new tokens
    too_many = DistillConfig(**{**fresh.__dict__, "n_texts": 7})  # 14 texts asked, the file holds 12
    with pytest.raises(CapsenseError, match="give 12 texts, not the 14 asked"):
        run_distill(too_many, tmp_path / "g", None, progress=False, models=(copy.deepcopy(student), teacher, tok))


def test_reuse_fit_recovers_the_decay_constant():
    d0, a, r_true = 0.8, -0.3, 1.5
    fresh = [{"epoch": e, "dL": {"m": d0 + a * math.log1p(e)}} for e in range(5)]
    reused = [{"epoch": e, "dL": {"m": d0 + a * math.log1p(effective_epochs(e, r_true))}} for e in range(5)]
    fit = fit_reuse_penalty(reused, fresh)["m"]
    assert fit["r_star"] == pytest.approx(r_true, rel=0.05) and fit["rms"] < 1e-3 < fit["rms_no_penalty"]
    assert fit["measured_effective_epochs"][4] == pytest.approx(effective_epochs(4, r_true), rel=1e-6)
    worth_fresh = fit_reuse_penalty(fresh, fresh)["m"]  # repeats as good as new text: no penalty
    assert worth_fresh["r_star"] == "inf" and worth_fresh["rms"] < 1e-9
    flat = [{"epoch": e, "dL": {"m": 0.5}} for e in range(3)]
    assert fit_reuse_penalty(flat, flat)["m"]["r_star"] is None  # fresh text did not help: nothing to fit
    with pytest.raises(CapsenseError, match="both arms"):
        fit_reuse_penalty([], fresh)
    with pytest.raises(CapsenseError, match="past epoch 0"):
        fit_reuse_penalty(reused[:1], fresh)  # only the record before training


def test_cli_fresh_arm_and_too_few_texts(tmp_path, tiny_model_dir):
    from click.testing import CliRunner

    from capsense.cli import main

    student = tmp_path / "student"
    r = CliRunner().invoke(main, ["compress", str(tiny_model_dir), "--method", "magnitude", "--density", "0.5",
                                  "--out", str(student)])
    assert r.exit_code == 0, r.output
    args = ["distill", str(student), "--teacher", str(tiny_model_dir), "--epochs", "2", "--gen-tokens", "2",
            "--seq-len", "24", "--capabilities", "addition", "--probes", "2", "--fresh"]  # (no source: held out whatever --texts)
    r = CliRunner().invoke(main, [*args, "--texts", "3", "--out", str(tmp_path / "fresh")])
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "fresh" / "capsense.json").read_text())["distill"]
    assert meta["config"]["fresh"] is True and [e["epoch"] for e in meta["epochs"]] == [0, 1, 2]
    assert meta["epochs"][1]["unique_tokens_seen"] < meta["epochs"][2]["unique_tokens_seen"] == meta["epochs"][2]["tokens"]
    r = CliRunner().invoke(main, [*args, "--texts", "5000", "--out", str(tmp_path / "big")])  # the tasks hold fewer
    assert r.exit_code == 1 and "Error:" in r.output and "not the 10000 asked" in r.output, r.output
    assert "Traceback" not in r.output and not (tmp_path / "big").exists() and not (tmp_path / "big.partial").exists()
    r = CliRunner().invoke(main, [*args[:-4], "qa", "--probes", "2", "--texts", "5000", "--out", str(tmp_path / "qa")])
    assert r.exit_code == 1 and "'qa' has 135 documents: its first 2 measure it and its last 135" in r.output, r.output


def test_distill_command_takes_a_dtype(tmp_path, tiny_model_dir):
    """`capsense distill --dtype bfloat16` loads both models in bfloat16 and saves a bfloat16 student (distill loaded
    float32 only: a teacher and a student of 8B in float32 are 64 GB); float16, which would need a loss scale, is
    refused among the choices before anything loads."""
    from click.testing import CliRunner
    from safetensors import safe_open

    from capsense.cli import main

    student = tmp_path / "student"
    r = CliRunner().invoke(main, ["compress", str(tiny_model_dir), "--method", "magnitude", "--density", "0.5",
                                  "--no-progress", "--out", str(student)])
    assert r.exit_code == 0, r.output
    base = ["distill", str(student), "--teacher", str(tiny_model_dir), "--epochs", "1", "--texts", "2", "--gen-tokens",
            "2", "--seq-len", "16", "--capabilities", "qa", "--probes", "2", "--no-progress"]
    r = CliRunner().invoke(main, [*base, "--dtype", "float16", "--out", str(tmp_path / "h")])
    assert r.exit_code == 2 and "'float32', 'bfloat16'" in r.output and not (tmp_path / "h.partial").exists(), r.output
    r = CliRunner().invoke(main, [*base, "--dtype", "bfloat16", "--out", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    with safe_open(tmp_path / "b" / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    meta = json.loads((tmp_path / "b" / "capsense.json").read_text())
    assert meta["distill"]["config"]["dtype"] == "bfloat16"


def test_a_distilled_checkpoint_has_its_own_card_and_size(tmp_path, tiny_model_dir):
    """A distilled folder carried the compressed student's capsense.json as it was: the student's bytes on disk (a
    float32 student distilled in bfloat16 stores half), no model card, and the paths of this machine in its config.
    Now its size is its own, its card says what distillation did, and it names no local path."""
    from click.testing import CliRunner

    from capsense.cli import main
    from capsense.compress.packed import size_on_disk

    student = tmp_path / "student"
    r = CliRunner().invoke(main, ["compress", str(tiny_model_dir), "--method", "magnitude", "--density", "0.5",
                                  "--no-progress", "--out", str(student)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["distill", str(student), "--teacher", str(tiny_model_dir), "--epochs", "1", "--texts",
                                  "2", "--gen-tokens", "2", "--seq-len", "16", "--capabilities", "qa,math", "--probes",
                                  "2", "--dtype", "bfloat16", "--no-progress", "--out", str(tmp_path / "d")])
    assert r.exit_code == 0, r.output
    meta = json.loads((tmp_path / "d" / "capsense.json").read_text())
    before = json.loads((student / "capsense.json").read_text())["size"]["bytes_on_disk"]
    assert meta["size"]["bytes_on_disk"] == size_on_disk(tmp_path / "d") < 0.6 * before  # bfloat16: about half
    text = json.dumps(meta)
    assert str(tmp_path) not in text and meta["distill"]["config"]["student"] == "<local>/student", text
    card = (tmp_path / "d" / "README.md").read_text()
    assert card.startswith("# <local>/") and ", distilled\n" in card.splitlines()[0] + "\n"
    assert "## Distilled" in card and "in bfloat16" in card and "| qa |" in card and "after epoch 1" in card, card
    assert str(tmp_path) not in card
    r = CliRunner().invoke(main, ["distill", str(tmp_path / "d"), "--teacher", str(tiny_model_dir), "--epochs", "1",
                                  "--texts", "2", "--gen-tokens", "2", "--seq-len", "16", "--capabilities", "qa",
                                  "--probes", "2", "--no-progress", "--out", str(tmp_path / "d2")])
    assert r.exit_code == 0, r.output
    again = json.loads((tmp_path / "d2" / "capsense.json").read_text())  # distilled twice: the first run is kept
    assert again["distill_earlier"] == [meta["distill"]] and again["distill"]["config"]["dtype"] == "float32"

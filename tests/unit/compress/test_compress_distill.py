"""Distillation: KD lowers the student's divergence, keeps pruning masks, resumes after a kill exactly."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import make_char_tokenizer, make_tiny_model

from capsense.compress.engine import compress_model
from capsense.compress.budget import uniform_budget
from capsense.compress.distill import DistillConfig, fit_log_epochs, kd_loss, run_distill
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


def test_log_epoch_fit_recovers_its_coefficients():
    es = [0, 1, 2, 4, 8]
    fit = fit_log_epochs(es, [0.3 - 0.05 * torch.log1p(torch.tensor(float(e))).item() for e in es])
    assert fit["a"] == pytest.approx(-0.05, abs=1e-9) and fit["d0"] == pytest.approx(0.3, abs=1e-9) and fit["rms"] < 1e-9
    with pytest.raises(CapsenseError, match="epochs must be at least 1"):
        DistillConfig(student="s", teacher="t", epochs=0)

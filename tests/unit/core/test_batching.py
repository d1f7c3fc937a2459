"""``batch_size``: a number or ``auto``, one check of the value, and ``auto`` sized from a (simulated) GPU's memory."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from capsense.cli import main
from capsense.core import placement
from capsense.core.batching import (
    AUTO_MEMORY_FRACTION, CPU_BATCH_SIZE, MAX_AUTO_BATCH_SIZE, check_batch_size, lm_eval_batch_size, row_bytes,
    rows_that_fit,
)
from capsense.core.models import load_model
from capsense.errors import CapsenseError
from capsense.localize.config import LocateConfig


@pytest.mark.parametrize("value, expected", [(1, 1), (64, 64), ("32", 32), ("auto", "auto"), (" AUTO ", "auto")])
def test_a_batch_size_is_a_positive_number_or_auto(value, expected):
    assert check_batch_size(value) == expected


@pytest.mark.parametrize("value", [0, -4, "0", "big", 2.5, None, True])
def test_anything_else_is_refused_naming_what_is_valid(value):
    with pytest.raises(CapsenseError, match=r"^`batch_size` must be a positive number of requests per forward pass "
                                            r"or `auto` .*, got "):
        check_batch_size(value)


def test_the_settings_and_the_commands_refuse_it_before_any_model_loads(tmp_path):
    with pytest.raises(CapsenseError, match="`batch_size` must be"):
        LocateConfig(model="no-such-model", task="capsense_induction", out=str(tmp_path / "r"), batch_size=0).check()
    cfg = LocateConfig(model="no-such-model", task="capsense_induction", out=str(tmp_path / "r"), batch_size="auto")
    cfg.check()
    assert cfg.batch_size == "auto"
    for command in ("locate", "validate", "evaluate"):
        extra = {"locate": ["--task", "capsense_induction", "--out", str(tmp_path / "x")],
                 "validate": ["--heads", "h.json", "--top-k", "5"], "evaluate": ["--heads", "L0H0"]}[command]
        r = CliRunner().invoke(main, [command, "no-such-model", *extra, "--batch-size", "lots"])
        assert r.exit_code == 2 and "Invalid value for '--batch-size': `batch_size` must be" in r.output, r.output
    r = CliRunner().invoke(main, ["measure", "no-such-model", "--batch-size", "auto"])  # measure has no auto
    assert r.exit_code == 2 and "--batch-size" in r.output
    assert not (tmp_path / "x").exists()


def test_a_recipe_validate_batch_size_is_checked_with_the_steps(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(f"model: smollm2-135m\nout: {tmp_path / 'out'}\nlocate:\n  task: capsense_induction\n"
                 "validate:\n  batch_size: many\n")
    r = CliRunner().invoke(main, ["run", str(p), "--dry-run"])
    assert r.exit_code == 1 and "validate `batch_size` must be a positive number" in r.output, r.output


def test_lm_eval_gets_its_own_auto_only_on_gpus():
    assert lm_eval_batch_size(8, "cpu") == 8 and lm_eval_batch_size("8", "cuda") == 8
    assert lm_eval_batch_size("auto", "cpu") == CPU_BATCH_SIZE  # a trial forward at 64 would swap, not fail
    assert lm_eval_batch_size("auto", "cuda:1") == "auto"
    assert lm_eval_batch_size("auto", "cpu", device_map="auto") == ("auto" if torch.cuda.is_available() else CPU_BATCH_SIZE)


def test_row_arithmetic(tiny_model_dir):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    fwd = row_bytes(cfg, 100)
    assert row_bytes(cfg, 200) > 2 * fwd  # the score matrix grows with the square of the length
    assert row_bytes(cfg, 100, scored=4) - fwd == 4 * cfg.vocab_size * 4 * 2  # float32 logits and log-softmax
    assert row_bytes(cfg, 100, backward=True) == fwd + fwd // 2 * cfg.num_hidden_layers  # a layer's set kept per layer
    assert rows_that_fit(cfg, 100, 10 * fwd) == 10 and rows_that_fit(cfg, 100, 0) == 1  # never below 1
    assert rows_that_fit(cfg, 100, 10 * fwd, backward=True) < 10


def test_auto_is_16_on_a_cpu_and_sized_from_free_memory_on_a_gpu(tiny_model_dir, monkeypatch):
    model, _ = load_model(str(tiny_model_dir), "bfloat16")
    assert placement.auto_batch_size(model, 100, 4, 1000) == CPU_BATCH_SIZE
    one = row_bytes(placement.text_config(model), 100, 2, 4)
    free = int(40 * one / AUTO_MEMORY_FRACTION / 0.9) + 1  # available_device_memory keeps 90% of what is free
    monkeypatch.setattr(placement, "input_device", lambda m: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (free, 10**12))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: 0)
    assert placement.auto_batch_size(model, 100, 4, 1000) == 40
    assert placement.auto_batch_size(model, 100, 4, 25) == 25  # no more than the requests there are
    assert placement.auto_batch_size(model, 100, 4, 1000, reserved_bytes=free // 2) < 40  # beside the prefix cache
    assert placement.auto_batch_size(model, 100, 4, 1000, backward=True) < 40  # a gradient pass keeps every layer
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (10**15, 10**15))
    assert placement.auto_batch_size(model, 100, 4, 10**6) == MAX_AUTO_BATCH_SIZE
    model.hf_device_map = {"": 0}  # under a device map activations cross devices: the CPU figure
    assert placement.auto_batch_size(model, 100, 4, 1000) == CPU_BATCH_SIZE


def test_plan_scoring_resolves_auto_and_keeps_a_number(tiny_model_dir, monkeypatch):
    model, _ = load_model(str(tiny_model_dir), "bfloat16")
    args = dict(lengths=[100] * 50, prefix_reuse=True, masks_per_forward=None, dtype="bfloat16", refine_dtype="float32")
    assert {k: v for k, v in placement.plan_scoring(model, 8, **args).items() if "batch" in k} == \
        {"batch_size": 8, "attribution_batch_size": 8}
    cpu = placement.plan_scoring(model, "auto", **args, scored=4, most_requests=50)
    assert (cpu["batch_size"], cpu["attribution_batch_size"]) == (CPU_BATCH_SIZE, CPU_BATCH_SIZE)
    monkeypatch.setattr(placement, "input_device", lambda m: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (10**12, 10**12))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev=None: type("P", (), {"total_memory": 10**12}))
    gpu = placement.plan_scoring(model, "auto", **args, scored=4, most_requests=50)
    assert gpu["batch_size"] == gpu["attribution_batch_size"] == 50 and gpu["masks_per_forward"] == 1

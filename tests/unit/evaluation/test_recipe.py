"""Recipes: every shipped YAML loads; steps and errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from capsense.cli import main
from capsense.evaluation.recipe import load_recipe, recipe_steps
from capsense.errors import CapsenseError

RECIPES = sorted((Path(__file__).resolve().parents[3] / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", [p for p in RECIPES if p.name.startswith(("paper_", "smollm2_", "gemma3_"))], ids=lambda p: p.name)
def test_shipped_recipes_load(path):
    data = load_recipe(path)
    steps = recipe_steps(data)
    assert steps and data["hardware"] and data["expected_time"]
    for cfg, val in steps:
        cfg.check()
        assert val is None or val["tasks"] is None or cfg.task in val["tasks"]  # None: target, controls, held-out suite


def test_paper_recipe_follows_the_paper():
    cfg, val = recipe_steps(load_recipe(Path("recipes/paper_llama31_8b.yaml")))[0]
    assert (cfg.masks, cfg.sparsity, cfg.limit, cfg.alpha, cfg.solver) == (100, 0.02, 100, 0.01, "lasso")
    assert val["top_k"] == 5


def test_bad_recipe_key(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("model: m\nlocate:\n  task: t\n  maskz: 3\n")
    with pytest.raises(CapsenseError, match=r"unknown locate keys \['maskz'\]"):
        load_recipe(p)


def test_run_dry_run_prints_the_steps():
    r = CliRunner().invoke(main, ["run", "recipes/smollm2_induction_cpu.yaml", "--dry-run"])
    assert r.exit_code == 0, r.output
    from capsense.tasks.suite import SCREEN

    assert f"locate smollm2-135m --task capsense_induction --controls {','.join(SCREEN)},capsense_arithmetic" in r.output
    assert "--tasks <target, controls, held-out suite>" in r.output
    assert "--metric" not in r.output and "--refine-search" not in r.output  # nll and swaps, the defaults, go unsaid


def test_dry_run_names_a_metric_other_than_nll(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(f"model: smollm2-135m\nout: {tmp_path / 'o'}\nlocate:\n  task: capsense_antonyms\n  metric: choice_nll\n")
    r = CliRunner().invoke(main, ["run", str(p), "--dry-run"])
    assert r.exit_code == 0 and "--fe-budget 50 --metric choice_nll --limit 100" in r.output, r.output
    p.write_text(p.read_text() + "  refine_search: predicted\n")
    r = CliRunner().invoke(main, ["run", str(p), "--dry-run"])
    assert r.exit_code == 0 and "--metric choice_nll --refine-search predicted --limit 100" in r.output, r.output
    p.write_text(p.read_text() + "  ablation: mean\nvalidate:\n  ablation: zero\n")
    r = CliRunner().invoke(main, ["run", str(p), "--dry-run"])
    assert r.exit_code == 0 and "--refine-search predicted --ablation mean --limit 100" in r.output, r.output
    p.write_text(p.read_text().replace("ablation: zero", "ablation: half"))
    r = CliRunner().invoke(main, ["run", str(p), "--dry-run"])
    assert r.exit_code == 1 and "unknown `ablation` mode 'half': valid modes are zero, mean" in r.output, r.output
    p.write_text(p.read_text().replace("ablation: half", f"mean_reference: {tmp_path / 'missing.txt'}"))
    r = CliRunner().invoke(main, ["run", str(p), "--dry-run"])  # refused before the locate, not after it
    assert r.exit_code == 1 and f"mean_reference file '{tmp_path / 'missing.txt'}' not found" in r.output, r.output


def test_a_recipe_without_controls_uses_the_default_suite(tmp_path):
    from capsense.tasks.suite import SCREEN

    p = tmp_path / "r.yaml"
    p.write_text("model: m\nlocate:\n  task: capsense_induction\n")
    (cfg, _), = recipe_steps(load_recipe(p))
    assert cfg.controls == list(SCREEN)
    p.write_text("model: m\nlocate:\n  task: capsense_induction\n  controls: [none]\n")
    (cfg, _), = recipe_steps(load_recipe(p))
    assert cfg.controls == []


def test_a_field_may_map_targets_to_values(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("model: m\nlocate:\n  task: [a, b]\n  metric: {a: exact_match}\n  masks: 7\n")
    steps = recipe_steps(load_recipe(p))
    assert [(c.task, c.metric, c.masks) for c, _ in steps] == [("a", "exact_match", 7), ("b", "nll", 7)]
    p.write_text("model: m\nlocate:\n  task: [a, b]\n  metric: {c: acc}\n")
    with pytest.raises(CapsenseError, match=r"locate.metric maps \['c'\], which are not targets \(a, b\)"):
        recipe_steps(load_recipe(p))


def test_run_locates_then_validates_a_toy_recipe(tmp_path):
    import json

    from _toy_task import TOY_GEN, TOY_TASK, write_toy_recipe

    recipe = write_toy_recipe(
        tmp_path,
        {"limit": 12, "method": "cs", "masks": 8, "heads_per_mask": 2, "sparsity": None, "refine": 4, "batch_size": "auto"},
        {"tasks": [TOY_GEN], "top_k": 2, "random": 1, "limit": 4, "include_path": "TASKS", "batch_size": "auto"},
    )
    r = CliRunner().invoke(main, ["run", str(recipe), "--no-progress"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert f"{TOY_TASK}: top-2 = " in r.output and "| task | metric | base | ablated |" in r.output
    n_refine = json.loads((tmp_path / "out" / "locate" / "heads.json").read_text())["refine"]["n_evaluations"]
    assert 1 <= n_refine <= 4  # the predicted set first; more only when it breaks the tolerance
    identity = json.loads((tmp_path / "out" / "locate" / "manifest.json").read_text())["identity"]
    recast = identity["refine_dtype"] is not None or identity["autocast"] is not None  # the clean model again, in float32
    assert len((tmp_path / "out" / "locate" / "evaluations.jsonl").read_text().splitlines()) == 9 + recast + n_refine
    validation = json.loads((tmp_path / "out" / "validate" / "validation.json").read_text())
    assert validation["rows"] and (validation["batch_size"], validation["lm_eval_batch_size"]) == ("auto", 16)  # CPU
    assert json.loads((tmp_path / "out" / "locate" / "manifest.json").read_text())["args"]["batch_size_resolved"] == 16

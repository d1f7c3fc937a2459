"""Recipes: every shipped YAML loads; steps and errors."""

from __future__ import annotations

import shlex
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


class _Captured(Exception):
    pass


def _dry_run_lines(path) -> list[list[str]]:
    r = CliRunner().invoke(main, ["run", str(path), "--dry-run"])
    assert r.exit_code == 0, r.output
    return [shlex.split(line.strip())[1:] for line in r.output.splitlines() if line.startswith("  capsense ")]


def _config_of(args, monkeypatch):
    """The LocateConfig `capsense locate ARGS` would run (the run itself stopped before anything loads)."""
    seen = {}

    def stop(cfg, log=None):
        seen["cfg"] = cfg
        raise _Captured

    monkeypatch.setattr("capsense.localize.run.locate", stop)
    r = CliRunner().invoke(main, args)
    assert isinstance(r.exception, _Captured), r.output
    return seen["cfg"]


@pytest.mark.parametrize("extra", ["", "  metric: choice_nll\n  refine_search: predicted\n  ablation: mean\n  seed: 3\n"
                                   "  top_m: 5\n  screen: 0\n  tolerance: 0.0123456789\nvalidate:\n  random: 1\n  tolerance: 0.2\n  limit: 7\n"
                                   "  tasks: [capsense_antonyms, capsense_prose]\n  top_k: 2\n  ablation: zero\n"])
def test_dry_run_prints_command_lines_that_run_each_step(tmp_path, monkeypatch, extra):
    """The dry run's lines rerun the steps: the locate line gives the recipe's LocateConfig field for field, the
    validate line its settings. It printed a hand-picked few options: the main job's line ran another search (no
    control limit, top-m or refine budget)."""
    from dataclasses import asdict

    from capsense.commands.validate import validate
    from capsense.evaluation.run import validate_kwargs

    if extra:
        path = tmp_path / "r.yaml"
        path.write_text(f"model: smollm2-135m\nout: {tmp_path / 'o'}\nlocate:\n  task: capsense_antonyms\n{extra}")
    else:
        path = Path("recipes/smollm2_induction_cpu.yaml")
    steps = recipe_steps(load_recipe(path))
    lines = _dry_run_lines(path)
    assert [line[0] for line in lines] == ["locate", "validate"] * len(steps)
    for (cfg, val), locate_line, validate_line in zip(steps, lines[::2], lines[1::2]):
        assert asdict(_config_of(locate_line, monkeypatch)) == asdict(cfg)
        params = validate.make_context("validate", validate_line[1:]).params
        expected = validate_kwargs(cfg, val)
        assert {k: params[k] for k in ("n_random", "limit", "seed", "tolerance", "dtype", "ablation")} == {
            k: expected[k] for k in ("n_random", "limit", "seed", "tolerance", "dtype", "ablation")}
        assert (params["top_k"], str(params["out"]), str(params["heads"])) == (
            val.get("top_k", cfg.top_k), val["out"], str(Path(cfg.out) / "heads.json"))
        assert params["tasks"] == (",".join(val["tasks"]) if val["tasks"] else None)


def test_dry_run_refuses_bad_validate_settings_before_the_locate(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(f"model: smollm2-135m\nout: {tmp_path / 'o'}\nlocate:\n  task: capsense_antonyms\n  metric: choice_nll\n"
                 "  ablation: mean\nvalidate:\n  ablation: half\n")
    r = CliRunner().invoke(main, ["run", str(p), "--dry-run"])
    assert r.exit_code == 1 and "unknown `ablation` mode 'half': valid modes are zero, mean" in r.output, r.output
    p.write_text(p.read_text().replace("ablation: half", f"mean_reference: {tmp_path / 'missing.txt'}"))
    r = CliRunner().invoke(main, ["run", str(p), "--dry-run"])  # refused before the locate, not after it
    assert r.exit_code == 1 and f"mean_reference file '{tmp_path / 'missing.txt'}' not found" in r.output, r.output


@pytest.mark.parametrize("section, message", [
    ("  limit: 0\n", "validate `limit` must be an integer >= 1, got 0"),
    ("  random: -1\n", "validate `random` must be an integer >= 0, got -1"),
    ("  seed: x\n", "validate `seed` must be an integer >= 0, got 'x'"),
    ("  top_k: 2.5\n", "validate `top_k` must be an integer >= 1, got 2.5"),
    ("  tolerance: -0.1\n", "validate `tolerance` must be a number >= 0, got -0.1"),
    ("  dtype: float64\n", "validate `dtype` 'float64': valid are float32, bfloat16, float16"),
    ("  device: cuda:7\n", "device 'cuda:7' does not exist on this machine"),
    ("  device: cuda:7\n  device_map: auto\n", "`device` 'cuda:7' does not apply beside `device_map` 'auto'"),
])
def test_a_validate_section_is_checked_before_the_locate(tmp_path, section, message):
    """Round 53: these were read only by validate, once its locate had run."""
    p = tmp_path / "r.yaml"
    p.write_text(f"model: smollm2-135m\nout: {tmp_path / 'o'}\nlocate:\n  task: capsense_antonyms\nvalidate:\n{section}")
    r = CliRunner().invoke(main, ["run", str(p), "--dry-run"])
    assert r.exit_code == 1 and r.output.count("Error") == 1 and message in r.output, r.output


def test_a_validate_section_that_places_the_model_does_not_inherit_locate_s_other_placement(tmp_path):
    """locate on one device, validate spread by a map (or the reverse): each takes its own, not locate's other one
    (which, beside it, is refused)."""
    from capsense.evaluation.run import validate_kwargs

    p = tmp_path / "r.yaml"
    p.write_text(f"model: smollm2-135m\nout: {tmp_path / 'o'}\nlocate:\n  task: capsense_antonyms\n  device: cuda\n"
                 "validate:\n  device_map: auto\n")
    (cfg, val), = recipe_steps(load_recipe(p))
    assert (validate_kwargs(cfg, val)["device"], validate_kwargs(cfg, val)["device_map"]) == ("cpu", "auto")
    p.write_text(f"model: smollm2-135m\nout: {tmp_path / 'o'}\nlocate:\n  task: capsense_antonyms\n  device_map: auto\n"
                 "validate:\n  device: cpu\n")
    (cfg, val), = recipe_steps(load_recipe(p))
    assert (validate_kwargs(cfg, val)["device"], validate_kwargs(cfg, val)["device_map"]) == ("cpu", None)
    p.write_text(f"model: smollm2-135m\nout: {tmp_path / 'o'}\nlocate:\n  task: capsense_antonyms\n  device_map: auto\n"
                 "validate:\n  limit: 5\n")
    (cfg, val), = recipe_steps(load_recipe(p))
    assert validate_kwargs(cfg, val)["device_map"] == "auto"  # a section that names neither: locate's


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

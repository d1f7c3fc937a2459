"""Exact size accounting, budget files with overrides, and capability-protecting budgets."""

from __future__ import annotations


import pytest
import torch
from conftest import HEAD_DIM, make_tiny_model, tiny_inputs

from capsense.compress.engine import compress_model
from capsense.errors import BudgetError, CapsenseError
from capsense.compress.budget import load_budget, normalize_setting, uniform_budget
from capsense.compress.calibration import collect_stats
from capsense.compress.targets import TargetError, find_targets
from capsense.core.heads import HeadsFile, write_heads_file

# tiny llama: hidden 64, intermediate 128, 4 query heads and 2 KV heads of width 16, 3 layers
SHAPES = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64),
          "gate_proj": (128, 64), "up_proj": (128, 64), "down_proj": (64, 128)}
TARGET_PARAMS = 3 * sum(m * n for m, n in SHAPES.values())
MODEL_PARAMS = TARGET_PARAMS + 2 * 128 * 64 + 3 * 2 * 64 + 64  # + embed, lm_head, norms


def test_targets_are_decoder_linears_classified(arch):
    model = make_tiny_model(arch)
    targets = find_targets(model)
    assert {t.kind for t in targets} == {"attn", "mlp"}
    names = {n for n, _ in model.named_parameters()}
    assert not any("embed" in t.name or "lm_head" in t.name or "wte" in t.name for t in targets)
    assert all(f"{t.name}.weight" in names for t in targets)
    assert len(find_targets(model, "attn")) + len(find_targets(model, "mlp")) == len(targets)
    with pytest.raises(TargetError, match="valid targets are attn, mlp"):
        find_targets(model, "ffn")


def test_find_targets_walks_each_decoder_block_once(monkeypatch):
    """One walk of each block's modules gives the experts check and the targets (round 19 walked them twice)."""
    model = make_tiny_model("llama")
    blocks, named, walked = list(model.model.layers), torch.nn.Module.named_modules, []

    def counted(self, *a, **k):
        walked.extend(i for i, b in enumerate(blocks) if b is self)
        return named(self, *a, **k)

    monkeypatch.setattr(torch.nn.Module, "named_modules", counted)
    assert len(find_targets(model)) == 3 * len(SHAPES)
    assert walked == [0, 1, 2]


def test_accounting_is_exact_for_each_family():
    model = make_tiny_model("llama")
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert sum(p.numel() for p in model.parameters()) == MODEL_PARAMS

    r = compress_model(model, uniform_budget({"method": "magnitude", "density": 0.5})).summary
    assert r["target_params"] == TARGET_PARAMS and r["model_params"] == MODEL_PARAMS
    assert r["target_density"] == 0.5
    nonzero = sum(int((t.get() != 0).sum()) for t in find_targets(model))
    assert nonzero == TARGET_PARAMS // 2
    assert r["target_bits_per_param"] == 8.0
    assert r["size_ratio"] == pytest.approx((TARGET_PARAMS // 2 + MODEL_PARAMS - TARGET_PARAMS) / MODEL_PARAMS)

    model.load_state_dict(sd)
    r = compress_model(model, uniform_budget({"method": "rtn", "bits": 4, "group_size": 32})).summary
    bits = 3 * sum(m * n * 4 + m * -(-n // 32) * 16 for m, n in SHAPES.values())
    assert r["target_bits_per_param"] == bits / TARGET_PARAMS
    assert r["model_bits_per_param"] == (bits + 16 * (MODEL_PARAMS - TARGET_PARAMS)) / MODEL_PARAMS
    assert r["target_param_ratio"] == 1.0

    model.load_state_dict(sd)
    res = compress_model(model, uniform_budget({"method": "svd", "ratio": 0.5}, "mlp"))
    stored = 3 * sum(int(0.5 * m * n / (m + n)) * (m + n) for k, (m, n) in SHAPES.items() if k.endswith(("gate_proj", "up_proj", "down_proj")))
    mlp_params = 3 * 3 * 128 * 64
    assert res.summary["target_params"] == mlp_params
    assert res.summary["target_param_ratio"] == stored / mlp_params
    assert res.summary["model_param_ratio"] == (stored + MODEL_PARAMS - mlp_params) / MODEL_PARAMS
    for a in res.accounts:
        assert a.stored_params == int(0.5 * 128 * 64 / 192) * 192
        assert torch.linalg.matrix_rank(dict((t.name, t) for t in find_targets(model))[a.name].get()) <= 21


def test_gqa_models_stay_sane(arch):
    """k/v projections are narrower under GQA: every method handles their shapes."""
    model = make_tiny_model(arch)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    targets = find_targets(model)
    samples = [tiny_inputs(1, 24, seed=i)[0].tolist() for i in range(3)]
    stats = collect_stats(model, targets, samples, gram=True)
    for setting in ({"method": "wanda", "density": 0.5}, {"method": "rtn", "bits": 3},
                    {"method": "svd-llm", "ratio": 0.6}, {"method": "asvd", "ratio": 0.6}):
        model.load_state_dict(sd)
        res = compress_model(model, uniform_budget(setting), stats)
        assert torch.isfinite(model(tiny_inputs()).logits).all()
        assert all(a.n_params == a.shape[0] * a.shape[1] for a in res.accounts)


def test_budget_overrides(tmp_path):
    f = tmp_path / "budget.yaml"
    f.write_text(
        "method: magnitude\ndensity: 0.5\n"
        "overrides:\n"
        "  - layers: 0-1\n    density: 0.9\n"
        "  - layers: [2]\n    matrices: [down_proj]\n    skip: true\n"
        "  - match: '*.self_attn.o_proj'\n    density: 0.75\n"
        "  - layers: 1\n    matrices: mlp\n    method: rtn\n    bits: 4\n"
    )
    budget = load_budget(f)
    model = make_tiny_model("llama")
    res = compress_model(model, budget)
    by = {a.name: a for a in res.accounts}
    L = "model.layers"
    assert by[f"{L}.0.self_attn.q_proj"].density == pytest.approx(0.9, abs=0.01)
    assert by[f"{L}.2.self_attn.q_proj"].density == 0.5
    assert by[f"{L}.0.self_attn.o_proj"].density == 0.75
    assert by[f"{L}.2.mlp.down_proj"].method == "none" and by[f"{L}.2.mlp.down_proj"].density == 1.0
    assert by[f"{L}.1.mlp.up_proj"].method == "rtn" and by[f"{L}.1.mlp.up_proj"].setting["bits"] == 4
    assert by[f"{L}.2.mlp.up_proj"].method == "magnitude"
    # command-line values override the file's default
    b2 = load_budget(f, {"method": None, "density": 0.6})
    assert b2.default["density"] == 0.6


@pytest.mark.parametrize("text,match", [
    ("method: magnitude\ndensity: 1.5\n", r"density 1.5 is outside \(0, 1\]"),
    ("method: prune\ndensity: 0.5\n", "unknown `method` 'prune': valid methods are magnitude, wanda, sparsegpt, rtn, gptq, svd, asvd, svd-llm"),
    ("method: rtn\nbits: 1\n", "RTN needs an integer bit width from 2 to 16"),
    ("method: magnitude\ndensity: 0.5\noverrides:\n  - layers: 0\n    density: 0\n", "outside"),
    ("method: magnitude\ndensity: 0.5\nbogus: 1\n", "unknown key"),
    ("method: magnitude\ndensity: 0.5\noverrides:\n  - layer: 0\n", "unknown key"),
    ("method: svd\nratio: 0.5\ndensity: 0.4\n", "density does not apply to svd"),
    ("[1, 2]\n", "must hold a mapping"),
])
def test_budget_errors(tmp_path, text, match):
    f = tmp_path / "b.yaml"
    f.write_text(text)
    with pytest.raises(BudgetError, match=match):
        load_budget(f)


def test_ratio_leaving_no_rank_is_an_error_before_any_change():
    model = make_tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CapsenseError, match="leaves no rank"):
        compress_model(model, uniform_budget({"method": "svd", "ratio": 0.01}))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # checked before any weight changed
    with pytest.raises(BudgetError, match="unknown `method`"):
        normalize_setting({"method": "awq", "bits": 4})


def _heads_budget(tmp_path, method_lines: str):
    hf = HeadsFile(model="tiny", heads=[{"layer": 1, "head": 2, "importance": 1.0}, {"layer": 2, "head": 0, "importance": 0.5},
                                        {"layer": 0, "head": 3, "importance": 0.1}])
    write_heads_file(tmp_path / "heads.json", hf)
    f = tmp_path / "budget.yaml"
    f.write_text(method_lines + "protect:\n  heads: heads.json\n  top_k: 2\n")
    return load_budget(f)


@pytest.mark.parametrize("method_lines", [
    "method: magnitude\ndensity: 0.3\n", "method: magnitude\ndensity: 0.3\nscope: global\n",
    "method: rtn\nbits: 2\ngroup_size: 16\n", "method: svd\nratio: 0.4\n",
])
def test_protected_heads_keep_their_output_projection_columns(tmp_path, method_lines):
    budget = _heads_budget(tmp_path, method_lines)
    model = make_tiny_model("llama")
    before = {t.name: t.get().clone() for t in find_targets(model)}
    res = compress_model(model, budget)
    by = {a.name: a for a in res.accounts}
    for layer, head in ((1, 2), (2, 0)):
        name = f"model.layers.{layer}.self_attn.o_proj"
        cols = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)
        w = dict((t.name, t) for t in find_targets(model))[name].get()
        assert torch.equal(w[:, cols], before[name][:, cols])
        assert by[name].protected_cols == HEAD_DIM
        assert not torch.equal(w, before[name])  # the rest was compressed
    # the third head is beyond top_k: not protected
    w0 = dict((t.name, t) for t in find_targets(model))["model.layers.0.self_attn.o_proj"].get()
    assert not torch.equal(w0[:, 3 * HEAD_DIM :], before["model.layers.0.self_attn.o_proj"][:, 3 * HEAD_DIM :])
    assert res.summary["protected_heads"] == "L1H2+L2H0"
    if method_lines == "method: magnitude\ndensity: 0.3\n":
        # row scope: the protected 16 of 64 columns come on top of the 30% of the other 48, per row
        assert by["model.layers.1.self_attn.o_proj"].nonzero == 64 * (HEAD_DIM + round(0.3 * (64 - HEAD_DIM)))


def test_protected_head_out_of_range_is_an_error(tmp_path):
    budget = _heads_budget(tmp_path, "method: magnitude\ndensity: 0.5\n")
    from capsense.core.heads import HeadSet

    budget.protect_heads = HeadSet.parse("L7H0")
    with pytest.raises(CapsenseError, match="layer 7 out of range"):
        compress_model(make_tiny_model("llama"), budget)

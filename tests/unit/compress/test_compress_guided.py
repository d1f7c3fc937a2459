"""Whole-head protection (exact, under GQA and fused projections) and capability-guided allocation."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from click.testing import CliRunner
from conftest import HEAD_DIM, make_char_tokenizer, make_tiny_model, tiny_inputs

from capsense.cli import main
from capsense.compress.allocate import Candidate, allocate
from capsense.compress.engine import calibrate, compress_model
from capsense.compress.budget import Override, load_budget, uniform_budget
from capsense.errors import BudgetError, CapsenseError
from capsense.compress.guided import Guide, guided_budget
from capsense.compress.budget import write_budget_file
from capsense.compress.targets import find_targets
from capsense.core.arch import out_projections
from capsense.core.heads import HeadSet

SETTINGS = [{"method": "magnitude", "density": 0.3}, {"method": "rtn", "bits": 2, "group_size": 16},
            {"method": "svd", "ratio": 0.3}]


def _budget(setting, heads, only_layer=None):
    b = uniform_budget(setting)
    b.protect_heads, b.whole_heads = HeadSet.parse(heads), True
    if only_layer is not None:
        b.overrides = [Override(layers={i for i in range(3) if i != only_layer}, setting={"skip": True})]
    return b


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s["method"])
def test_whole_head_protection_under_gqa_is_exact(setting):
    # tiny llama: 4 query heads, 2 KV heads (group of 2), head_dim 16; protect L1H3 -> q rows 48:64,
    # k/v rows 16:32 (group 1), o_proj columns 48:64
    model = make_tiny_model("llama")
    before = {t.name: t.get().clone() for t in find_targets(model)}
    res = compress_model(model, _budget(setting, "L1H3"))
    attn = "model.layers.1.self_attn"
    after = {t.name: t.get() for t in find_targets(model)}
    hd = HEAD_DIM
    assert torch.equal(after[f"{attn}.q_proj"][3 * hd:], before[f"{attn}.q_proj"][3 * hd:])
    for kv in ("k_proj", "v_proj"):
        assert torch.equal(after[f"{attn}.{kv}"][hd:2 * hd], before[f"{attn}.{kv}"][hd:2 * hd])
        assert not torch.equal(after[f"{attn}.{kv}"][:hd], before[f"{attn}.{kv}"][:hd])
    assert torch.equal(after[f"{attn}.o_proj"][:, 3 * hd:], before[f"{attn}.o_proj"][:, 3 * hd:])
    assert not torch.equal(after[f"{attn}.q_proj"][:3 * hd], before[f"{attn}.q_proj"][:3 * hd])
    by = {a.name: a for a in res.accounts}
    assert by[f"{attn}.q_proj"].protected_rows == hd and by[f"{attn}.k_proj"].protected_rows == hd
    assert by[f"{attn}.o_proj"].protected_cols == hd
    for t in find_targets(model):
        a, w = by[t.name], t.get()
        prot = {"q_proj": hd * 64, "k_proj": hd * 64, "v_proj": hd * 64, "o_proj": 64 * hd}.get(t.short, 0) if t.layer == 1 else 0
        m, n = t.shape
        if setting["method"] == "magnitude":  # stored parameters are the nonzeros actually left
            assert a.stored_params == int((w != 0).sum()) == a.nonzero
            assert a.bits == 16 * a.stored_params
        elif setting["method"] == "rtn":  # 2-bit codes + one fp16 scale per 16 columns; protected at 16 bits
            fr, fc = (m - hd, n) if prot and t.short != "o_proj" else ((m, n - hd) if prot else (m, n))
            assert a.bits == fr * fc * 2 + fr * -(-fc // 16) * 16 + (m * n - fr * fc) * 16
            q = w.clone()
            free_vals = q[:fr] if prot and t.short == "q_proj" else None
            if free_vals is not None:  # the quantized block takes at most 3 levels per group of 16
                assert all(len(torch.unique(g)) <= 3 for g in free_vals[:, :16])
        else:
            fr, fc = (m - hd, n) if prot and t.short != "o_proj" else ((m, n - hd) if prot else (m, n))
            r = int(0.3 * fr * fc / (fr + fc))
            assert a.stored_params == r * (fr + fc) + m * n - fr * fc
    assert res.summary["target_bits_per_param"] == sum(a.bits for a in res.accounts) / res.summary["target_params"]


@pytest.mark.parametrize("arch", ["llama", "phi3", "gpt2", "gpt_neox", "qwen2"])
def test_protected_head_output_is_bit_identical(arch):
    """With only layer 1 compressed (2-bit RTN), the protected head's attention output is unchanged."""
    model = make_tiny_model(arch)
    x = tiny_inputs()
    seen = {}
    o_proj = out_projections(model)[1]
    hook = o_proj.register_forward_pre_hook(lambda _m, args: seen.__setitem__("x", args[0].detach().clone()))
    with torch.no_grad():
        model(input_ids=x)
    ref = seen["x"]
    compress_model(model, _budget({"method": "rtn", "bits": 2, "group_size": 0}, "L1H2", only_layer=1))
    with torch.no_grad():
        model(input_ids=x)
    hook.remove()
    h = slice(2 * HEAD_DIM, 3 * HEAD_DIM)
    assert torch.equal(seen["x"][..., h], ref[..., h])
    assert not torch.allclose(seen["x"][..., :HEAD_DIM], ref[..., :HEAD_DIM], atol=1e-6)


def test_allocation_meets_the_size_and_prefers_cheap_cost():
    cands = {
        "a": [Candidate(None, 100, 0.0), Candidate(object(), 50, 1.0), Candidate(object(), 25, 9.0)],
        "b": [Candidate(None, 100, 0.0), Candidate(object(), 50, 0.1), Candidate(object(), 25, 0.2)],
    }
    chosen = allocate(cands, 75)
    assert (chosen["a"].bits, chosen["b"].bits) == (50, 25)  # sensitive "a" keeps more
    chosen = allocate(cands, 110)  # the slack left by the Lagrangian step goes to the best upgrade
    assert (chosen["a"].bits, chosen["b"].bits) == (50, 50)
    with pytest.raises(BudgetError, match="below what the protected weights alone need"):
        allocate(cands, 49)


@pytest.fixture(scope="module")
def guided_case():
    model, tok = make_tiny_model("llama"), make_char_tokenizer()
    base = uniform_budget({"method": "wanda", "density": 0.5})
    stats, _ = calibrate(model, tok, base, "math", 6)
    orig = {k: v.clone() for k, v in model.state_dict().items()}
    al = guided_budget(model, tok, base, stats, Guide(["math"], protect_top_k=2, samples=4))
    return model, tok, base, stats, orig, al


def test_guided_allocation_has_the_uniform_size_and_protects_whole_heads(guided_case):
    model, _, base, stats, orig, al = guided_case
    model.load_state_dict(orig)
    uni = compress_model(model, base, stats).summary
    model.load_state_dict(orig)
    res = compress_model(model, al.budget, stats)
    bits = sum(a.bits for a in res.accounts)
    assert bits == al.info["allocated_bits"] <= al.info["target_bits"] == sum(a.bits for a in compress_model(
        make_tiny_model("llama"), base, stats).accounts)
    assert abs(res.summary["size_ratio"] - uni["size_ratio"]) / uni["size_ratio"] < 0.005
    assert len(al.budget.protect_heads) == 2 and al.budget.whole_heads
    for a in res.accounts:  # counted parameters are the nonzeros actually stored
        assert a.stored_params == a.nonzero
    assert {a.setting.get("density") for a in res.accounts} != {0.5}  # really non-uniform


def test_budget_file_reproduces_the_allocation(guided_case, tmp_path):
    model, _, _, stats, orig, al = guided_case
    model.load_state_dict(orig)
    compress_model(model, al.budget, stats)
    w1 = {t.name: t.get().clone() for t in find_targets(model)}
    write_budget_file(tmp_path / "budget.yaml", al.budget)
    again = load_budget(tmp_path / "budget.yaml")
    assert again.whole_heads and str(again.protect_heads) == str(al.budget.protect_heads)
    model.load_state_dict(orig)
    compress_model(model, again, stats)
    assert all(torch.equal(t.get(), w1[t.name]) for t in find_targets(model))


def test_bad_guided_input_is_one_message_and_writes_nothing(tmp_path, tiny_model_dir):
    with pytest.raises(CapsenseError, match="unknown capability: unknown task 'capsense_poetry'.*the short names are"):
        Guide(["capsense_poetry"])
    tiny = tiny_model_dir
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["compress", str(tiny), "--method", "magnitude", "--density", "0.5", "--keep", "mathh",
                                  "--out", str(out)])
    assert r.exit_code == 1 and "(did you mean math?)" in r.output and not out.exists()
    # every head protected whole at 16 bits cannot fit in half the dense model
    heads = "+".join(f"L{layer}H{h}" for layer in range(3) for h in range(4))
    r = CliRunner().invoke(main, ["compress", str(tiny), "--method", "magnitude", "--density", "0.5", "--keep", "math",
                                  "--calibration-samples", "4", "--protect-heads", heads, "--budget-size", "0.5", "--out", str(out)])
    assert r.exit_code == 1 and "protected weights alone need" in r.output, r.output
    assert r.output.count("Error") == 1 and not out.exists()


def test_keep_writes_allocation_and_budget_file(tmp_path, tiny_model_dir):
    tiny = tiny_model_dir
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["compress", str(tiny), "--method", "rtn", "--bits", "3", "--keep", "math",
                                  "--calibration-samples", "4", "--protect-top-k", "1", "--format", "dense", "--no-check-uniform",
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    meta = json.loads((out / "capsense.json").read_text())
    assert meta["allocation"]["keep"] == ["math"] and meta["allocation"]["allocated_bits"] <= meta["allocation"]["target_bits"]
    assert "selection" not in meta["allocation"]  # the allocation as it is, not checked against uniform
    doc = yaml.safe_load((out / "budget.yaml").read_text())
    assert doc["method"] == "rtn" and doc["protect"]["whole"] is True
    assert sum(a["bits"] for a in meta["matrices"]) == meta["allocation"]["allocated_bits"]


def test_guided_gptq_is_one_packed_checkpoint_with_a_config_group_per_level(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["compress", str(tiny_model_dir), "--method", "gptq", "--bits", "3", "--group-size", "32",
                                  "--keep", "math", "--calibration-samples", "4", "--out", str(out)])
    assert r.exit_code == 0, r.output
    meta = json.loads((out / "capsense.json").read_text())
    levels = {(a["setting"]["bits"], a["setting"]["group_size"]) for a in meta["matrices"]}
    groups = {(g["bits"], g["group_size"]) for g in meta["format"]["groups"]}
    assert len(levels) > 1 and groups == levels  # a mixed allocation, each level its own config group
    assert all(g in (0, 32, 64) for _, g in levels)  # only group sizes that divide 64 and 128 columns
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert len(config["config_groups"]) == len(levels)
    assert AutoModelForCausalLM.from_pretrained(out) is not None


@pytest.mark.parametrize("prot", [None, "rows", "cols"])
def test_fast_pruning_level_costs_equal_applying_each_level(prot):
    from capsense.compress.methods import PruneSetting, Setting
    from capsense.compress.protect import Protection

    g = torch.Generator().manual_seed(0)
    w, f = torch.randn(32, 48, generator=g), torch.rand(32, 48, generator=g)

    class Stats:
        input_norm = torch.rand(48, generator=g) + 0.5

    p = {None: None, "rows": Protection(rows=torch.arange(32) < 8), "cols": Protection(cols=torch.arange(48) >= 40)}[prot]
    base = PruneSetting("wanda", 0.5)
    fast = base.level_costs(base.levels(), "m", w, f, Stats, p, 16)
    slow = Setting.level_costs(base, base.levels(), "m", w, f, Stats, p, 16)
    assert [(s, b) for s, b, _ in fast] == [(s, b) for s, b, _ in slow]
    assert [c for *_, c in fast] == pytest.approx([c for *_, c in slow], rel=1e-5, abs=1e-4)


def test_rtn_protects_no_heads_by_default_and_pruning_does(guided_case):
    model, tok, _, stats, orig, al = guided_case
    model.load_state_dict(orig)
    rtn = guided_budget(model, tok, uniform_budget({"method": "rtn", "bits": 3}), stats, Guide(["math"], samples=2))
    assert rtn.budget.protect_heads is None and not rtn.budget.whole_heads
    assert rtn.info["allocated_bits"] <= rtn.info["target_bits"]
    wanda = guided_budget(model, tok, uniform_budget({"method": "wanda", "density": 0.5}), stats, Guide(["math"], samples=2))
    assert len(wanda.budget.protect_heads) == 8 and wanda.budget.whole_heads


def test_guided_checkpoint_card_states_the_kept_capabilitys_measured_dl(tmp_path, tiny_model_dir):
    out, base_m, ckpt_m = tmp_path / "out", tmp_path / "base.json", tmp_path / "ckpt.json"
    r = CliRunner().invoke(main, ["compress", str(tiny_model_dir), "--method", "gptq", "--bits", "3", "--group-size", "32",
                                  "--keep", "math", "--calibration-samples", "4", "--save-dtype", "float32",
                                  "--out", str(out)])
    assert r.exit_code == 0, r.output
    meta = json.loads((out / "capsense.json").read_text())
    m = meta["measured"]
    assert m["probes"] == 32 and m["dtype"] == "float32" and set(m["capabilities"]) == {"math"}
    math = m["capabilities"]["math"]
    assert math["dL"] == pytest.approx(math["nll"] - math["nll0"]) and math["dL"] != 0
    # the numbers are what `capsense measure` gives on the base model and on the written checkpoint
    for model, path in ((tiny_model_dir, base_m), (out, ckpt_m)):
        r = CliRunner().invoke(main, ["measure", str(model), "--capabilities", "math", "--probes", "32", "--out", str(path)])
        assert r.exit_code == 0, r.output
    assert json.loads(base_m.read_text())["capabilities"]["math"]["nll"] == pytest.approx(math["nll0"], abs=1e-6)
    assert json.loads(ckpt_m.read_text())["capabilities"]["math"]["nll"] == pytest.approx(math["nll"], abs=1e-4)
    card = (out / "README.md").read_text()
    assert "## Measured" in card and f"| math | {math['nll0']:.4f} | {math['nll']:.4f} | {math['dL']:+.4f} |" in card
    assert "keeping **math**" in card and f"| {meta['size']['bytes_on_disk']} |" in card and "| 3b/g" in card


def test_compressed_checkpoint_names_no_path_of_this_machine(tmp_path, tiny_model_dir, calib_file):
    heads = tmp_path / "run" / "heads.json"
    heads.parent.mkdir()
    heads.write_text(json.dumps({"heads": [{"layer": 1, "head": 2}]}))
    budget = tmp_path / "cfg" / "budget.yaml"
    budget.parent.mkdir()
    budget.write_text(yaml.safe_dump({"method": "wanda", "density": 0.5, "protect": {"heads": str(heads)}}))
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["compress", str(tiny_model_dir), "--budget-file", str(budget), "--calibration",
                                  str(calib_file), "--calibration-samples", "4", "--out", str(out)])
    assert r.exit_code == 0, r.output
    meta_text = (out / "capsense.json").read_text()
    meta = json.loads(meta_text)
    assert meta["budget"]["budget_file"] == "budget.yaml" and meta["budget"]["protect"]["heads"] == "heads.json"
    assert meta["calibration"][0]["source"] == calib_file.name and "path" not in meta["base_model"]
    for root in {tmp_path.parent, calib_file.parent.parent, tiny_model_dir.parent.parent}:  # every test folder
        for text in (meta_text, (out / "README.md").read_text()):
            assert str(root) not in text


def test_guided_gptq_pricing_output_or_rtn_and_refusals():
    """GPTQ levels priced by GPTQ's own output error (default) or RTN's weight error: both fill the
    uniform size, they price differently, and the solved errors are reused from the caller's cache."""
    model, tok = make_tiny_model("llama"), make_char_tokenizer()
    base = uniform_budget({"method": "gptq", "bits": 3, "group_size": 16})
    stats, _ = calibrate(model, tok, base, "math", 6)
    cache: dict = {}
    out = guided_budget(model, tok, base, stats, Guide(["math"], samples=4), fisher_cache=cache)
    solved = len(cache["level_costs"])
    assert solved > 0 and out.info["pricing"] == "output"
    again = guided_budget(model, tok, base, stats, Guide(["math"], samples=4, pricing="output"), fisher_cache=cache)
    assert len(cache["level_costs"]) == solved and again.info["estimated_cost"] == out.info["estimated_cost"]
    rtn = guided_budget(model, tok, base, stats, Guide(["math"], samples=4, pricing="rtn"))
    assert rtn.info["pricing"] == "rtn" and rtn.info["estimated_cost"] != out.info["estimated_cost"]
    for al in (out, rtn):
        assert al.info["target_bits"] - 16 * 16 < al.info["allocated_bits"] <= al.info["target_bits"]
    with pytest.raises(BudgetError, match="valid pricings are output, rtn, wanda"):
        Guide(["math"], pricing="fisher")
    with pytest.raises(BudgetError, match="`pricing` applies to methods gptq, sparsegpt, not rtn"):
        guided_budget(model, tok, uniform_budget({"method": "rtn", "bits": 3}), stats,
                      Guide(["math"], samples=4, pricing="rtn"))
    with pytest.raises(BudgetError, match="`pricing` 'wanda' does not apply to gptq: valid for gptq are output, rtn"):
        guided_budget(model, tok, base, stats, Guide(["math"], samples=4, pricing="wanda"))


def test_guided_sparsegpt_pricing_output_or_wanda():
    """SparseGPT levels priced by SparseGPT's own output error (default) or Wanda's weight error:
    both fill the uniform size and price differently; the solved errors are cached per protected
    block (one head protected here), so a second allocation solves nothing."""
    model, tok = make_tiny_model("llama"), make_char_tokenizer()
    base = uniform_budget({"method": "sparsegpt", "density": 0.5})
    stats, _ = calibrate(model, tok, base, "math", 6)
    cache: dict = {}
    out = guided_budget(model, tok, base, stats, Guide(["math"], samples=4, protect_top_k=1), fisher_cache=cache)
    solved = len(cache["level_costs"])
    assert solved > 0 and out.info["pricing"] == "output"
    assert all(k[0] == "sparsegpt-output-error" for k in cache["level_costs"])
    again = guided_budget(model, tok, base, stats, Guide(["math"], samples=4, protect_top_k=1, pricing="output"),
                          fisher_cache=cache)
    assert len(cache["level_costs"]) == solved and again.info["estimated_cost"] == out.info["estimated_cost"]
    wanda = guided_budget(model, tok, base, stats, Guide(["math"], samples=4, protect_top_k=1, pricing="wanda"))
    assert wanda.info["pricing"] == "wanda" and wanda.info["estimated_cost"] != out.info["estimated_cost"]
    for al in (out, wanda):
        assert al.info["allocated_bits"] <= al.info["target_bits"]
    with pytest.raises(BudgetError, match="`pricing` 'rtn' does not apply to sparsegpt: valid for sparsegpt are output, wanda"):
        guided_budget(model, tok, base, stats, Guide(["math"], samples=4, pricing="rtn"))
    with pytest.raises(BudgetError, match="`pricing` applies to a Fisher, generic or flat sensitivity, not measured"):
        guided_budget(model, tok, base, stats, Guide(["math"], samples=4, sensitivity="measured", pricing="wanda"))

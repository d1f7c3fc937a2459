import json

import pytest

from capsense.core.arch import arch_spec, head_layout, out_projections
from capsense.errors import CapsenseError, HeadSpecError
from capsense.core.heads import Head, HeadSet, load_heads_file
from conftest import ARCHS, EXTRA_ARCHS, HEAD_DIM, N_HEADS, N_LAYERS, make_tiny_model, tiny_inputs


def test_layout_of_every_architecture(tiny_model):
    layout = head_layout(tiny_model)
    assert (layout.n_layers, layout.n_heads, layout.head_dim) == (N_LAYERS, N_HEADS, HEAD_DIM)
    assert len(out_projections(tiny_model)) == N_LAYERS


# Families whose modelling code assumes hidden_size == heads x head_dim (their q/k norms span hidden_size).
_HEAD_DIM_TIED = ("olmoe", "helium", "stablelm")


@pytest.mark.parametrize("arch", [a for a in EXTRA_ARCHS if a not in ARCHS])
def test_projection_input_is_the_heads_outputs_in_order(arch):
    """What capsense's ablation assumes, checked independently of capsense: the output projection's
    input is, slice by slice, head h's attention weights times its KV group's values (head order,
    GQA: 4 query heads on 2 KV heads), here with head_dim 24 apart from hidden_size / heads = 16."""
    import torch

    hd = HEAD_DIM if arch in _HEAD_DIM_TIED else 24
    model = make_tiny_model(arch, head_dim=hd)
    layout = head_layout(model)
    assert (layout.n_layers, layout.n_heads, layout.head_dim) == (N_LAYERS, N_HEADS, hd)
    attn = out_projections(model)[1]
    block_attn = model.get_submodule(f"{arch_spec(model).layers}.1.self_attn")
    seen = {}
    attn.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    block_attn.v_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("v", out))
    x = tiny_inputs(batch=2, seq=9)
    with torch.no_grad():
        weights = model(x, output_attentions=True).attentions[1]  # [batch, heads, query, key]
    n_kv = block_attn.v_proj.weight.shape[0] // hd
    assert n_kv == 2
    values = seen["v"].reshape(2, 9, n_kv, hd)
    per_head = [weights[:, h] @ values[:, :, h // (N_HEADS // n_kv)] for h in range(N_HEADS)]
    assert torch.allclose(torch.cat(per_head, dim=-1), seen["x"], atol=1e-6)


def test_unknown_architecture_names_supported_ones():
    import transformers as T

    model = T.AutoModelForCausalLM.from_config(
        T.OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=64)
    )
    with pytest.raises(CapsenseError, match=r"unsupported architecture 'opt'.*gpt2.*llama.*mixtral.*qwen3_moe"):
        arch_spec(model)


@pytest.mark.parametrize(
    "model_type,why",
    [("deepseek_v3", "multi-head latent attention"), ("deepseek_v2", "multi-head latent attention"),
     ("qwen3_next", "hybrid model"), ("falcon", "query_key_value")],
)
def test_known_misfits_say_why(model_type, why):
    """Families whose attention does not fit get the reason, not the generic list alone."""
    import torch
    import transformers as T

    cfg = T.AutoConfig.for_model(model_type, vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(CapsenseError, match=rf"unsupported architecture '{model_type}': .*{why}.*capsense supports .*llama"):
        arch_spec(model)


def test_supported_and_misfit_families_are_disjoint_and_all_exist():
    """Every listed model_type is one transformers knows (a typo would never match a model)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    from capsense.core.arch import ARCHITECTURES, UNSUPPORTED

    assert not set(ARCHITECTURES) & set(UNSUPPORTED)
    assert set(ARCHITECTURES) | set(UNSUPPORTED) <= set(CONFIG_MAPPING_NAMES)


@pytest.mark.parametrize(
    "spec",
    ["L16H21+L15H13", "[L16H21,L15H13]", " l16h21 + L15H13 ", "L16H21,L15H13", [(16, 21), (15, 13)], ["L16H21", "L15H13"]],
)
def test_parse_forms(spec):
    assert list(HeadSet.parse(spec)) == [Head(16, 21), Head(15, 13)]


def test_single_head_and_dedup_and_top_k():
    assert list(HeadSet.parse("L3H1")) == [Head(3, 1)]
    assert list(HeadSet.parse("L3H1+L3H1+L2H0")) == [Head(3, 1), Head(2, 0)]
    assert list(HeadSet.parse("L3H1+L2H0+L1H1", top_k=2)) == [Head(3, 1), Head(2, 0)]
    assert str(HeadSet.parse("[L3H1, L2H0]")) == "L3H1+L2H0"


@pytest.mark.parametrize("bad", ["L16", "H3", "L1H2+foo", "[L1H2", "L-1H2", "L1.5H2"])
def test_malformed_specs(bad):
    with pytest.raises(HeadSpecError, match="malformed head"):
        HeadSet.parse(bad)


def test_bad_pairs():
    with pytest.raises(HeadSpecError, match="pair of integers"):
        HeadSet.parse([(1, "x")])


def test_validate_names_valid_range():
    from capsense.core.arch import HeadLayout

    layout = HeadLayout(30, 9, 64)
    with pytest.raises(HeadSpecError, match=r"layer 40 out of range in L40H1: this model has 30 layers \(0-29\)"):
        HeadSet.parse("L40H1").check_fits(layout)
    with pytest.raises(HeadSpecError, match=r"head 9 out of range in L3H9: this model has 9 heads per layer \(0-8\)"):
        HeadSet.parse("L3H9").check_fits(layout)
    assert len(HeadSet.parse("L29H8").check_fits(layout)) == 1


def test_heads_file_roundtrip_and_errors(tmp_path):
    p = tmp_path / "heads.json"
    p.write_text(json.dumps({"model": "m", "task": "t", "heads": [
        {"layer": 2, "head": 1, "importance": 0.9}, {"layer": 0, "head": 3, "importance": None}]}))
    hf = load_heads_file(p)
    assert hf.model == "m" and hf.meta["task"] == "t"
    assert list(HeadSet.parse(str(p))) == [Head(2, 1), Head(0, 3)]
    assert list(HeadSet.parse(p, top_k=1)) == [Head(2, 1)]

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(HeadSpecError, match="not valid JSON"):
        HeadSet.parse(str(bad))
    bad.write_text(json.dumps({"heads": [{"layer": "x", "head": 1}]}))
    with pytest.raises(HeadSpecError, match="integer 'layer' and 'head'"):
        HeadSet.parse(str(bad))
    with pytest.raises(HeadSpecError, match="not found"):
        HeadSet.parse(str(tmp_path / "missing.json"))


def test_named_is_a_spec_or_none():
    """What the card and validate read where a spec may or may not be (one function since round 52)."""
    assert HeadSet.named("L1H2+L0H3") == HeadSet.from_pairs([(1, 2), (0, 3)])
    assert HeadSet.named(["L1H2", (0, 3)]) == HeadSet.from_pairs([(1, 2), (0, 3)])
    for not_a_spec in (None, "", "[]", "runs/x/heads", "the set", 5, [(1, "x")]):
        assert HeadSet.named(not_a_spec) is None, not_a_spec

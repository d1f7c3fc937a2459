import json

import pytest

from capsense.core.arch import arch_spec, head_layout, out_projections
from capsense.errors import CapsenseError, HeadSpecError
from capsense.core.heads import Head, HeadSet, load_heads_file
from conftest import HEAD_DIM, N_HEADS, N_LAYERS, make_tiny_model


def test_layout_of_every_architecture(tiny_model):
    layout = head_layout(tiny_model)
    assert (layout.n_layers, layout.n_heads, layout.head_dim) == (N_LAYERS, N_HEADS, HEAD_DIM)
    assert len(out_projections(tiny_model)) == N_LAYERS


def test_unknown_architecture_names_supported_ones():
    import transformers as T

    model = T.AutoModelForCausalLM.from_config(
        T.OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=64)
    )
    with pytest.raises(CapsenseError, match=r"unsupported architecture 'opt'.*gpt2.*llama.*qwen3"):
        arch_spec(model)


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

"""Compression on mixture-of-experts models: the experts' fused 3-D weights are not linear layers,
so MLP targets are refused with one clear error naming `targets` attn; attention compresses."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from capsense.compress.targets import find_targets
from capsense.errors import BudgetError
from conftest import MOE_ARCHS, make_tiny_model, save_tiny_folder

REFUSAL = r"compressing the MLP of a mixture-of-experts model \({}\) is not supported.*Valid: `targets` attn"


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    return save_tiny_folder("mixtral", tmp_path_factory.mktemp("tiny-mixtral"))


def test_moe_mlp_refused_before_the_weights_load(mixtral_dir, tmp_path, monkeypatch):
    from capsense.compress.request import compress_request

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(T.AutoModelForCausalLM, "from_pretrained", no_load)
    for targets in (None, "mlp", "attn,mlp"):
        with pytest.raises(BudgetError, match=REFUSAL.format("mixtral")):
            compress_request(str(mixtral_dir), tmp_path / "out", {"method": "rtn", "bits": 4}, targets=targets)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_find_targets_refuses_moe_mlp_and_finds_attention(arch):
    model = make_tiny_model(arch)
    with pytest.raises(BudgetError, match=REFUSAL.format(arch)):
        find_targets(model)
    attn = find_targets(model, "attn")
    assert {t.short for t in attn} == {"q_proj", "k_proj", "v_proj", "o_proj"} and len(attn) == 12


def test_experts_found_by_structure_whatever_the_model_type():
    """A model_type not in MOE_FAMILIES whose blocks hold `experts` is refused all the same."""
    model = make_tiny_model("qwen2_moe")
    model.config.model_type = "qwen2"  # laid out as Llama: arch_spec accepts it
    with pytest.raises(BudgetError, match=REFUSAL.format("qwen2")):
        find_targets(model, "mlp")


def test_moe_attention_compresses_and_experts_stay(mixtral_dir, tmp_path):
    from capsense.compress.request import compress_request

    result = compress_request(str(mixtral_dir), tmp_path / "out", {"method": "magnitude", "density": 0.5}, targets="attn")
    assert result.budget["targets"] == ["attn"]
    before = T.AutoModelForCausalLM.from_pretrained(mixtral_dir).state_dict()
    after = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    experts = [k for k in before if ".experts." in k]
    assert experts and all(torch.equal(before[k], after[k]) for k in experts)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (after[q] == 0).float().mean().item() == pytest.approx(0.5, abs=0.01)


def test_moe_attention_sequential_equals_one_pass_and_counts_the_experts(mixtral_dir, tmp_path):
    """`sequential` (one decoder layer at a time: what a 70B MoE needs) runs the MoE blocks on the cached
    inputs and writes the one-pass checkpoint bit for bit; the size accounting counts the experts."""
    import glob

    from safetensors.torch import load_file

    from capsense.compress.request import compress_request

    setting = {"method": "gptq", "bits": 4}
    one = compress_request(str(mixtral_dir), tmp_path / "one", setting, targets="attn", calibration_samples=4)
    seq = compress_request(str(mixtral_dir), tmp_path / "seq", setting, targets="attn", calibration_samples=4,
                           sequential=True)
    tensors = [{k: v for f in glob.glob(str(tmp_path / d / "*.safetensors")) for k, v in load_file(f).items()}
               for d in ("one", "seq")]
    assert tensors[0].keys() == tensors[1].keys() and all(torch.equal(tensors[0][k], tensors[1][k]) for k in tensors[0])
    model = T.AutoModelForCausalLM.from_pretrained(mixtral_dir)
    assert one.summary == seq.summary and one.summary["model_params"] == sum(p.numel() for p in model.parameters())


def test_distillation_of_a_moe_student_trains_its_attention():
    """distill has no `targets`: on a mixture-of-experts student it restores the attention projections
    (the only matrices compression could have changed there) instead of failing on the refusal."""
    from capsense.compress.distill import _trainable

    model = make_tiny_model("mixtral")
    params, masks = _trainable(model)
    attn = {id(t.module.weight) for t in find_targets(model, "attn")}
    assert len(params) == len(masks) == 12 and {id(p) for p in params} == attn
    assert {id(p) for p in model.parameters() if p.requires_grad} == attn


def test_grid_on_a_moe_model_measures_attention_and_refuses_mlp(mixtral_dir, tmp_path):
    """`capsense grid --targets attn` runs on a mixture-of-experts model (the grid's own target set is
    the kinds its settings name); without it, the one clear refusal."""
    import json

    from click.testing import CliRunner

    from capsense.cli import main

    args = ["grid", str(mixtral_dir), "--methods", "magnitude", "--densities", "0.5", "--capabilities", "qa",
            "--probes", 2, "--no-progress"]  # (magnitude reads no calibration)
    r = CliRunner().invoke(main, [str(a) for a in args + ["--targets", "attn", "--out", tmp_path / "g.jsonl"]])
    assert r.exit_code == 0, r.output
    recs = [json.loads(x) for x in (tmp_path / "g.jsonl").read_text().splitlines()]
    assert [x["label"] for x in recs] == ["dense", "magnitude@d0.5"] and recs[1]["targets"] == "attn"
    r = CliRunner().invoke(main, [str(a) for a in args + ["--out", tmp_path / "h.jsonl"]])
    assert r.exit_code == 1 and "mixture-of-experts model (mixtral) is not supported" in r.output

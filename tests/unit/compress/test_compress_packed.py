"""compressed-tensors checkpoints: exact round trip through stock transformers, size on disk, refusals."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from capsense.compress.engine import compress_model
from capsense.compress.budget import uniform_budget
from capsense.compress.gptq import gptq_quantize
from capsense.compress.methods import PruneSetting, QuantSetting
from capsense.compress.packed import PackedWeight, check_storable, size_on_disk, write_packed
from capsense.errors import CapsenseError
from capsense.compress.quantize import group_scales
from capsense.compress.targets import find_targets
from conftest import make_tiny_model, tiny_inputs

pytest.importorskip("compressed_tensors")


def _nll(model, ids):
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")


def _mixed(model):
    """GPTQ 3-bit g16 on the MLP, RTN 4-bit per row on attention: the packed record of each matrix."""
    packed, g = {}, torch.Generator().manual_seed(0)
    for t in find_targets(model):
        w = t.get()
        if t.kind == "mlp":
            x = torch.randn(256, w.shape[1], generator=g) * torch.rand(w.shape[1], generator=g) * 3
            new, scales = gptq_quantize(w, (x.T @ x).double(), 3, 16)
            packed[t.name] = PackedWeight(3, 16, scales)
        else:
            new = QuantSetting("rtn", 4, 0).apply(t.name, w, None, None, 16).weight
            packed[t.name] = PackedWeight(4, 0, group_scales(new, 4, 0))
        t.set(new)
    return packed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mixed_checkpoint_reloads_exactly_with_stock_transformers(tmp_path, dtype):
    model = make_tiny_model("llama", tie_word_embeddings=True)
    packed = _mixed(model)
    info = write_packed(model, packed, tmp_path, dtype=dtype)
    assert {(g["bits"], g["group_size"]) for g in info["groups"]} == {(3, 16), (4, 0)}
    loaded = T.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert loaded.dtype == dtype
    ref = model
    for p in ref.parameters():  # the parameters at the checkpoint's dtype (buffers such as RoPE's stay float32)
        p.data = p.data.to(dtype)
    ids = tiny_inputs()
    assert float((_nll(ref, ids) - _nll(loaded, ids)).abs().max()) <= 1e-6
    for t in find_targets(ref):  # the dequantized weights are the in-memory ones, bit for bit
        assert torch.equal(dict(loaded.named_modules())[t.name].weight, t.get())


def test_packed_size_on_disk_matches_the_accounted_size(tmp_path):
    model = make_tiny_model("llama", hidden_size=256, intermediate_size=512, tie_word_embeddings=True)
    result = compress_model(model, uniform_budget({"method": "rtn", "bits": 4, "group_size": 32}))
    # RTN's max|w| maps to q_max exactly, so its scales are recovered from the compressed weights
    packed = {t.name: PackedWeight(4, 32, group_scales(t.get(), 4, 32)) for t in find_targets(model)}
    write_packed(model, packed, tmp_path)
    accounted = result.summary["size_ratio"] * result.summary["model_params"] * 16 / 8
    on_disk = size_on_disk(tmp_path)
    assert abs(on_disk / accounted - 1) < 0.10, (on_disk, accounted)
    dense = sum(p.numel() for p in model.parameters()) * 2
    assert on_disk < 0.5 * dense  # really packed, not fake-quantized floats


def test_what_the_format_cannot_store_is_refused_with_the_remedy():
    q = lambda bits, g: QuantSetting("rtn", bits, g)  # noqa: E731
    check_storable([("a", (8, 64), q(4, 32), False, True), ("b", (8, 64), None, False, True), ("c", (8, 64), q(8, 0), False, True)])
    with pytest.raises(CapsenseError, match=r"cannot store a: 12-bit codes: packed codes are 1 to 8 bits"):
        check_storable([("a", (8, 64), q(12, 32), False, True)])
    with pytest.raises(CapsenseError, match=r"cannot store a \(and 1 more\): group size 128 on 576 .*\(64, 32, 16, 0\)"):
        check_storable([("a", (8, 576), q(4, 128), False, True), ("b", (8, 576), q(4, 128), False, True)])
    with pytest.raises(CapsenseError, match="no sparse storage.*`fmt` dense"):
        check_storable([("a", (8, 64), PruneSetting("wanda", 0.5), False, True)])
    with pytest.raises(CapsenseError, match="protect no heads"):
        check_storable([("a", (8, 64), q(4, 32), True, True)])
    with pytest.raises(CapsenseError, match="Conv1D"):
        check_storable([("a", (8, 64), q(4, 32), False, False)])


def test_a_packed_checkpoint_is_evaluated_and_measured_without_library_bars(tmp_path, tiny_model_dir):
    """`capsense evaluate` of a packed checkpoint failed ("'Linear' object has no attribute 'weight'"): capsense's
    scoring runs the model's body, and compressed-tensors unpacks only at the first call of the whole model. The
    capsense-masked model now unpacks it as load_model does (the same logits as stock transformers' own forward),
    and a load shows none of compressed-tensors' three bars under --no-progress."""
    from click.testing import CliRunner

    from capsense.cli import main
    from capsense.core.models import load_model
    from capsense.evaluation.lm_eval_model import CapsenseMaskedLM

    out = tmp_path / "packed"
    r = CliRunner().invoke(main, ["compress", str(tiny_model_dir), "--method", "rtn", "--bits", "4", "--group-size",
                                  "16", "--no-progress", "--out", str(out)])
    assert r.exit_code == 0 and (out / "config.json").read_text().count("compressed-tensors") == 1, r.output
    r = CliRunner().invoke(main, ["evaluate", str(out), "--tasks", "capsense_addition", "--limit", "4", "--heads",
                                  "L0H1", "--no-progress"])
    assert r.exit_code == 0 and "| capsense_addition | acc |" in r.stdout, r.output
    assert "You passed `quantization_config`" not in r.stderr, r.stderr
    lm = CapsenseMaskedLM(pretrained=str(out), device="cpu", batch_size=2)
    ours, _ = load_model(str(out), dtype=str(lm.model.dtype).removeprefix("torch."))
    plain = T.AutoModelForCausalLM.from_pretrained(out, dtype=lm.model.dtype).eval()
    ids = tiny_inputs()
    with torch.no_grad():
        assert torch.equal(lm.model(input_ids=ids).logits, plain(input_ids=ids).logits)
        assert torch.equal(ours(input_ids=ids).logits, plain(input_ids=ids).logits)
    r = CliRunner().invoke(main, ["measure", str(out), "--capabilities", "qa", "--probes", "2", "--no-progress"])
    assert r.exit_code == 0, r.output
    for bar in ("Applying quantization config", "Compressing model", "Decompressing model", "Dispatching model"):
        assert bar not in r.stderr, r.stderr


def test_an_edited_packed_model_is_saved_as_a_plain_checkpoint(tmp_path, tiny_model_dir):
    """A packed checkpoint loads as a plain dense model (its scales and quantization config gone), so what capsense
    saves after editing it is a plain checkpoint: an export of it was written with the stale scales beside the
    zeroed weights and a config still saying pack-quantized. The export reproduces the ablated logits in stock
    transformers."""
    import json

    from click.testing import CliRunner
    from safetensors import safe_open

    from capsense.cli import main
    from capsense.core.ablation import HeadAblator
    from capsense.core.models import load_model

    packed = tmp_path / "packed"
    r = CliRunner().invoke(main, ["compress", str(tiny_model_dir), "--method", "rtn", "--bits", "4", "--group-size",
                                  "16", "--no-progress", "--out", str(packed)])
    assert r.exit_code == 0, r.output
    model, _ = load_model(str(packed), dtype="bfloat16")
    assert not hasattr(model.config, "quantization_config") and getattr(model, "hf_quantizer", None) is None
    assert {n.rsplit(".", 1)[-1] for n, _ in model.named_parameters()} <= {"weight", "bias"}
    r = CliRunner().invoke(main, ["export", str(packed), "--heads", "L0H1", "--format", "checkpoint", "--out",
                                  str(tmp_path / "ex")])
    assert r.exit_code == 0, r.output
    assert "quantization_config" not in json.loads((tmp_path / "ex" / "config.json").read_text())
    with safe_open(tmp_path / "ex" / "model.safetensors", "pt") as f:
        assert not [k for k in f.keys() if k.endswith(("weight_scale", "weight_shape", "weight_packed"))]
    ids = tiny_inputs()
    with torch.no_grad(), HeadAblator(model).apply("L0H1"):
        ablated = model(input_ids=ids).logits
    plain = T.AutoModelForCausalLM.from_pretrained(tmp_path / "ex").eval()
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, ablated)


def test_a_mean_ablation_adapter_on_a_packed_model_is_refused(tmp_path, tiny_model_dir):
    """Stock PEFT cannot put the mean-ablation LoRA on a packed base ("'Linear' object has no attribute 'weight'" at
    its load, checked), so capsense no longer ships one: refused before anything loads, naming what works. The
    zero-ablation IA3 adapter loads on the packed base in stock PEFT and reproduces capsense's ablation exactly."""
    from click.testing import CliRunner
    from peft import PeftModel

    from capsense.cli import main
    from capsense.core.ablation import HeadAblator
    from capsense.core.models import load_model

    packed = tmp_path / "packed"
    r = CliRunner().invoke(main, ["compress", str(tiny_model_dir), "--method", "rtn", "--bits", "4", "--group-size",
                                  "16", "--no-progress", "--out", str(packed)])
    assert r.exit_code == 0, r.output
    base = ["export", str(packed), "--heads", "L0H1", "--format", "adapter"]
    r = CliRunner().invoke(main, [*base, "--ablation", "mean", "--out", str(tmp_path / "mean")])
    assert r.exit_code == 1 and "stock PEFT cannot put one on a packed compressed-tensors model" in r.output, r.output
    assert "--format checkpoint" in r.output and not (tmp_path / "mean").exists()
    r = CliRunner().invoke(main, [*base, "--out", str(tmp_path / "zero")])
    assert r.exit_code == 0, r.output
    ours, _ = load_model(str(packed), dtype="bfloat16")
    ids = tiny_inputs()
    with torch.no_grad(), HeadAblator(ours).apply("L0H1"):
        ablated = ours(input_ids=ids).logits
    stock = PeftModel.from_pretrained(T.AutoModelForCausalLM.from_pretrained(packed).eval(), tmp_path / "zero").eval()
    with torch.no_grad():
        assert torch.equal(stock(input_ids=ids).logits, ablated)

"""capsense export: edited checkpoints and IA3 mask adapters equal the hook ablation."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers as T
from click.testing import CliRunner
from safetensors import safe_open

from capsense.core.ablation import ABLATION_MODES, HeadAblator, compute_head_means
from capsense.ship.export import export_adapter, export_checkpoint
from capsense.errors import CapsenseError, HeadSpecError, OutputExistsError
from capsense.core.files import atomic_output_dir
from conftest import EXTRA_ARCHS, HEAD_DIM, N_HEADS, save_tiny_folder, tiny_inputs

HEADS = "L0H1+L2H0+L2H3"  # three heads in two layers (layer 1 untouched)
EDITED_LAYERS = 2
TOL = 1e-5
MEAN_TEXTS = ["The library opens at nine.", "Rain fell on the quiet town all night.", "2 + 2 = 4"]  # mean ablation's reference

_FOLDERS: dict[tuple, Path] = {}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny base model folders, saved once per (arch, overrides) for the whole module."""

    def get(arch: str, **overrides) -> Path:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in _FOLDERS:
            path = tmp_path_factory.mktemp(f"base-{arch}")
            _FOLDERS[key] = save_tiny_folder(arch, path, **overrides)
        return _FOLDERS[key]

    yield get
    _FOLDERS.clear()


def _load(path) -> T.PreTrainedModel:
    return T.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _nothing_at(out: Path) -> bool:
    """``out`` does not exist and no temporary sibling was left behind."""
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    return not out.exists() and not leftovers


def test_checkpoint_and_adapter_equal_hook_ablation(arch, folders, tmp_path):
    _check_exports_equal_hook_ablation(arch, folders, tmp_path)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "granitemoe", "gpt_oss", "gemma", "cohere", "phi"])
def test_exports_of_more_families(arch, folders, tmp_path):
    """Families outside ``ARCHS``: four mixture-of-experts (Mixtral, Qwen3-MoE, gpt-oss, GraniteMoE: experts
    under ``block_sparse_moe``) and three dense (Gemma 1; Cohere, no post-attention norm; Phi-2,
    whose projection is ``dense``): the checkpoint reloaded by plain transformers and the adapter
    reproduce the hook's ablated logits."""
    assert arch in EXTRA_ARCHS
    _check_exports_equal_hook_ablation(arch, folders, tmp_path)


def _check_exports_equal_hook_ablation(arch, folders, tmp_path):
    from peft import PeftModel

    base_dir = folders(arch)
    ckpt = export_checkpoint(str(base_dir), HEADS, tmp_path / "ckpt")
    adapter = export_adapter(str(base_dir), HEADS, tmp_path / "adapter")
    assert {"model.safetensors", "config.json", "tokenizer.json", "capsense.json", "README.md"} <= set(ckpt.files)
    assert {"adapter_model.safetensors", "adapter_config.json", "capsense.json", "README.md"} <= set(adapter.files)

    base = _load(base_dir)
    x = tiny_inputs()
    with torch.no_grad():
        plain = base(x).logits
        with HeadAblator(base).apply(HEADS):
            expected = base(x).logits
        from_ckpt = _load(ckpt.out)(x).logits
        peft_model = PeftModel.from_pretrained(base, adapter.out).eval()
        unmerged = peft_model(x).logits
        merged_model = peft_model.merge_and_unload()
        merged = merged_model(x).logits

    assert _maxdiff(plain, expected) > 1e-3  # the heads matter, so equality below means something
    assert _maxdiff(from_ckpt, expected) <= TOL
    assert _maxdiff(unmerged, expected) <= TOL
    assert _maxdiff(merged, expected) <= TOL
    # merge_and_unload gives the checkpoint, tensor for tensor
    ckpt_state = _load(ckpt.out).state_dict()
    merged_state = merged_model.state_dict()
    assert set(ckpt_state) == set(merged_state)
    for name, tensor in ckpt_state.items():
        assert torch.equal(tensor, merged_state[name]), name


def test_adapter_is_one_vector_per_edited_layer(folders, tmp_path):
    for arch in ("llama", "gpt2"):
        result = export_adapter(str(folders(arch)), HEADS, tmp_path / arch)
        path = result.out / "adapter_model.safetensors"
        with safe_open(path, "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        width = N_HEADS * HEAD_DIM
        assert len(tensors) == EDITED_LAYERS
        assert all(t.shape == (1, width) and t.dtype == torch.float32 for t in tensors.values())
        data_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        assert data_bytes == EDITED_LAYERS * width * 4 == 512
        assert path.stat().st_size <= data_bytes + 1024  # plus the safetensors JSON header
        # 0 exactly on the ablated heads' slices, 1 elsewhere
        vec = next(t for k, t in tensors.items() if ".2." in k)[0]
        zero = torch.zeros(width, dtype=torch.bool)
        zero[0:HEAD_DIM] = zero[3 * HEAD_DIM : 4 * HEAD_DIM] = True
        assert torch.all(vec[zero] == 0) and torch.all(vec[~zero] == 1)
        cfg = json.loads((result.out / "adapter_config.json").read_text())
        assert cfg["peft_type"] == "IA3" and cfg["task_type"] == "CAUSAL_LM"
        assert sorted(cfg["target_modules"]) == sorted(cfg["feedforward_modules"])
        assert len(cfg["target_modules"]) == EDITED_LAYERS
        assert cfg["fan_in_fan_out"] is (arch == "gpt2")


def test_bf16_adapter_vectors_when_asked(folders, tmp_path):
    result = export_adapter(str(folders("llama")), HEADS, tmp_path / "a", dtype="bfloat16")
    with safe_open(result.out / "adapter_model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


def _mean_reference(tmp_path) -> Path:
    reference = tmp_path / "reference.txt"
    reference.write_text("\n".join(MEAN_TEXTS) + "\n")
    return reference


def _hook_logits(base_dir) -> tuple[T.PreTrainedModel, torch.Tensor, torch.Tensor]:
    """The base model, the test inputs and the hook's mean-ablated logits on them, checked to differ from zero
    ablation's (the means over
    :data:`MEAN_TEXTS` with the folder's own tokenizer, as the exports and capsense-masked read it: for the tiny
    Qwen2 folder it is not the character tokenizer the folder was saved from, and the means differ by 0.09)."""
    base, x = _load(base_dir), tiny_inputs()
    means = compute_head_means(base, T.AutoTokenizer.from_pretrained(base_dir), MEAN_TEXTS)
    with torch.no_grad():
        with HeadAblator(base, "zero").apply(HEADS):
            zeroed = base(x).logits
        with HeadAblator(base, "mean", means).apply(HEADS):
            expected = base(x).logits
    assert _maxdiff(expected, zeroed) > 1e-4  # mean differs from zero ablation here
    return base, x, expected


@pytest.mark.parametrize(
    "arch,overrides",
    [("gpt2", {}), ("gpt_neox", {}), ("llama", {"attention_bias": True}), ("qwen3", {"attention_bias": True}),
     ("phi", {}), ("qwen3_moe", {"attention_bias": True}),
     # attention_bias off: the export turns it on (zero q/k/v/o biases beside the folded means)
     ("llama", {}), ("qwen3", {}), ("gemma", {}), ("gemma3_text", {}), ("olmo2", {})],
)
def test_mean_ablation_folds_into_bias(arch, overrides, folders, tmp_path):
    base_dir = folders(arch, **overrides)
    reference = _mean_reference(tmp_path)
    result = export_checkpoint(str(base_dir), HEADS, tmp_path / "mean", ablation="mean", mean_reference=reference)
    assert result.metadata["ablation"] == "mean" and result.metadata["mean_reference"] == reference.name  # no path of this machine
    _, x, expected = _hook_logits(base_dir)
    with torch.no_grad():
        got = _load(result.out)(x).logits
    assert _maxdiff(got, expected) <= TOL
    if not overrides.get("attention_bias", True):
        config = json.loads((result.out / "config.json").read_text())
        assert config["attention_bias"] is True
        with safe_open(result.out / "model.safetensors", "pt") as f:
            q = [k for k in f.keys() if k.endswith("q_proj.bias")]
            assert len(q) == 3 and all(not f.get_tensor(k).any() for k in q)  # added, and zero
        assert result.metadata["attention_biases_added"] > 0
        assert "`config.attention_bias` is turned on" in (result.out / "README.md").read_text()


def test_bf16_mean_checkpoint_card_says_the_means_are_rounded(folders, tmp_path):
    """A mean fold in a bf16 checkpoint stores the means rounded to bf16 (round 34 on an H100: 0.117 on logits in
    bf16); the card says so, and a float32 export's does not."""
    base_dir = folders("llama", attention_bias=True)
    bf16 = export_checkpoint(str(base_dir), HEADS, tmp_path / "b", ablation="mean", dtype="bfloat16")
    f32 = export_checkpoint(str(base_dir), HEADS, tmp_path / "f", ablation="mean", dtype="float32")
    assert "stored in bfloat16" in (bf16.out / "README.md").read_text()
    assert "stored in" not in (f32.out / "README.md").read_text()


@pytest.mark.parametrize("arch,support", [
    ("mistral", "never"), ("qwen2", "never"), ("phi3", "never"), ("mixtral", "never"),
])
def test_mean_ablation_refused_without_bias(arch, support, folders, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(CapsenseError, match=f"has no bias .*{arch}: {support}") as e:
        export_checkpoint(str(folders(arch)), HEADS, out, ablation="mean")
    assert "`ablation` zero" in str(e.value) and "capsense-masked" in str(e.value)  # the CLI shows --ablation
    assert _nothing_at(out)


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}), ("gpt2", {}), ("mistral", {}), ("qwen2", {}), ("mixtral", {}), ("llama", {"attention_bias": True}),
])
def test_mean_adapter_equals_hook_mean_ablation(arch, overrides, folders, tmp_path):
    """Mean ablation as a LoRA with a bias (B = -W[:, S], bias = W[:, S] @ mean[S]), loaded by stock PEFT:
    the hook's mean-ablated logits, on families whose checkpoint cannot carry the means (Mistral, Qwen2,
    Mixtral: no attention bias to switch on) and on GPT-2's transposed Conv1D."""
    from peft import PeftModel

    base_dir = folders(arch, **overrides)
    reference = _mean_reference(tmp_path)
    result = export_adapter(str(base_dir), HEADS, tmp_path / "mean", ablation="mean", mean_reference=reference)
    assert result.metadata["ablation"] == "mean" and result.metadata["mean_reference"] == reference.name
    cfg = json.loads((result.out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["lora_bias"] and len(cfg["target_modules"]) == EDITED_LAYERS
    assert sorted(cfg["rank_pattern"].values()) == [HEAD_DIM, 2 * HEAD_DIM] == sorted(cfg["alpha_pattern"].values())
    base, x, expected = _hook_logits(base_dir)
    with torch.no_grad():
        got = PeftModel.from_pretrained(base, result.out).eval()(x).logits
    assert _maxdiff(got, expected) <= TOL
    card = (result.out / "README.md").read_text()
    assert "LoRA" in card and "replaced by its mean" in card


def test_sharded_bf16_checkpoint(folders, tmp_path):
    base_dir = folders("qwen2")
    result = export_checkpoint(str(base_dir), HEADS, tmp_path / "c", dtype="bfloat16", max_shard_size="40KB")
    shards = [f for f in result.files if f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in result.files
    assert result.metadata["torch_dtype"] == "bfloat16"
    exported = _load(result.out)
    assert {p.dtype for p in exported.parameters()} == {torch.bfloat16}
    base = T.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16, attn_implementation="eager").eval()
    x = tiny_inputs()
    with torch.no_grad():
        with HeadAblator(base).apply(HEADS):
            expected = base(x).logits
        assert _maxdiff(exported(x).logits, expected) <= TOL


def test_bad_heads_and_existing_output(folders, tmp_path):
    base_dir = str(folders("llama"))
    out = tmp_path / "out"
    with pytest.raises(HeadSpecError, match="layer 7 out of range in L7H0: this model has 3 layers"):
        export_checkpoint(base_dir, "L0H1+L7H0", out)
    with pytest.raises(HeadSpecError, match="head 4 out of range"):
        export_adapter(base_dir, "L1H4", out)
    assert _nothing_at(out)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(HeadSpecError, match="not valid JSON"):
        export_checkpoint(base_dir, str(bad), out)
    with pytest.raises(HeadSpecError, match="not found"):
        export_checkpoint(base_dir, str(tmp_path / "missing.json"), out)
    assert _nothing_at(out)

    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="not empty.*`overwrite`"):
        export_checkpoint(base_dir, HEADS, out)
    assert (out / "keep.txt").read_text() == "mine"
    result = export_adapter(base_dir, HEADS, out, overwrite=True)
    assert not (out / "keep.txt").exists() and "adapter_config.json" in result.files
    assert _nothing_at(tmp_path / "elsewhere")  # and no .out.old-* / .out.tmp-* left over
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_failed_save_leaves_nothing(folders, tmp_path, monkeypatch):
    import capsense.ship.checkpoint as ex

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(ex, "write_card_and_metadata", boom)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="disk full"):
        export_checkpoint(str(folders("llama")), HEADS, out)
    assert _nothing_at(out)


def test_atomic_output_dir_keeps_old_folder_on_failure(tmp_path):
    out = tmp_path / "d"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_output_dir(out, overwrite=True) as tmp:
            (tmp / "new.txt").write_text("new")
            raise KeyboardInterrupt
    assert [p.name for p in tmp_path.iterdir()] == ["d"] and (out / "old.txt").exists()
    import tempfile

    umask = os.umask(0o022)
    try:
        with atomic_output_dir(out, overwrite=True) as tmp:
            (tmp / "new.txt").write_text("new")
            fd, private = tempfile.mkstemp(dir=tmp)  # as safetensors writes its files
            os.close(fd)
    finally:
        os.umask(umask)
    assert sorted(p.name for p in out.iterdir()) == sorted(["new.txt", Path(private).name])
    assert [p.name for p in tmp_path.iterdir()] == ["d"]
    assert (out.stat().st_mode & 0o777) == 0o755
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o644}


def test_checkpoint_loads_once_adapter_loads_no_weights(folders, tmp_path, monkeypatch):
    calls = []
    original = T.AutoModelForCausalLM.from_pretrained.__func__

    def counting(cls, *args, **kwargs):
        calls.append(args[0])
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(T.AutoModelForCausalLM, "from_pretrained", classmethod(counting))
    base_dir = str(folders("llama"))
    export_adapter(base_dir, HEADS, tmp_path / "a")
    assert calls == []
    export_checkpoint(base_dir, HEADS, tmp_path / "c")
    assert len(calls) == 1


def test_heads_file_top_k_importance_and_validation(folders, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    heads_file = run / "heads.json"
    heads_file.write_text(json.dumps({"model": "tiny", "heads": [
        {"layer": 2, "head": 3, "importance": 0.9}, {"layer": 0, "head": 1, "importance": 0.25},
        {"layer": 1, "head": 0, "importance": 0.01}]}))
    (run / "validation.json").write_text(json.dumps(
        [{"task": "capsense_arithmetic", "base": 0.8, "ablated": 0.1}, {"task": "capsense_prose", "base": 0.5, "ablated": 0.49}]))
    result = export_checkpoint(str(folders("llama")), str(heads_file), tmp_path / "out", top_k=2)
    meta = json.loads((result.out / "capsense.json").read_text())
    assert meta["heads_spec"] == "L2H3+L0H1"
    assert meta["heads"] == [{"layer": 2, "head": 3, "importance": 0.9}, {"layer": 0, "head": 1, "importance": 0.25}]
    assert meta["heads_source"] == {"file": "heads.json", "top_k": 2, "model": "tiny"}  # no path of this machine
    assert meta["base_model"]["content_sha256"] and meta["capsense_version"]
    assert "--heads L2H3+L0H1 --format checkpoint" in meta["command"]
    card = (result.out / "README.md").read_text()
    assert "| 2 | 3 | 0.9 |" in card and "| capsense_arithmetic | 0.8 | 0.1 |" in card


def test_capsense_masked_equals_hf_checkpoint_and_peft(folders, tmp_path):
    """lm-eval's own ``hf`` model on the exports == ``capsense-masked`` on the base."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from capsense.evaluation.lm_eval_model import CapsenseMaskedLM

    base_dir = str(folders("llama"))
    ckpt = export_checkpoint(base_dir, HEADS, tmp_path / "ckpt").out
    adapter = export_adapter(base_dir, HEADS, tmp_path / "adapter").out
    pairs = [("2+3=", "5"), ("The cat sat on the ", "mat."), ("abc", "def"), ("Hello", ", world")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    common = dict(device="cpu", batch_size=2, dtype="float32")
    masked = CapsenseMaskedLM(pretrained=base_dir, heads=HEADS, **common).loglikelihood(requests)
    plain = HFLM(pretrained=base_dir, **common).loglikelihood(requests)
    from_ckpt = HFLM(pretrained=str(ckpt), **common).loglikelihood(requests)
    from_peft = HFLM(pretrained=base_dir, peft=str(adapter), **common).loglikelihood(requests)
    assert max(abs(a[0] - b[0]) for a, b in zip(masked, plain)) > 1e-3
    for got in (from_ckpt, from_peft):
        assert all(abs(a[0] - b[0]) <= TOL and a[1] == b[1] for a, b in zip(masked, got))


# -- the command line ------------------------------------------------------------------


def _cli(*args: str):
    from capsense.cli import main

    return CliRunner().invoke(main, list(args))


def test_cli_export_both_formats(folders, tmp_path):
    base_dir = str(folders("gpt2"))
    r = _cli("export", base_dir, "--heads", HEADS, "--format", "checkpoint", "--out", str(tmp_path / "c"))
    assert r.exit_code == 0, r.output
    assert "Exported checkpoint" in r.output and "model.safetensors" in r.output
    r = _cli("export", base_dir, "--heads", HEADS, "--format", "adapter", "--out", str(tmp_path / "a"))
    assert r.exit_code == 0, r.output
    assert "adapter_model.safetensors" in r.output
    assert (tmp_path / "a" / "adapter_config.json").is_file()


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--heads", "L9H0"], "Error: layer 9 out of range in L9H0: this model has 3 layers (0-2)"),
        (["--heads", "L0H1", "--format", "adapter", "--device-map", "auto"], "Error: --device-map applies to --format checkpoint"),
        (["--heads", "L0H1", "--ablation", "mean"], "Error: mean ablation cannot be folded into this mistral checkpoint"),
        (["--heads", "{bad}.json"], "Error: heads file '{bad}.json' is not valid JSON"),
        (["--heads", "{missing}.json"], "Error: heads file '{missing}.json' not found"),
        (["--heads", "L0X1"], "Error: malformed head 'L0X1'"),
        (["--heads", "L0H1", "--private"], "Error: --private only applies with --push-to-hub"),
    ],
)
def test_cli_errors_are_one_clear_line(extra, message, folders, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[")
    fill = {"bad": str(tmp_path / "bad"), "missing": str(tmp_path / "missing")}
    extra = [e.format(**fill) for e in extra]
    message = message.format(**fill)
    if "--format" not in extra:
        extra += ["--format", "checkpoint"]
    out = tmp_path / "out"
    r = _cli("export", str(folders("mistral")), *extra, "--out", str(out))
    assert r.exit_code == 1, r.output
    assert message in r.output and "Traceback" not in r.output
    assert _nothing_at(out)


def test_cli_export_applies_the_runs_ablation_by_default(folders, tmp_path):
    """A heads file located under mean ablation exports under mean ablation unless --ablation says otherwise
    (core.ablation.resolve_ablation, as validate); where the means cannot be folded, the refusal says so."""
    heads_file = tmp_path / "heads.json"
    heads_file.write_text(json.dumps({"model": "tiny", "ablation": "mean", "mean_reference": None,
                                      "heads": [{"layer": 0, "head": 1}, {"layer": 2, "head": 0}]}))
    exported = {}
    for name, extra in (("default", []), ("zero", ["--ablation", "zero"])):
        r = _cli("export", str(folders("gpt2")), "--heads", str(heads_file), "--format", "checkpoint",
                 "--out", str(tmp_path / name), *extra)
        assert r.exit_code == 0, r.output
        exported[name] = json.loads((tmp_path / name / "capsense.json").read_text())["ablation"]
    assert exported == {"default": "mean", "zero": "zero"}
    r = _cli("export", str(folders("mistral")), "--heads", str(heads_file), "--format", "checkpoint",
             "--out", str(tmp_path / "m"))
    assert r.exit_code == 1 and "Error: mean ablation cannot be folded into this mistral checkpoint" in r.output
    assert _nothing_at(tmp_path / "m")


def test_cli_refuses_existing_folder(folders, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("x")
    args = ["export", str(folders("llama")), "--heads", HEADS, "--format", "adapter", "--out", str(out)]
    r = _cli(*args)
    assert r.exit_code == 1 and "Error: output folder" in r.output and "--overwrite" in r.output
    assert os.listdir(out) == ["x"]
    r = _cli(*args, "--overwrite")
    assert r.exit_code == 0, r.output
    assert "x" not in os.listdir(out)


def test_export_states_every_measured_off_target_change(folders, tmp_path):
    """capsense.json and the card carry the verdict and every control's change, not only the named ones."""
    run = tmp_path / "run"
    run.mkdir()
    meta = {"task": "capsense_induction", "controls": ["capsense_facts", "capsense_arithmetic"],
            "refine": {"chosen": {"heads": ["L2H3", "L0H1"], "target_damage": 2.5,
                                  "control_damage": {"capsense_facts": 0.014, "capsense_arithmetic": -0.02}}}}
    (run / "heads.json").write_text(json.dumps({"model": "tiny", **meta, "heads": [
        {"layer": 2, "head": 3, "importance": 0.9}, {"layer": 0, "head": 1, "importance": 0.25}]}))
    verdict = {"selective": False, "tolerance": 0.1, "line": "NOT selective: 1 off-target row(s) beyond ...",
               "rows": [{"task": "capsense_recall", "metric": "acc", "role": "held-out", "base": 0.65, "ablated": 0.25,
                         "worsening": 0.615, "random_worst": 0.03, "documents": 40, "documents_net": 16, "z": 3.8},
                        {"task": "capsense_prose", "metric": "nats_per_token", "role": "searched", "base": 3.0,
                         "ablated": 3.03, "worsening": 0.01, "random_worst": 0.02}]}  # (no documents: nats/token)
    (run / "validation.json").write_text(json.dumps({"rows": [], "verdict": verdict}))
    out = export_checkpoint(str(folders("llama")), str(run / "heads.json"), tmp_path / "out", top_k=2).out
    off = json.loads((out / "capsense.json").read_text())["off_target"]
    assert off["search"]["control_damage"] == {"capsense_facts": 0.014, "capsense_arithmetic": -0.02}
    assert off["validation"]["selective"] is False and off["validation"]["rows"][0]["task"] == "capsense_recall"
    card = (out / "README.md").read_text()
    assert "## Selectivity (off-target changes)" in card and "NOT selective" in card
    assert "| capsense_recall | acc | held-out | 0.6500 | 0.2500 | +61.5% | +3.0% | 16 of 40 (3.8) |" in card
    assert "| capsense_prose | nats_per_token | searched | 3.0000 | 3.0300 | +1.0% | +2.0% |  |" in card
    assert off["validation"]["rows"][0]["z"] == 3.8 and off["validation"]["rows"][1]["z"] is None
    assert "`capsense_facts` +1.4%" in card


def test_export_of_another_set_than_the_run_measured_publishes_none_of_its_verdict(folders, tmp_path):
    """A run that chose and validated L2H3+L0H1, exported with --top-k 3: the card published the two's verdict and
    their control damage as the three's. Now it says the set is not validated and which set the run validated;
    exporting the validated set (in another order) keeps both."""
    run = tmp_path / "run"
    run.mkdir()
    meta = {"task": "capsense_induction", "controls": ["capsense_facts"],
            "refine": {"heads": ["L2H3", "L0H1"], "chosen": {"heads": ["L2H3", "L0H1"], "target_damage": 2.5,
                                                             "control_damage": {"capsense_facts": 0.014}}}}
    (run / "heads.json").write_text(json.dumps({"model": "tiny", **meta, "heads": [
        {"layer": 2, "head": 3, "rank": 1}, {"layer": 0, "head": 1, "rank": 2}, {"layer": 1, "head": 1, "rank": 3}]}))
    verdict = {"selective": True, "tolerance": 0.1, "line": "selective: every control within 10%", "rows": []}
    (run / "validation.json").write_text(json.dumps({"heads": "L2H3+L0H1", "rows": [], "verdict": verdict}))
    three = export_checkpoint(str(folders("llama")), str(run / "heads.json"), tmp_path / "three", top_k=3).out
    meta3 = json.loads((three / "capsense.json").read_text())
    assert "off_target" not in meta3 and "validation_markdown" not in meta3 and meta3["validated_heads"] == "L0H1+L2H3"
    card = (three / "README.md").read_text()
    assert "Not validated on held-out controls" in card and "validated another set, `L0H1+L2H3`" in card
    assert "selective: every control" not in card
    chosen = export_checkpoint(str(folders("llama")), "L0H1+L2H3", tmp_path / "spec").out  # (a spec: no run behind it)
    assert "off_target" not in json.loads((chosen / "capsense.json").read_text())
    chosen = export_checkpoint(str(folders("llama")), str(run / "heads.json"), tmp_path / "chosen").out
    off = json.loads((chosen / "capsense.json").read_text())["off_target"]
    assert off["validation"]["selective"] is True and off["search"]["control_damage"] == {"capsense_facts": 0.014}


def test_export_without_validation_says_selectivity_is_untested(folders, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "heads.json").write_text(json.dumps({"model": "tiny", "task": "capsense_induction", "controls": [],
                                                "heads": [{"layer": 2, "head": 3, "importance": 0.9}]}))
    out = export_checkpoint(str(folders("llama")), str(run / "heads.json"), tmp_path / "out", top_k=1).out
    assert "off_target" not in json.loads((out / "capsense.json").read_text())
    assert "Not validated on held-out controls" in (out / "README.md").read_text()


# -- the one preflight ------------------------------------------------------------------

_BAD = [  # (format, settings, what the error says): each refused before the format runs, nothing written
    ("checkpoint", {"ablation": "half"}, f"unknown `ablation` mode 'half': valid modes are {', '.join(ABLATION_MODES)}"),
    ("adapter", {"ablation": "half"}, f"unknown `ablation` mode 'half': valid modes are {', '.join(ABLATION_MODES)}"),
    ("checkpoint", {"dtype": "float8"}, "unknown dtype 'float8': choose one of"),
    ("adapter", {"dtype": "float8"}, "unknown dtype 'float8': choose one of"),
    ("checkpoint", {"mean_reference": "ref.txt"}, "`mean_reference` only applies to `ablation` mean"),
    ("adapter", {"mean_reference": "ref.txt"}, "`mean_reference` only applies to `ablation` mean"),
    ("adapter", {"device_map": "auto"}, "`device_map` applies to `format` checkpoint"),
    ("checkpoint", {"ablation": "mean", "mean_reference": "no-such.txt"}, "mean_reference file 'no-such.txt' not found"),
    ("adapter", {"ablation": "mean", "mean_reference": "no-such.txt"}, "mean_reference file 'no-such.txt' not found"),
    ("checkpoint", {"heads": "L0H1+L7H0"}, "layer 7 out of range in L7H0"),
    ("adapter", {"heads": "L0H1+L7H0"}, "layer 7 out of range in L7H0"),
    ("nope", {}, "unknown `format` 'nope': valid formats are adapter, checkpoint"),
]


@pytest.mark.parametrize("fmt,settings,message", _BAD)
def test_export_model_refuses_bad_input_to_each_format_before_it_runs(fmt, settings, message, folders, tmp_path,
                                                                       monkeypatch):
    """One check of the request for every format (capsense.ship.preflight.check_export_inputs), before the
    format's function is called: one error naming what was wrong and what is valid, nothing written."""
    from capsense.ship import base
    from capsense.ship.export import export_model

    ran = lambda *a, **k: pytest.fail("the format ran")  # noqa: E731
    monkeypatch.setattr(base.FORMATS, "_entries", {"adapter": ran, "checkpoint": ran})
    monkeypatch.setattr(base.FORMATS, "_lazy", set())
    settings = dict(settings)
    heads = settings.pop("heads", HEADS)
    out = tmp_path / "out"
    with pytest.raises(CapsenseError, match=message.replace("(", r"\(")):
        export_model(str(folders("llama")), heads, out, format=fmt, **settings)
    assert _nothing_at(out)


def test_a_bad_request_is_refused_before_torch_is_imported(folders, tmp_path):
    """``export_model`` imports no torch before its check: each bad input above is refused in a fresh
    interpreter that has not imported torch by the end."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom capsense.errors import CapsenseError\nfrom capsense.ship.export import export_model\n"
        f"for fmt, settings, _ in {_BAD!r}:\n"
        "    settings = dict(settings); heads = settings.pop('heads', 'L0H1')\n"
        "    try:\n"
        f"        export_model({str(folders('llama'))!r}, heads, {str(tmp_path / 'out')!r}, format=fmt, **settings)\n"
        "    except CapsenseError:\n        pass\n"
        "    else:\n        sys.exit('accepted: ' + repr(settings))\n"
        "print('torch' in sys.modules)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stdout + r.stderr


def test_the_command_checks_a_request_once(folders, tmp_path, monkeypatch):
    """``capsense export`` checks the request before its heavy imports and hands the result to the format,
    which does not check it again (round 19 checked it in the command and again in the format)."""
    import capsense.ship.preflight as preflight

    resolved = []

    def counted(*a, **k):
        resolved.append(a[0])
        return resolve(*a, **k)

    resolve = preflight.resolve_heads
    monkeypatch.setattr(preflight, "resolve_heads", counted)
    r = _cli("export", str(folders("llama")), "--heads", HEADS, "--format", "adapter", "--out", str(tmp_path / "a"))
    assert r.exit_code == 0, r.output
    assert resolved == [HEADS]

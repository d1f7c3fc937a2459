"""capsense-masked inside stock lm-eval: the real CLI, simple_evaluate, and start-up hygiene."""

import glob
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from capsense.core.ablation import zero_heads_in_weights
from capsense.tasks import tasks_dir
from capsense.errors import CapsenseError
from conftest import make_char_tokenizer, make_tiny_model

BIN = Path(sys.executable).parent
HEADS = "L0H1+L2H3+L2H0"
TASK = "capsense_addition"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_lm_eval(tmp_path: Path, model: str, model_args: str, name: str) -> subprocess.CompletedProcess:
    out = tmp_path / name
    cmd = [
        str(BIN / "lm_eval"), "--model", model, "--model_args", model_args,
        "--include_path", str(tasks_dir()), "--tasks", TASK, "--limit", "6",
        "--device", "cpu", "--batch_size", "3", "--log_samples", "--output_path", str(out),
    ]
    # cwd outside the repo: the installed capsense (and its .pth hook) must do the work.
    return subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)


def sample_lls(tmp_path: Path, name: str) -> dict[int, float]:
    files = glob.glob(str(tmp_path / name / "**" / f"samples_{TASK}_*.jsonl"), recursive=True)
    assert len(files) == 1, files
    out = {}
    for line in Path(files[0]).read_text().splitlines():
        rec = json.loads(line)
        out[rec["doc_id"]] = float(rec["resps"][0][0][0])
    return out


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm-eval-models")
    tok = make_char_tokenizer()
    model = make_tiny_model("llama")
    model.save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    zero_heads_in_weights(model, HEADS)
    model.save_pretrained(root / "zeroed")
    tok.save_pretrained(root / "zeroed")
    return root


def test_lm_eval_cli_capsense_masked_equals_hf_on_zeroed_copy(model_dirs, tmp_path):
    base, zeroed = model_dirs / "base", model_dirs / "zeroed"
    for name, model, args in [
        ("masked", "capsense-masked", f"pretrained={base},heads={HEADS}"),
        ("hf_zeroed", "hf", f"pretrained={zeroed}"),
    ]:
        proc = run_lm_eval(tmp_path, model, args, name)
        assert proc.returncode == 0, proc.stderr[-3000:]
    masked, zero = sample_lls(tmp_path, "masked"), sample_lls(tmp_path, "hf_zeroed")
    assert masked.keys() == zero.keys() and len(masked) == 6
    assert max(abs(masked[k] - zero[k]) for k in masked) <= 1e-4


def test_lm_eval_cli_bad_input_exits_nonzero(model_dirs, tmp_path):
    proc = run_lm_eval(tmp_path, "capsense-masked", f"pretrained={model_dirs / 'base'},heads=L7H0", "bad")
    assert proc.returncode != 0
    assert "layer 7 out of range in L7H0: this model has 3 layers (0-2)" in proc.stderr + proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        ("heads=L0H9", "head 9 out of range in L0H9: this model has 4 heads per layer (0-3)"),
        ("heads=L0X1", "malformed head 'L0X1'"),
        ("heads=L0H1,ablation=half", "unknown `ablation` mode 'half': valid modes are zero, mean"),
        ("heads=L0H1,top_k=x", "top_k must be an integer"),
        ("top_k=3", "top_k keeps the first k heads of heads= or head_file=, and neither is given"),  # (round 53: dropped)
    ],
)
def test_bad_model_args_through_lm_eval_registry(model_dirs, args, message):
    """The same path the CLI takes: registry lookup, then create_from_arg_string."""
    from lm_eval.api.registry import get_model

    cls = get_model("capsense-masked")
    with pytest.raises(CapsenseError) as err:
        cls.create_from_arg_string(f"pretrained={model_dirs / 'base'},device=cpu,{args}")
    assert message in str(err.value)


def test_heads_that_do_not_fit_are_refused_before_the_model_loads(model_dirs, monkeypatch):
    """The layout of a local model's config is enough to refuse an out-of-range head: it was refused after the load."""
    from lm_eval.models.huggingface import HFLM

    from capsense.evaluation.lm_eval_model import CapsenseMaskedLM

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the heads were checked")

    monkeypatch.setattr(HFLM, "__init__", no_load)
    with pytest.raises(CapsenseError, match="layer 7 out of range in L7H0: this model has 3 layers"):
        CapsenseMaskedLM(pretrained=str(model_dirs / "base"), heads="L7H0", device="cpu")


def test_from_python_without_a_device_it_takes_the_cpu_where_there_is_no_cuda(model_dirs):
    """``HFLM``'s default device from Python is "cuda": on a machine without CUDA, ``CapsenseMaskedLM(pretrained=...,
    heads=...)`` failed in the load ("Torch not compiled with CUDA enabled"). It takes what lm-eval's command line takes."""
    import torch

    from capsense.evaluation.lm_eval_model import CapsenseMaskedLM

    lm = CapsenseMaskedLM(pretrained=str(model_dirs / "base"), heads="L0H1")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert lm.device.type == expected and next(lm.model.parameters()).device.type == expected


def test_bad_heads_file_and_unknown_arch(tmp_path):
    from capsense.evaluation.lm_eval_model import CapsenseMaskedLM

    bad = tmp_path / "heads.json"
    bad.write_text("{oops")
    with pytest.raises(CapsenseError, match="is not valid JSON"):
        CapsenseMaskedLM(pretrained="unused", heads=str(bad))

    import transformers as T

    opt = T.AutoModelForCausalLM.from_config(
        T.OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=64)
    )
    opt.save_pretrained(tmp_path / "opt")
    make_char_tokenizer().save_pretrained(tmp_path / "opt")
    with pytest.raises(CapsenseError, match="unsupported architecture 'opt': capsense supports .*llama"):
        CapsenseMaskedLM(pretrained=str(tmp_path / "opt"), heads="L0H0", device="cpu")


def test_simple_evaluate_no_heads_is_hf_and_heads_equal_zeroed(model_dirs):
    import lm_eval

    from capsense.tasks import task_manager

    base = model_dirs / "base"
    tm = task_manager(metadata={"tokenizer": str(base)})
    common = dict(tasks=[TASK], limit=6, task_manager=tm, log_samples=True, verbosity="ERROR")

    def run(model, args):
        out = lm_eval.simple_evaluate(model=model, model_args=args + ",device=cpu,batch_size=3", **common)
        return [float(s["resps"][0][0][0]) for s in out["samples"][TASK]], out["results"][TASK]

    masked, masked_res = run("capsense-masked", f"pretrained={base},heads={HEADS}")
    zero, zero_res = run("hf", f"pretrained={model_dirs / 'zeroed'}")
    none, _ = run("capsense-masked", f"pretrained={base}")
    hf, _ = run("hf", f"pretrained={base}")
    assert none == hf  # no heads: exactly the hf results
    assert masked == pytest.approx(zero, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(masked, hf)) > 1e-3
    n = masked_res["nats_per_token,none"]
    assert n == pytest.approx(zero_res["nats_per_token,none"], abs=1e-5) and n > 0


def test_entry_point_declared_and_startup_stays_light():
    eps = {ep.name: ep.value for ep in metadata.entry_points(group="lm_eval.models")}
    assert eps.get("capsense-masked") == "capsense.evaluation.lm_eval_model:CapsenseMaskedLM"
    code = (
        "import sys, site; "
        "print(any(m in sys.modules for m in ('torch', 'lm_eval', 'transformers'))); "
        "print('capsense.evaluation.lm_eval_hook' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd="/", env=ENV, capture_output=True, text=True)
    assert out.stdout.split() == ["False", "True"], out.stderr


def test_pretrained_may_be_a_local_gguf_file(tmp_path, monkeypatch):
    from capsense.core.heads import HeadSet
    from capsense.errors import HeadSpecError
    from capsense.evaluation.lm_eval_model import CapsenseMaskedLM
    from conftest import write_tiny_gguf

    monkeypatch.setenv("CAPSENSE_CACHE", str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "tiny.gguf")  # 2 layers x 4 heads
    lm = CapsenseMaskedLM(pretrained=str(tmp_path / "tiny.gguf"), heads="L1H2", device="cpu", batch_size=1)
    assert lm.model.config.model_type == "llama" and lm.heads == HeadSet.parse("L1H2")
    assert str(tmp_path / "cache" / "models" / "gguf") in lm.model.name_or_path
    with pytest.raises(HeadSpecError, match="layer 2 out of range in L2H0: this model has 2 layers"):
        lm.set_heads("L2H0")

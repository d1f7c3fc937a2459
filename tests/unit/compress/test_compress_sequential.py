"""Layer-by-layer calibration (capsense.compress.sequential): exact against one pass when the original
outputs are passed on, calibrated on the compressed layers' outputs otherwise, one layer's statistics held."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from conftest import make_tiny_model, tiny_inputs

import capsense.compress.sequential as seq
from capsense.compress.budget import uniform_budget
from capsense.compress.calibration import GRAM_BYTES, InputStats, check_gram_memory, collect_stats, gram_memory
from capsense.compress.engine import compress_model, compress_targets, plan
from capsense.compress.guided import Guide
from capsense.compress.targets import find_targets
from capsense.errors import CapsenseError

SAMPLES = [r.tolist() for r in tiny_inputs(4, 13)]
GPTQ = {"method": "gptq", "bits": 3, "group_size": 16}
#: gemma3's layers of two kinds, with a window shorter than the samples: their masks differ per layer,
#: so a run that handed every layer the first layer's arguments would not match the one pass
GEMMA_MIXED = {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "sliding_window": 4}
MODELS = [("llama", {}), ("gemma3_text", GEMMA_MIXED)]


def _spy(monkeypatch) -> list[dict]:
    """Record, at each layer's compression, its Gram matrices (copies) and the InputStats alive."""
    seen: list[dict] = []

    def spying(planned, stats, *args, **kwargs):
        gc.collect()
        alive = [o for o in gc.get_objects() if isinstance(o, InputStats)]
        grams = {n: s.gram.clone() for n, s in (stats or {}).items() if s.gram is not None}
        seen.append({"alive": len(alive), "bytes": sum(s.gram.numel() * 8 for s in alive if s.gram is not None),
                     "grams": grams})
        return compress_targets(planned, stats, *args, **kwargs)

    monkeypatch.setattr(seq, "compress_targets", spying)
    return seen


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("arch,overrides", MODELS)
@pytest.mark.parametrize("setting", [GPTQ, {"method": "sparsegpt", "density": 0.5}, {"method": "svd-llm", "ratio": 0.5}])
def test_original_outputs_give_the_one_pass_grams_and_weights(monkeypatch, arch, overrides, setting):
    budget = uniform_budget(setting)
    one = make_tiny_model(arch, **overrides)
    stats = collect_stats(one, find_targets(one), SAMPLES, gram=True)
    compress_model(one, budget, stats)
    seen = _spy(monkeypatch)
    layered = make_tiny_model(arch, **overrides)
    result = seq.compress_sequential(layered, budget, SAMPLES, propagate="original")
    assert len(seen) == 3 and result.sequential == {"propagate": "original", "layers": 3}
    for layer in seen:
        for name, g in layer["grams"].items():
            assert torch.equal(g, stats[name].gram), name
    a, b = _weights(one), _weights(layered)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_first_layers_arguments_for_every_layer_would_not_match(monkeypatch):
    """The exactness test above can fail: gemma3's per-layer masks matter."""
    run = seq.run_layer
    monkeypatch.setattr(seq, "run_layer", lambda layer, cached, i, j: run(layer, cached, 0, j))
    one = make_tiny_model("gemma3_text", **GEMMA_MIXED)
    compress_model(one, uniform_budget(GPTQ), collect_stats(one, find_targets(one), SAMPLES, gram=True))
    layered = make_tiny_model("gemma3_text", **GEMMA_MIXED)
    seq.compress_sequential(layered, uniform_budget(GPTQ), SAMPLES, propagate="original")
    a, b = _weights(one), _weights(layered)
    assert not all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("arch,overrides", MODELS)
def test_compressed_outputs_calibrate_layer_1_on_the_compressed_layer_0(monkeypatch, arch, overrides):
    """Layer 1's Gram is the one-pass Gram of a model whose layer 0 alone was compressed, not the original's."""
    budget = uniform_budget({"method": "gptq", "bits": 2, "group_size": 16})
    seen = _spy(monkeypatch)
    seq.compress_sequential(make_tiny_model(arch, **overrides), budget, SAMPLES, propagate="compressed")
    ref = make_tiny_model(arch, **overrides)
    original = collect_stats(ref, find_targets(ref), SAMPLES, gram=True)
    layer0 = [(t, s) for t, s in plan(ref, budget) if t.layer == 0]
    compress_targets(layer0, original, {})
    after0 = collect_stats(ref, [t for t in find_targets(ref) if t.layer == 1], SAMPLES, gram=True)
    assert seen[1]["grams"] and all(torch.equal(g, after0[n].gram) for n, g in seen[1]["grams"].items())
    assert not any(torch.allclose(g, original[n].gram) for n, g in seen[1]["grams"].items())
    assert all(torch.equal(g, original[n].gram) for n, g in seen[0]["grams"].items())  # layer 0: the same inputs


def test_compressed_outputs_equal_original_ones_when_layer_0_is_left_dense(monkeypatch):
    """Layer 0 skipped (dense), the rest GPTQ: layer 1 is calibrated on exactly the one-pass inputs."""
    from capsense.compress.budget import Override

    seen = _spy(monkeypatch)
    model = make_tiny_model("llama")
    one = collect_stats(model, find_targets(model), SAMPLES, gram=True)
    budget = uniform_budget(GPTQ)
    budget.overrides.append(Override(layers={0}, setting={"skip": True}))
    seq.compress_sequential(model, budget, SAMPLES, propagate="compressed")
    assert not seen[0]["grams"] and seen[1]["grams"]
    assert all(torch.equal(g, one[n].gram) for n, g in seen[1]["grams"].items())
    assert not any(torch.allclose(g, one[n].gram) for n, g in seen[2]["grams"].items())  # after layer 1's GPTQ


def test_one_layers_statistics_are_held_at_a_time(monkeypatch):
    """Llama's layer reads 4 distinct inputs (q/k/v's, o's, gate/up's, down's): 4 InputStats alive at each
    layer's compression, and one layer's Gram bytes, as check_gram_memory(sequential=True) counts."""
    seen = _spy(monkeypatch)
    model = make_tiny_model("llama")
    targets = find_targets(model)
    one_layer = check_gram_memory(model, targets, SAMPLES[0], sequential=True)
    assert one_layer == GRAM_BYTES * (3 * 64**2 + 128**2) == sum(gram_memory(model, targets, SAMPLES[0]).values()) // 3
    seq.compress_sequential(model, uniform_budget(GPTQ), SAMPLES)
    assert [s["alive"] for s in seen] == [4, 4, 4]
    assert [s["bytes"] for s in seen] == [one_layer] * 3


def test_the_gram_check_counts_one_layer_and_the_one_pass_refusal_names_sequential():
    model = make_tiny_model("llama")
    targets = find_targets(model)
    one_layer = check_gram_memory(model, targets, SAMPLES[0], sequential=True)
    with pytest.raises(CapsenseError, match="`sequential`"):
        check_gram_memory(model, targets, SAMPLES[0], available=2 * one_layer)
    assert check_gram_memory(model, targets, SAMPLES[0], available=one_layer, sequential=True) == one_layer
    with pytest.raises(CapsenseError, match="one decoder layer at a time") as e:
        check_gram_memory(model, targets, SAMPLES[0], available=one_layer - 1, sequential=True)
    assert "`sequential`" not in str(e.value)


@pytest.mark.parametrize("setting,guide,propagate,match", [
    ({"method": "rtn", "bits": 4}, None, "compressed", "rtn needs no calibration"),
    ({"method": "magnitude", "density": 0.5}, None, "compressed", "magnitude needs no calibration"),
    ({"method": "svd", "ratio": 0.5}, None, "compressed", "svd needs no calibration"),
    (GPTQ, Guide(["math"], sensitivity="measured"), "compressed", "sensitivity measured"),
    ({"method": "wanda", "density": 0.5, "scope": "global"}, None, "compressed", "scope global"),
    (GPTQ, None, "both", "valid are compressed, original"),
])
def test_what_sequential_cannot_do_is_refused(setting, guide, propagate, match):
    with pytest.raises(CapsenseError, match=match):
        seq.check_sequential(uniform_budget(setting), guide, propagate)
    seq.check_sequential(uniform_budget({"method": "wanda", "density": 0.5}))  # calibrated, no Gram: fine


def test_a_model_without_decoder_layers_is_a_clear_error():
    model = make_tiny_model("llama")
    model.model.layers = nn.Identity()
    with pytest.raises(CapsenseError, match="no decoder layers at 'model.layers'"):
        seq.decoder_layers(model)
    model.config.model_type = "unknown-arch"
    with pytest.raises(CapsenseError, match="unsupported architecture"):
        seq.decoder_layers(model)


def test_layers_are_restored_when_capture_fails():
    model = make_tiny_model("llama")
    layers = seq.decoder_layers(model)
    before = list(layers)
    with pytest.raises(Exception):
        seq.capture_inputs(model, layers, [[10**6]])  # an id past the vocabulary
    assert list(layers) == before


class _KeywordLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(4, 4)

    def forward(self, hidden_states, scale):
        return self.mlp(hidden_states) * scale


class _KeywordModel(nn.Module):
    """Calls its layers with the hidden states as a keyword and a per-layer argument."""

    def __init__(self) -> None:
        super().__init__()
        from types import SimpleNamespace

        torch.manual_seed(0)
        self.config = SimpleNamespace(model_type="llama")
        self.embed = nn.Embedding(10, 4)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([_KeywordLayer() for _ in range(3)])

    def forward(self, input_ids, use_cache=False):
        h = self.embed(input_ids)
        for i, layer in enumerate(self.model.layers):
            h = layer(hidden_states=h, scale=float(i + 1))
        return h


def test_capture_takes_hidden_states_given_by_keyword_and_each_layers_own_arguments():
    model = _KeywordModel()
    layers = seq.decoder_layers(model)
    cached = seq.capture_inputs(model, layers, [[1, 2, 3]])
    assert [a[0] for a in cached.args] == [((), {"scale": 1.0}), ((), {"scale": 2.0}), ((), {"scale": 3.0})]
    with torch.no_grad():
        for i, layer in enumerate(layers):
            cached.hidden = [seq.run_layer(layer, cached, i, 0)]
        assert torch.equal(cached.hidden[0], model(torch.tensor([[1, 2, 3]])))


def test_the_sequential_check_counts_the_cached_hidden_states(monkeypatch):
    """compress_sequential refuses when one layer's Grams fit but the Grams and the cached hidden states
    (2 x tokens x hidden x bytes) do not, naming both, before any layer is compressed."""
    model = make_tiny_model("llama")
    targets = find_targets(model)
    one_layer = check_gram_memory(model, targets, SAMPLES[0], sequential=True)
    hidden = seq.cached_bytes(model, SAMPLES)
    emb = model.get_input_embeddings()
    assert hidden == 2 * sum(map(len, SAMPLES)) * emb.embedding_dim * emb.weight.element_size() > 0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr("capsense.core.placement.available_cpu_memory", lambda: one_layer + hidden - 1)
    with pytest.raises(CapsenseError, match="cached hidden states") as e:
        seq.compress_sequential(model, uniform_budget(GPTQ), SAMPLES)
    assert "one decoder layer at a time" in str(e.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing compressed
    monkeypatch.setattr("capsense.core.placement.available_cpu_memory", lambda: one_layer + hidden)
    seq.compress_sequential(model, uniform_budget(GPTQ), SAMPLES)  # exactly enough: runs


def test_a_layers_sums_stay_on_its_device_until_its_last_forward_and_are_the_same_sums():
    """``on_device``: no transfer per calibration text (the sums stay where the inputs are: ``meta`` here, standing
    for a GPU), one move to the CPU at the end, the same float64 sums as summing on the CPU; and a layer's sums are
    summed there only when every target is off the CPU and they fit in half of what each device has free."""
    from capsense.compress.calibration import accumulate_stats

    x = torch.randn(3, 5, 16)
    on_meta = InputStats(16, device="meta")
    for xi in x.to("meta"):
        on_meta.add(xi, gram=True)
    assert {on_meta.gram.device.type, on_meta.sq_sum.device.type, on_meta.abs_sum.device.type} == {"meta"}
    model = make_tiny_model("llama")
    targets = [t for t in find_targets(model) if t.layer == 0]
    ids = [list(map(int, torch.randint(0, 50, (12,)))) for _ in range(3)]

    def forwards():
        return (lambda ids=i: model(input_ids=torch.tensor([ids]), use_cache=False) for i in ids)

    apart, together = (accumulate_stats(targets, forwards(), True, on_device=d) for d in (False, True))
    for t in targets:
        a, b = apart[t.name], together[t.name]
        assert b.device == "cpu" and b.gram.device.type == "cpu" and a.n_tokens == b.n_tokens == 36
        assert torch.equal(a.gram, b.gram) and torch.equal(a.sq_sum, b.sq_sum) and torch.equal(a.abs_sum, b.abs_sum)
    assert not seq.sums_fit_device(targets, True)  # on the CPU already: nothing to gain
    meta = [t for t in find_targets(make_tiny_model("llama").to("meta")) if t.layer == 0]
    need = sum(8 * t.shape[1] * (t.shape[1] + 2) for t in meta)
    assert seq.sums_fit_device(meta, True, available=lambda d: 2 * need)
    assert not seq.sums_fit_device(meta, True, available=lambda d: 2 * need - 1)
    assert not seq.sums_fit_device(meta, True, available=lambda d: None)  # no figure for the device: the CPU
    assert seq.sums_fit_device(meta, False, available=lambda d: 2 * need)  # without Grams far less is needed

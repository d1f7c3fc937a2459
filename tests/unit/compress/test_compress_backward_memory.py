"""The activations a Fisher pass holds (capsense.compress.sensitivity.backward_memory), against what autograd
saves: the bytes of the tensors saved for the backward pass of the real pass (``fisher_diagonal``, only the
target weights needing gradients), deduplicated by storage, the weights left out. Round 18's guided memory check
counted none of them (SmolLM2: counted 0.91 GiB against a measured peak of 2.08 GiB, sequential)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_char_tokenizer, make_tiny_model, tiny_inputs

import capsense.compress.guided_sequential as gs
from capsense.compress.budget import uniform_budget
from capsense.compress.calibration import calibration_samples
from capsense.compress.guided import Guide, fisher_texts, fisher_tokens
from capsense.compress.methods import parse_setting
from capsense.compress.sensitivity import FISHER_MAX_TOKENS, backward_memory, fisher_diagonal
from capsense.compress.targets import find_targets

#: Counted over measured saved bytes: 1 on Llama-like blocks (the 4-byte loss scale aside); Gemma's norms also
#: save ``1 + weight`` vectors (per layer, not per token: 0.5% of the saved bytes at 64 tokens), not counted.
TOLERANCE = 0.01


def saved_bytes(model, targets, ids) -> int:
    """Bytes autograd saves for the backward of one :func:`fisher_diagonal` pass over ``ids``: each saved
    tensor's storage once, the model's weights not (they are counted as the model)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        storage = x.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fisher_diagonal(model, targets, [ids])
    return sum(seen.values())


def _saved_parts(counted: dict[str, int]) -> int:
    """What the count says is saved: everything but the backward's transient logit gradients."""
    return sum(v for k, v in counted.items() if k != "backward pass: logit gradients")


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layers", [None, {1}, {1, 2}])
def test_the_count_is_what_autograd_saves(arch, attn, dtype, layers):
    """Every layer's or one ``fisher_groups`` run's targets needing gradients: layers before it save nothing,
    layers after it all but their matrices' inputs."""
    model = make_tiny_model(arch, attn_implementation=attn).to(dtype)
    targets = [t for t in find_targets(model) if layers is None or t.layer in layers]
    tokens = 64
    measured = saved_bytes(model, targets, tiny_inputs(1, tokens)[0].tolist())
    counted = backward_memory(model, tokens, layers)
    assert abs(_saved_parts(counted) / measured - 1) < TOLERANCE, (counted, measured)
    assert counted["backward pass: logit gradients"] == 2 * 4 * tokens * model.config.vocab_size


def test_the_count_grows_with_the_texts_and_the_vocabulary():
    """Per token in every part but eager attention's scores (quadratic); the vocabulary's parts by its size."""
    model = make_tiny_model("llama", attn_implementation="sdpa", vocab_size=1024)
    targets = find_targets(model)
    for tokens in (16, 48):
        counted = backward_memory(model, tokens)
        assert abs(_saved_parts(counted) / saved_bytes(model, targets, tiny_inputs(1, tokens)[0].tolist()) - 1) < TOLERANCE
    assert sum(backward_memory(model, 48).values()) > 2.9 * sum(backward_memory(model, 16).values())


@pytest.mark.parametrize("sequential", [True, False])
def test_the_guided_check_counts_the_fisher_pass_activations(sequential):
    """The sensitivity phase holds, beside the sums and one layer's gradients, a pass's saved activations at
    the Fisher texts' length and its logit gradients; round 18's count (sums and gradients only) is below what
    one pass of its own texts' length saves."""
    model, tok = make_tiny_model("llama", attn_implementation="sdpa"), make_char_tokenizer()
    samples, _ = calibration_samples("prose,math", tok, 4)
    guide, uni = Guide(["math"], samples=2, protect_top_k=0), uniform_budget({"method": "gptq", "bits": 3, "group_size": 16})
    targets = find_targets(model)
    phase = gs.guided_memory(model, uni, samples, guide, sequential=sequential)["sensitivity"]
    sums, layer = 4 * sum(t.n_params for t in targets), max(sum(4 * t.n_params for t in targets if t.layer == i)
                                                             for i in range(3))
    measured = saved_bytes(model, targets, tiny_inputs(1, FISHER_MAX_TOKENS)[0].tolist())
    assert sum(phase.values()) - sum(v for k, v in phase.items() if k.startswith("Gram")) >= sums + layer + measured
    assert {k: v for k, v in phase.items() if k in backward_memory(model)} == backward_memory(model)


def test_fisher_groups_count_the_run_that_saves_the_most():
    """With ``fisher_groups`` each run's pass saves from its first layer on: the first run's is the most."""
    model, tok = make_tiny_model("llama", attn_implementation="sdpa"), make_char_tokenizer()
    samples, _ = calibration_samples("prose,math", tok, 4)
    uni = uniform_budget({"method": "gptq", "bits": 3, "group_size": 16})
    phase = gs.guided_memory(model, uni, samples, Guide(["math"], samples=2, protect_top_k=0, fisher_groups=3))["sensitivity"]
    first = backward_memory(model, layers={0})
    assert {k: v for k, v in phase.items() if k in first} == first
    assert sum(first.values()) > sum(backward_memory(model, layers={1}).values()) > sum(backward_memory(model, layers={2}).values())


def test_with_the_run_s_fisher_texts_a_fisher_pass_is_counted_at_its_longest_text():
    """The run's own Fisher texts (tokenized as the Fisher reads them), not the 256 tokens they are cut to: the
    count of their longest text is what that text's pass saves; without the texts the bound."""
    model, tok = make_tiny_model("llama", attn_implementation="sdpa"), make_char_tokenizer()
    samples, _ = calibration_samples("prose,math", tok, 4)
    gptq = {"method": "gptq", "bits": 3, "group_size": 16}
    guide, uni = Guide(["prose"], samples=2, protect_top_k=0), uniform_budget(gptq)
    texts = fisher_texts(tok, guide, parse_setting(gptq))
    assert texts == {"prose": calibration_samples("prose", tok, 2, max_tokens=FISHER_MAX_TOKENS)[0]}
    longest = max(texts["prose"], key=len)
    assert fisher_tokens(texts) == len(longest) < FISHER_MAX_TOKENS
    assert fisher_texts(tok, Guide(["prose"], sensitivity="flat", protect_top_k=0), parse_setting(gptq)) == {}
    assert fisher_tokens({}) == 0
    need = gs.check_guided_memory(model, uni, samples, guide, texts=texts)["sensitivity"]
    bound = gs.check_guided_memory(model, uni, samples, guide)["sensitivity"]
    assert bound - need == sum(backward_memory(model).values()) - sum(backward_memory(model, len(longest)).values()) > 0
    measured = saved_bytes(model, find_targets(model), longest)
    assert abs(_saved_parts(backward_memory(model, len(longest))) / measured - 1) < TOLERANCE


@pytest.mark.parametrize("sequential", [[], ["--sequential"]])
def test_the_command_counts_the_fisher_pass_at_the_run_s_longest_text(monkeypatch, tmp_path, tiny_model_dir, sequential):
    """``capsense compress --keep`` checks with its Fisher texts (both modes): their own length."""
    from click.testing import CliRunner

    from capsense.cli import main
    from capsense.errors import CapsenseError

    lengths = []

    def record(model, uniform, samples, guide, packed=False, sequential=True, fisher_length=FISHER_MAX_TOKENS):
        lengths.append(fisher_length)
        raise CapsenseError("stop after the check")

    monkeypatch.setattr(gs, "guided_memory", record)
    r = CliRunner().invoke(main, ["compress", str(tiny_model_dir), "--method", "gptq", "--bits", "3", "--group-size", "32",
                                  "--keep", "prose", "--calibration-samples", "2", *sequential, "--out", str(tmp_path / "no")])
    assert "stop after the check" in r.output, r.output
    texts = calibration_samples("prose", make_char_tokenizer(), 2, max_tokens=FISHER_MAX_TOKENS)[0]
    assert lengths == [max(len(t) for t in texts)] and lengths[0] < FISHER_MAX_TOKENS

"""The calibration Gram matrices' memory: counted per distinct matrix input, refused before calibration."""

from __future__ import annotations

import pytest

import capsense.core.placement as placement
from capsense.compress.calibration import GRAM_BYTES, check_gram_memory, collect_stats, gram_memory
from capsense.compress.targets import find_targets
from capsense.errors import CapsenseError
from conftest import make_tiny_model, tiny_inputs

IDS = tiny_inputs(1, 9)[0].tolist()


def _hand_count(arch: str) -> dict[str, int]:
    """Distinct inputs per layer of the tiny configs (3 layers, hidden 64): llama's q/k/v share one
    input and gate/up another (o_proj 64, down_proj 128 wide); gpt2's c_attn, attn c_proj, c_fc (64)
    and mlp c_proj (256)."""
    if arch == "llama":
        return {"attn": 3 * GRAM_BYTES * (64**2 + 64**2), "mlp": 3 * GRAM_BYTES * (64**2 + 128**2)}
    return {"attn": 3 * GRAM_BYTES * (64**2 + 64**2), "mlp": 3 * GRAM_BYTES * (64**2 + 256**2)}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_gram_memory_counts_each_shared_input_once(arch):
    model = make_tiny_model(arch)
    targets = find_targets(model)
    assert gram_memory(model, targets, IDS) == _hand_count(arch)
    stats = collect_stats(model, targets, [IDS], gram=True)  # what calibration then really holds
    held = {id(s.gram): s.gram for s in stats.values()}
    assert sum(g.numel() * g.element_size() for g in held.values()) == sum(_hand_count(arch).values())


def test_check_refuses_above_the_available_memory_and_names_both():
    model = make_tiny_model("llama")
    targets = find_targets(model)
    need = sum(_hand_count("llama").values())
    assert check_gram_memory(model, targets, IDS, available=need) == need
    with pytest.raises(CapsenseError) as e:
        check_gram_memory(model, targets, IDS, available=need - 1)
    msg = str(e.value)
    assert f"{need / 2**30:.1f} GiB" in msg and "`targets`" in msg and "wanda" in msg


def test_collect_stats_refuses_before_accumulating_and_leaves_no_hooks(monkeypatch):
    model = make_tiny_model("llama")
    targets = find_targets(model)
    monkeypatch.setattr(placement, "available_cpu_memory", lambda: 1024)
    with pytest.raises(CapsenseError, match="Gram matrix"):
        collect_stats(model, targets, [IDS, IDS], gram=True)
    assert all(not t.module._forward_pre_hooks for t in targets)
    stats = collect_stats(model, targets, [IDS], gram=False)  # statistics without Gram need no check
    assert all(s.gram is None and s.n_tokens == len(IDS) for s in stats.values())

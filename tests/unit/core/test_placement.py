"""Device maps: a tiny model split over cpu + disk offload gives the single-device logits and knockouts."""

from __future__ import annotations

import json

import pytest
import torch

from capsense.core.ablation import HeadAblator
from capsense.core.batching import row_bytes
from capsense.core.models import load_model
from capsense.core import placement
from capsense.core.placement import check_cpu_memory, check_device, input_device, parse_device_map
from capsense.errors import CapsenseError
from conftest import N_LAYERS, save_tiny_folder, tiny_inputs

# the embeddings and layer 1 on disk (accelerate loads them into the forward on demand), the rest on cpu
SPLIT = {"model.embed_tokens": "disk", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "cpu",
         "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_folder("llama", tmp_path_factory.mktemp("placed"))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_split_model_equals_single_device(tmp_path, arch):
    path = save_tiny_folder(arch, tmp_path / arch)
    ref, _ = load_model(str(path), "float32")
    names = [n for n, _ in ref.named_children()]
    base = getattr(ref, ref.base_model_prefix)
    layers = "h" if arch == "gpt2" else "layers"
    dm = {f"{ref.base_model_prefix}.{n}": "cpu" for n, _ in base.named_children() if n != layers}
    dm.update({f"{ref.base_model_prefix}.{layers}.{i}": ("disk" if i % 2 else "cpu") for i in range(N_LAYERS)})
    dm.update({n: "cpu" for n in names if n != ref.base_model_prefix})
    placed, _ = load_model(str(path), "float32", device_map=json.dumps(dm))
    assert any(p.device.type == "meta" for p in placed.parameters())  # really offloaded
    ids = tiny_inputs()
    with torch.no_grad():
        torch.testing.assert_close(placed(ids).logits, ref(ids).logits, rtol=0, atol=1e-6)
        ko = torch.zeros(2, N_LAYERS, 4, dtype=torch.bool)
        ko[0, 1, 2] = ko[1, 0, 0] = ko[1, 2, 3] = True
        two = ids[:2]
        want = HeadAblator(ref).apply(ko)
        with want:
            expected = ref(two).logits
        with HeadAblator(placed).apply(ko):
            got = placed(two).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert not torch.allclose(expected, ref(two).logits)


def test_probe_scores_on_a_split_model(folder):
    from capsense.scoring.prefix import PrefixReuseScorer
    from capsense.scoring.probe import Probe, ProbeScorer

    ref, tok = load_model(str(folder), "float32")
    placed, _ = load_model(str(folder), "float32", device_map=SPLIT)
    assert input_device(placed).type == "cpu"
    probe = Probe.from_pairs("t", [("abc abc", "de"), ("hello wor", "ld"), ("1 2 3", " 4")], tok)
    ko = torch.zeros(3, N_LAYERS, 4, dtype=torch.bool)
    ko[1, 1, 1] = ko[2, 2, 0] = True
    for cls in (ProbeScorer, PrefixReuseScorer):
        a = cls(ref, probe, batch_size=2).score(ko)
        b = cls(placed, probe, batch_size=2).score(ko)
        for k in a:
            assert a[k] == pytest.approx(b[k], abs=1e-6)


def test_bad_devices_are_named():
    with pytest.raises(CapsenseError, match=r"device 'cuda:7' does not exist on this machine: available devices are cpu"):
        parse_device_map('{"model.layers.0": "cuda:7"}')
    with pytest.raises(CapsenseError, match="'cuda:3' does not exist"):
        parse_device_map("3")
    with pytest.raises(CapsenseError, match="does not exist"):
        check_device("tpu")
    with pytest.raises(CapsenseError, match="not valid JSON"):
        parse_device_map("{model")
    assert parse_device_map("auto") == "auto"
    assert parse_device_map("True") == "auto"  # lm-eval's parallelize=True
    assert parse_device_map("cpu") == {"": "cpu"}


def test_bad_device_map_loads_nothing(folder):
    with pytest.raises(CapsenseError, match="cuda:1"):
        load_model(str(folder), "float32", device_map='{"": "cuda:1"}')
    with pytest.raises(CapsenseError, match="'cuda:2' does not exist"):
        load_model(str(folder), "float32", device="cuda:2")


def test_masks_per_forward_from_memory(folder):
    from transformers import AutoConfig

    from capsense.core.placement import MAX_MASKS_PER_FORWARD, auto_masks_per_forward, masks_that_fit

    model, _ = load_model(str(folder), "float32")
    assert auto_masks_per_forward(model, 16, 512) == 1  # CPU: always 1
    cfg = AutoConfig.from_pretrained(folder)
    one = masks_that_fit(cfg, 16, 100, 0)
    assert one == 1  # never below 1
    sizes = [masks_that_fit(cfg, 16, 100, b) for b in (1e6, 1e7, 1e8, 1e12)]
    assert sizes == sorted(sizes) and sizes[-1] == MAX_MASKS_PER_FORWARD
    assert all(s & (s - 1) == 0 for s in sizes)  # powers of two
    assert masks_that_fit(cfg, 16, 400, 1e8) < masks_that_fit(cfg, 16, 100, 1e8)  # longer requests, fewer masks


def test_auto_packs_only_without_prefix_reuse_on_a_gpu(folder, monkeypatch):
    """On a GPU, auto packs masks only where prefix reuse is off (packed masks run full forwards)."""
    import torch

    from capsense.core import placement

    model, _ = load_model(str(folder), "float32")
    monkeypatch.setattr(placement, "input_device", lambda m: torch.device("cuda"))
    one = row_bytes(model.config, 512, 4) * 16  # one mask's 16 requests of 512 tokens in float32
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (5 * one, 10**12))  # free, and 4 masks' worth
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 6 * one)  # that torch's allocator holds
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: 2 * one)  # unused: 0.9 x 9 x 0.5 = 4.05
    assert placement.auto_masks_per_forward(model, 16, 512) == 1  # prefix reuse (the default): one mask per forward
    assert placement.auto_masks_per_forward(model, 16, 512, prefix_reuse=False) == 4  # free memory alone: 2


def test_checkpoint_export_with_a_device_map(folder, tmp_path):
    """Export loads through a device map; a map that offloads an edited layer is refused, nothing written."""
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from capsense.cli import main

    on_cpu = json.dumps({k: "cpu" for k in SPLIT})
    plain, mapped, refused = tmp_path / "plain", tmp_path / "mapped", tmp_path / "refused"
    for out, extra in ((plain, []), (mapped, ["--device-map", on_cpu])):
        r = CliRunner().invoke(main, ["export", str(folder), "--heads", "L1H2+L2H0", "--format", "checkpoint",
                                      "--out", str(out), *extra])
        assert r.exit_code == 0, r.output
    a, b = load_file(plain / "model.safetensors"), load_file(mapped / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    r = CliRunner().invoke(main, ["export", str(folder), "--heads", "L1H2", "--format", "checkpoint",
                                  "--out", str(refused), "--device-map", json.dumps(SPLIT)])
    assert r.exit_code != 0 and "layers [1] were offloaded by the device map" in r.output
    assert not refused.exists()


def test_a_memory_check_refuses_above_what_is_available_naming_the_parts_and_what_to_do(monkeypatch):
    """One refusal for every check of memory held beside the model (Gram matrices, a guided run's Fisher): what
    holds it, each part, what is available, then the caller's advice; exactly enough passes."""
    held, gib = {"cached hidden states": 2**30, "Gram matrices": 3 * 2**30}, 2**30
    assert check_cpu_memory(held, "calibrating", "calibrate less", available=4 * gib) == 4 * gib
    with pytest.raises(CapsenseError) as e:
        check_cpu_memory(held, "calibrating", "calibrate less", available=4 * gib - 1)
    assert str(e.value) == ("calibrating holds 4.0 GiB of CPU memory beside the model (Gram matrices 3.0 GiB, cached "
                            "hidden states 1.0 GiB), but 4.0 GiB is available: calibrate less")
    monkeypatch.setattr(placement, "available_cpu_memory", lambda: gib)  # default: what the system has
    with pytest.raises(CapsenseError, match="but 1.0 GiB is available: calibrate less"):
        check_cpu_memory(held, "calibrating", "calibrate less")


def test_a_device_memory_check_names_the_device_and_skips_where_torch_gives_no_figure(monkeypatch):
    held, gib = {"the largest matrix's solve": 3 * 2**30}, 2**30
    with pytest.raises(CapsenseError, match=r"^solving holds 3.0 GiB of cuda:1 memory beside the model .* 2.0 GiB"):
        placement.check_device_memory("cuda:1", held, "solving", "solve less", available=2 * gib)
    assert placement.available_device_memory("meta") is None  # no figure: the check is skipped, not guessed
    import torch

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (6 * gib, 80 * gib))  # a simulated GPU whose
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 5 * gib)  # allocator keeps 4 GiB unused
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: gib)
    assert placement.available_device_memory("cuda:1") == int(10 * gib * 0.9)
    assert placement.check_device_memory("meta", held, "solving", "solve less") == 3 * gib
    monkeypatch.setattr(placement, "available_cpu_memory", lambda: gib)  # the CPU's figure is the CPU check's
    with pytest.raises(CapsenseError, match="of cpu memory .* but 1.0 GiB is available: solve less"):
        placement.check_device_memory("cpu", held, "solving", "solve less")


def test_prefix_cache_and_float32_recast_fit_the_gpu_or_not(folder, monkeypatch):
    """The GPU memory rules on a simulated device: the cache of clean block inputs against half the free
    memory, a float32 copy of the model against half the total; both always fit off GPUs."""
    import torch

    from capsense.core import placement

    model, _ = load_model(str(folder), "bfloat16")
    assert placement.prefix_cache_fits(model, 10**9) and placement.recast_fits(model, "float32")  # CPU: not checked
    cfg = model.config
    per_token = cfg.num_hidden_layers * cfg.hidden_size * 2
    assert placement.prefix_cache_bytes(model, 1000) == 1000 * per_token
    n_params = sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(placement, "input_device", lambda m: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (800 * per_token, 10**12))  # free, and the
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 400 * per_token)  # allocator's unused 311.1:
    monkeypatch.setattr(torch.cuda, "memory_allocated",  # 0.9 x 1111.1 = 1000 tokens usable (free alone: 720)
                        lambda dev=None: 200 * per_token - 1000 * per_token // 9 - 10)
    assert placement.prefix_cache_fits(model, 500) and not placement.prefix_cache_fits(model, 501)
    total = type("Props", (), {"total_memory": 8 * n_params})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev=None: total)
    assert placement.recast_fits(model, "float32")  # 4 bytes per parameter: half of 8
    total.total_memory = 8 * n_params - 2
    assert not placement.recast_fits(model, "float32") and placement.recast_fits(model, "bfloat16")

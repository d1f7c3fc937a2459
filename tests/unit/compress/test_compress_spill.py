"""What a guided run held of the model's size in memory, on disk instead (capsense.compress.spill): the Fisher
diagonal, the original and the chosen candidate's target weights; the same run bit for bit."""

from __future__ import annotations

import gc
import os
import tempfile
from dataclasses import replace

import pytest
import torch
from _guided_run import run_guided_sequential
from conftest import make_char_tokenizer, make_tiny_model

import capsense.compress.guided_sequential as gs
from capsense.compress import select, sensitivity, spill
from capsense.compress.budget import Budget, uniform_budget
from capsense.compress.calibration import calibration_samples
from capsense.compress.guided import Guide
from capsense.compress.select import compress_guided
from capsense.compress.sequential import compress_sequential
from capsense.compress.targets import find_targets, restore

CALIBRATION, N = "prose,math", 6
GPTQ = {"method": "gptq", "bits": 3, "group_size": 16}
GEMMA = {"initializer_range": 0.2, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
         "sliding_window": 4}
MODELS = [("llama", {"initializer_range": 0.2}), ("gemma3_text", GEMMA)]


class InMemory(dict):
    """Round 16's scheme, for comparison: the tensors held in memory (copies, as ``snapshot`` took them)."""

    def __init__(self, what: str = "tensors") -> None:
        super().__init__()

    def write(self, group, tensors) -> None:
        self.update({k: v.detach().clone() for k, v in tensors.items()})

    def close(self) -> None:
        self.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fisher_holding_gradients(model, targets, samples, progress=None):
    """Round 16's Fisher diagonal: every target's gradient held (``.grad``) until the backward pass ends."""
    params = list(model.parameters())
    was = [p.requires_grad for p in params]
    fisher = {t.name: torch.zeros(t.shape, dtype=torch.float32) for t in targets}
    for p in params:
        p.requires_grad_(False)
    for t in targets:
        t.module.weight.requires_grad_(True)
    for ids in samples:
        x = torch.tensor([list(ids)])
        model.zero_grad(set_to_none=True)
        model(input_ids=x, labels=x, use_cache=False).loss.backward()
        for t in targets:
            g = t.module.weight.grad
            fisher[t.name] += (g.t() if t.transposed else g).detach().float().pow(2)
    model.zero_grad(set_to_none=True)
    for p, w in zip(params, was):
        p.requires_grad_(w)
    return fisher


def in_memory(monkeypatch) -> None:
    """Make the run hold everything in memory, as round 16 did."""
    monkeypatch.setattr(spill, "Spill", InMemory)
    monkeypatch.setattr(select, "Spill", InMemory)
    monkeypatch.setattr(sensitivity, "fisher_diagonal", fisher_holding_gradients)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # gpt2: Conv1D, stored [in, out]
def test_the_fisher_folds_each_gradient_as_it_arrives_to_the_same_sums(arch):
    model, tok = make_tiny_model(arch, initializer_range=0.2), make_char_tokenizer()
    targets = find_targets(model)
    samples, _ = calibration_samples("math", tok, 3, max_tokens=16)
    new = sensitivity.fisher_diagonal(model, targets, samples)
    old = fisher_holding_gradients(model, targets, samples)
    assert new.keys() == old.keys() and all(torch.equal(new[k], old[k]) and old[k].sum() > 0 for k in old)
    assert all(p.grad is None and p.requires_grad for p in model.parameters())  # no gradient left, flags restored
    assert all(not t.module.weight._post_accumulate_grad_hooks for t in targets)  # hooks removed


def test_a_spill_reads_back_the_bytes_written_and_removes_its_folder():
    model = make_tiny_model("gpt2").to(torch.bfloat16)
    targets = find_targets(model)
    before = {t.name: t.get().clone() for t in targets}
    s = spill.spill_weights(targets, spill.Spill("test"))
    folder = os.path.dirname(next(iter(s._file.values())))
    assert sorted(os.listdir(folder)) == [f"layer{i}.safetensors" for i in sorted({t.layer for t in targets})]
    layers = sorted({t.layer for t in targets})  # each file's size as counted (headers of bf16 [out, in] Conv1D weights)
    assert [os.path.getsize(os.path.join(folder, f"layer{i}.safetensors")) for i in layers] == spill.layer_files(targets)
    with torch.no_grad():
        for t in targets:
            t.set(torch.zeros(t.shape))
    restore(targets, s)
    assert all(torch.equal(t.get(), before[t.name]) and t.get().dtype == torch.bfloat16 for t in targets)
    assert s.nbytes >= sum(t.n_params * 2 for t in targets) and len(s) == len(targets)
    s.close()
    assert not os.path.exists(folder)
    lazy = spill.Lazy(["a"], lambda name: torch.ones(2))
    assert list(lazy) == ["a"] and torch.equal(lazy["a"], torch.ones(2))
    with pytest.raises(KeyError):
        lazy["b"]


@pytest.mark.parametrize("arch,overrides", MODELS)
@pytest.mark.parametrize("keep_first", [False, True])  # True: the allocation kept, put back from disk at the end
def test_guided_sequential_on_disk_is_the_in_memory_run(arch, overrides, keep_first, monkeypatch, tmp_path):
    guide = Guide(["math", "code"], samples=2, protect_top_k=0)
    if keep_first:
        paired = select.paired_vs_allocation
        monkeypatch.setattr(select, "paired_vs_allocation", lambda a, b: {**paired(a, b), "clears": False})
    with monkeypatch.context() as m:
        in_memory(m)
        old, old_allocs, (old_result, old_budget, old_al), _ = run_guided_sequential(arch, overrides, GPTQ, guide,
                                                                                     CALIBRATION, N)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = []
    monkeypatch.setattr(spill.Spill, "write", lambda self, g, t, w=spill.Spill.write: (made.append(g), w(self, g, t))[1])
    new, new_allocs, (new_result, new_budget, new_al), samples = run_guided_sequential(arch, overrides, GPTQ, guide,
                                                                                       CALIBRATION, N)
    assert [(n, a.info) for n, a in new_allocs] == [(n, a.info) for n, a in old_allocs]
    assert new_al.info["selection"] == old_al.info["selection"] and new_budget.describe() == old_budget.describe()
    assert [a.to_dict() for a in new_result.accounts] == [a.to_dict() for a in old_result.accounts]
    a, b = old.state_dict(), new.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    chosen = new_al.info["selection"]["chosen"]
    assert (chosen == "guided") == keep_first and len(made) > 0
    fresh = make_tiny_model(arch, **overrides)  # the chosen budget compressed once, from the original weights
    compress_sequential(fresh, new_budget, samples, "original")
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in b.items())
    del new_allocs, new_al
    gc.collect()
    assert os.listdir(tmp_path) == []  # every spill folder removed (the Fishers' once the plans are dropped)


def test_the_one_pass_run_on_disk_is_the_in_memory_run(monkeypatch):
    from capsense.compress.engine import calibrate
    from capsense.compress.select import guided_candidates

    def run():
        model, tok = make_tiny_model("llama", initializer_range=0.2), make_char_tokenizer()
        uni = uniform_budget(GPTQ)
        stats, _ = calibrate(model, tok, uni, CALIBRATION, N)
        guide = Guide(["math"], samples=2, protect_top_k=1)
        allocations = guided_candidates(model, tok, uni, stats, guide)
        return allocations, compress_guided(model, tok, uni, allocations, stats, guide), model.state_dict()

    with monkeypatch.context() as m:
        in_memory(m)
        old_allocs, (_, old_budget, old_al), old = run()
    new_allocs, (_, new_budget, new_al), new = run()
    assert [(n, a.info) for n, a in new_allocs] == [(n, a.info) for n, a in old_allocs]
    assert new_budget.describe() == old_budget.describe() and isinstance(new_budget, Budget)
    assert all(torch.equal(old[k], new[k]) for k in old)


def test_layer_groups_are_runs_of_whole_consecutive_layers():
    targets = find_targets(make_tiny_model("llama"))  # 3 layers
    assert [len(g) for g in spill.layer_groups(targets, 1)] == [len(targets)]
    for n in (2, 3, 7):
        groups = spill.layer_groups(targets, n)
        assert [t for g in groups for t in g] == targets and len(groups) == min(n, 3)
        assert all(len({t.layer for t in g}) >= 1 for g in groups)
        assert all(max(t.layer for t in a) < min(t.layer for t in b) for a, b in zip(groups, groups[1:]))


@pytest.mark.parametrize("arch,overrides", MODELS)
def test_the_fisher_summed_a_group_of_layers_at_a_time_ships_the_same_model(arch, overrides, monkeypatch):
    """``fisher_groups`` 3 (a layer per pass over the texts): the same Fisher, prices, choice and weights."""
    guide = Guide(["math", "code"], samples=2, protect_top_k=0)
    one, one_allocs, (_, one_budget, one_al), samples = run_guided_sequential(arch, overrides, GPTQ, guide, CALIBRATION, N)
    fisher, layers = sensitivity.fisher_diagonal, []
    monkeypatch.setattr(sensitivity, "fisher_diagonal",
                        lambda model, targets, *a, **k: (layers.append({t.layer for t in targets}), fisher(model, targets, *a, **k))[1])
    three, three_allocs, (_, three_budget, three_al), _ = run_guided_sequential(arch, overrides, GPTQ, Guide(
        ["math", "code"], samples=2, protect_top_k=0, fisher_groups=3), CALIBRATION, N)
    assert layers == [{0}, {1}, {2}] * 2  # each kept capability's Fisher, one layer per pass over its texts
    assert [(n, a.info) for n, a in three_allocs] == [(n, a.info) for n, a in one_allocs]
    assert three_al.info["selection"] == one_al.info["selection"] and three_budget.describe() == one_budget.describe()
    a, b = one.state_dict(), three.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    need = {g: gs.check_guided_memory(three, uniform_budget(GPTQ), samples, Guide(["math"], fisher_groups=g))
            for g in (1, 3)}
    targets = find_targets(three)
    layer = max(sum(4 * t.n_params for t in targets if t.layer == i) for i in range(3))
    backward = {g: sum(sensitivity.backward_memory(three, layers=first).values()) for g, first in ((1, None), (3, {0}))}
    assert need[1]["sensitivity"] == 4 * sum(t.n_params for t in targets) + layer + backward[1]
    # one layer's sums (float32, as the model) and its gradients; the first run's pass saves the most activations
    assert need[3]["sensitivity"] == 2 * layer + backward[3]
    assert need[1]["pricing"] == need[3]["pricing"] and need[1]["compressing"] == need[3]["compressing"]


def test_a_spill_the_temporary_disk_cannot_hold_is_refused_before_anything_runs(monkeypatch, tmp_path, tiny_model_dir):
    """The disk check refuses one byte short of its count (:func:`test_the_disk_check_counts_the_spills_measured_peak`)
    naming $TMPDIR, and the command refuses before anything is written or computed."""
    import shutil
    from collections import namedtuple

    from click.testing import CliRunner

    from capsense.cli import main
    from capsense.errors import CapsenseError

    model = make_tiny_model("llama")
    uni = uniform_budget(GPTQ)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(0, 0, 10**15))
    need = gs.check_guided_disk(model, uni, Guide(["math"]))
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(0, 0, need))
    assert gs.check_guided_disk(model, uni, Guide(["math"])) == need  # exactly enough
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(0, 0, need - 1))
    with pytest.raises(CapsenseError, match="point TMPDIR at a disk with room"):
        gs.check_guided_disk(model, uni, Guide(["math"]))
    for extra in ([], ["--sequential"]):
        monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(0, 0, 1))
        r = CliRunner().invoke(main, ["compress", str(tiny_model_dir), "--method", "gptq", "--bits", "3", "--group-size",
                                      "32", "--keep", "math", "--calibration-samples", "4", "--out", str(tmp_path / "no"),
                                      *extra])
        assert r.exit_code == 1 and "TMPDIR" in r.output and r.output.count("Error") == 1, r.output
        assert not (tmp_path / "no").exists()


#: (guide, the Fishers its run sums) where round 17's count (a Fisher per kept capability and the generic one) was
#: above the exact one; GPTQ protects no heads by default
FEWER_FISHERS = [(Guide(["math", "code"], sensitivity="flat"), []),
                 (Guide(["math", "code"], sensitivity="generic"), ["prose"]),
                 (Guide(["prose"], sensitivity="generic", protect_top_k=1), ["prose"]),  # the generic text kept: one
                 (Guide(["math"], sensitivity="measured", protect_top_k=1), ["math"]),  # heads picked by its Fisher
                 (Guide(["math", "code"], sensitivity="flat", protect_top_k=1, heads="L0H1"), [])]  # heads given


@pytest.mark.parametrize("guide,sources", FEWER_FISHERS)
def test_the_disk_check_counts_exactly_the_fishers_the_run_writes(guide, sources, monkeypatch, tmp_path):
    """Planning the run (both pricings, as guided_candidates_sequential does) writes exactly the Fishers counted,
    fewer than round 17's upper bound: without weight copies (no check against uniform) the check counts the
    measured peak of their files, accepts it and refuses one byte short."""
    import shutil
    from collections import namedtuple

    from capsense.compress.guided import fisher_sources, plan_guided
    from capsense.errors import CapsenseError

    model, tok, uni = make_tiny_model("llama"), make_char_tokenizer(), uniform_budget(GPTQ)
    assert fisher_sources(guide, gs.parse_setting(GPTQ)) == sources and len(sources) < len(guide.keep) + 1
    written = []

    class Recorded(spill.Spill):
        def __init__(self, what: str = "tensors") -> None:
            super().__init__(what)
            written.append(what)

    monkeypatch.setattr(spill, "Spill", Recorded)

    def plans():
        cache: dict = {}
        pricings = gs._pricings(uni, replace(guide, samples=2))
        return len([plan_guided(model, tok, uni, g, lambda _m: None, cache) for _, g in pricings])

    made, peak, _ = spill_peak(plans, str(tmp_path))  # the plans dropped: their Fishers' folders removed
    assert written == [f"fisher-{s}" for s in sources] and made == (2 if guide.sensitivity != "measured" else 1)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(0, 0, peak))
    alone = replace(guide, check_uniform=False)
    assert gs.check_guided_disk(model, uni, alone, str(tmp_path)) == peak
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(0, 0, peak - 1))
    with pytest.raises(CapsenseError, match="point TMPDIR at a disk with room"):
        gs.check_guided_disk(model, uni, alone, str(tmp_path))


def spill_peak(run, root):
    """``run()`` with the temporary folder ``root``: (its return value, the most bytes its spills took of the disk at
    once: each file and each spill's folder rounded up to the disk's block, {path: bytes} then). Looked at after every
    file a spill writes is complete, before it replaces the one of the same name (the most of a write on disk); the
    spills write nothing else and delete only. No file may be mapped after its deletion (it would keep its blocks
    unseen). Nothing else is written under ``root`` (torch makes an empty ``torchinductor_*`` folder there)."""
    import safetensors.torch as st

    block, peak, at = os.statvfs(root).f_frsize, 0, {}
    save = st.save_file

    def look():
        nonlocal peak, at
        now = {}
        for top in os.listdir(root):
            if top.startswith("capsense-"):
                now[top] = os.path.getsize(os.path.join(root, top))
                folder = os.path.join(root, top)
                now |= {f"{top}/{f}": os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)}
        if sum(-(-n // block) * block for n in now.values()) > peak:
            peak, at = sum(-(-n // block) * block for n in now.values()), now
        if os.path.exists("/proc/self/maps"):  # Linux
            with open("/proc/self/maps") as maps:
                assert not [line for line in maps if root in line and "(deleted)" in line]

    def saving(*a, **k):
        save(*a, **k)
        look()

    with pytest.MonkeyPatch.context() as m:
        m.setattr(tempfile, "tempdir", root)
        m.setattr(st, "save_file", saving)
        out = run()
        gc.collect()
    assert not [f for _, _, fs in os.walk(root) for f in fs] and not [d for d in os.listdir(root) if "capsense" in d]
    return out, peak, at


def _guided_one_pass(arch, overrides, guide) -> str:
    """A guided run in one pass on a tiny ``arch`` model (config ``overrides``), as the pipeline runs it: the name of
    the candidate shipped."""
    from capsense.compress.engine import calibrate
    from capsense.compress.select import guided_candidates

    model, tok = make_tiny_model(arch, **overrides), make_char_tokenizer()
    uni = uniform_budget(GPTQ)
    stats, _ = calibrate(model, tok, uni, CALIBRATION, N)
    shipped = compress_guided(model, tok, uni, guided_candidates(model, tok, uni, stats, guide), stats, guide)
    return shipped[2].info["selection"]["chosen"]


#: (arch, overrides, kept capabilities, whether a challenger clears the allocation, the phase at the peak):
#: a challenger that clears replaces the chosen weights on disk (guided-rtn, not the last candidate); three kept
#: capabilities' Fishers outweigh the two weight copies
PEAKS = [("gemma3_text", GEMMA, ["math"], True, "choosing"),
         ("llama", MODELS[0][1], ["math", "code", "prose"], False, "planning"),
         ("llama", MODELS[0][1], ["math"], False, "choosing")]


@pytest.mark.parametrize("sequential", [False, True])
@pytest.mark.parametrize("arch,overrides,keep,clears,phase", PEAKS)
def test_the_disk_check_counts_the_spills_measured_peak(arch, overrides, keep, clears, phase, sequential, monkeypatch,
                                                         tmp_path):
    """The disk check counts the larger of the two phases' spills (round 18 added them: the Fishers are removed
    before the weight copies are written), files as written: a run reaching the count is accepted on exactly its
    measured peak and refused one byte short; one whose choice never replaces the chosen weights stays a layer's
    file under it."""
    import shutil
    from collections import namedtuple

    from capsense.errors import CapsenseError

    guide = Guide(keep, samples=2, protect_top_k=0)
    paired = select.paired_vs_allocation
    monkeypatch.setattr(select, "paired_vs_allocation", lambda a, b: {**paired(a, b), "clears": clears})

    def run():
        if not sequential:
            return _guided_one_pass(arch, overrides, guide)
        return run_guided_sequential(arch, overrides, GPTQ, guide, CALIBRATION, N).shipped[2].info["selection"]["chosen"]

    chosen, peak, at = spill_peak(run, str(tmp_path))
    assert (chosen == "guided") != clears  # clears: guided-rtn replaced guided on disk (uniform, last, may win after)
    assert {f.split("-")[1] for f in at} == ({"fisher"} if phase == "planning" else {"original", "chosen"}), at
    model, uni = make_tiny_model(arch, **overrides), uniform_budget(GPTQ)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(0, 0, 10**15))
    need = gs.check_guided_disk(model, uni, guide, str(tmp_path))
    layer = max(spill.layer_files(find_targets(model), block=os.statvfs(tmp_path).f_frsize))
    assert peak == (need if clears or phase == "planning" else need - layer)
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(0, 0, need))  # the measured peak when it reaches it
    assert gs.check_guided_disk(model, uni, guide, str(tmp_path)) == need  # round 18 counted Fishers + copies: refused
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(0, 0, need - 1))
    with pytest.raises(CapsenseError, match="point TMPDIR at a disk with room.*--keep.*--no-check-uniform"):
        gs.check_guided_disk(model, uni, guide, str(tmp_path))

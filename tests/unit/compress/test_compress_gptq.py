"""GPTQ and SparseGPT against their defining properties and against RTN / Wanda on correlated inputs."""

from __future__ import annotations

import pytest
import torch

from capsense.errors import BudgetError
from capsense.compress.gptq import gptq_quantize, sparsegpt_output_errors, sparsegpt_prune
from capsense.compress.prune import apply_mask, mask_from_scores, wanda_scores
from capsense.compress.quantize import rtn_quantize


def _data(n_out=24, n_in=64, tokens=400, seed=0):
    """A weight and correlated, unevenly scaled inputs (where error compensation matters)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_out, n_in, generator=g)
    mix = torch.randn(n_in, n_in, generator=g) / n_in**0.5 + torch.eye(n_in)
    scale = torch.linspace(0.2, 3, n_in)[torch.randperm(n_in, generator=g)]  # outlier features anywhere
    x = torch.randn(tokens, n_in, generator=g) @ mix * scale
    return w, x, (x.T @ x).double()


def _out_err(w, w2, x):
    return float(((w - w2) @ x.T).pow(2).sum())


@pytest.mark.parametrize("bits,group,act_order", [(3, 16, True), (3, 16, False), (4, 32, True), (4, 0, False), (2, 64, True)])
def test_gptq_codes_lie_on_the_group_grid_and_beat_rtn(bits, group, act_order):
    w, x, gram = _data()
    q, scales = gptq_quantize(w, gram, bits, group, act_order=act_order)
    g = 64 if group == 0 else group
    assert scales.shape == (24, 64 // g)
    assert torch.equal(scales.to(torch.bfloat16).float(), scales)  # storable as 16-bit scales
    codes = q / scales.repeat_interleave(g, dim=1)
    q_max = 2 ** (bits - 1) - 1
    assert torch.equal(codes, codes.round()) and codes.abs().max() <= q_max
    assert _out_err(w, q, x) < 0.8 * _out_err(w, rtn_quantize(w, bits, group), x)


def test_gptq_without_input_correlation_is_rtn():
    """With G = I nothing is compensated (U is diagonal): GPTQ in natural order is exactly RTN."""
    w, _, _ = _data()
    q, _ = gptq_quantize(w, torch.eye(64, dtype=torch.float64), 4, 16, act_order=False)
    assert torch.equal(q, rtn_quantize(w, 4, 16))


def test_dead_inputs_get_zero_weight():
    w, x, _ = _data()
    x[:, 5] = 0
    q, _ = gptq_quantize(w, (x.T @ x).double(), 4, 16)
    pruned, keep = sparsegpt_prune(w, (x.T @ x).double(), 0.5)
    assert bool((q[:, 5] == 0).all()) and bool((pruned[:, 5] == 0).all())


@pytest.mark.parametrize("density", [0.5, 0.3, 0.77])
def test_sparsegpt_keeps_exact_row_counts_and_beats_wanda(density):
    w, x, gram = _data(n_in=200)  # two blocks, the second partial
    pruned, keep = sparsegpt_prune(w, gram, density)
    assert (keep.sum(1) == round(density * 200)).all()
    assert bool((pruned[~keep] == 0).all())
    wanda = apply_mask(w, mask_from_scores(wanda_scores(w, x.pow(2).sum(0).sqrt()), density, "row"))
    assert _out_err(w, pruned, x) < 0.9 * _out_err(w, wanda, x)


def test_sparsegpt_two_four_pattern():
    w, x, gram = _data()
    pruned, keep = sparsegpt_prune(w, gram, 0.5, "2:4")
    assert (keep.view(24, 16, 4).sum(2) == 2).all()
    assert bool((pruned[~keep] == 0).all())
    scores = wanda_scores(w, x.pow(2).sum(0).sqrt()).view(24, 16, 4)  # Wanda's 2:4 mask, uncompensated
    wanda = torch.zeros(24, 16, 4, dtype=torch.bool).scatter_(2, scores.topk(2, dim=2).indices, True).view(24, 64)
    assert _out_err(w, pruned, x) < 0.9 * _out_err(w, apply_mask(w, wanda), x)
    with pytest.raises(BudgetError, match="2:4 pattern"):
        sparsegpt_prune(w, gram, 0.6, "2:4")
    with pytest.raises(BudgetError, match="valid patterns"):
        sparsegpt_prune(w, gram, 0.5, "4:8")


def test_bad_gram_and_damp_are_refused():
    w, _, gram = _data()
    with pytest.raises(BudgetError, match="Gram matrix has shape"):
        gptq_quantize(w, gram[:10, :10], 4)
    with pytest.raises(BudgetError, match="damp"):
        sparsegpt_prune(w, gram, 0.5, damp=0)


def test_sparsegpt_rows_keep_the_protected_columns_above_the_density():
    from capsense.compress.calibration import InputStats
    from capsense.compress.compensated import SparseGPTSetting
    from capsense.compress.protect import Protection

    w, x, _ = _data(n_in=200)
    stats = InputStats(200)
    stats.add(x, gram=True)
    cols = torch.zeros(200, dtype=torch.bool)
    cols[150:] = True  # 50 protected columns, all in the last block, above round(0.1 * 200) = 20
    out = SparseGPTSetting("sparsegpt", 0.1).apply("m", w, stats, Protection(cols=cols), 16)
    keep = out.weight != 0
    assert (keep.sum(1) == 50 + 15).all() and torch.equal(out.weight[:, cols], w[:, cols])  # 10% of the 150 free, on top
    with pytest.raises(BudgetError, match="m: .*whole groups of four"):  # 150:200 splits the group 148:152
        SparseGPTSetting("sparsegpt", 0.5, "2:4").apply("m", w, stats, Protection(cols=cols), 16)


# -- as settings (registry, calibration, exact sizes) ------------------------------------------

def test_gptq_and_sparsegpt_settings_parse_and_refuse():
    from capsense.compress.methods import parse_setting
    from capsense.errors import BudgetError

    g = parse_setting({"method": "gptq", "bits": 3, "group_size": 64, "damp": 0.05, "act_order": False})
    assert g.label == "gptq@3b/g64/damp0.05/natural" and g.needs_gram and g.calibrated
    assert parse_setting({"method": "gptq", "bits": 4}).to_dict() == {
        "method": "gptq", "bits": 4, "group_size": 128, "damp": 0.01, "act_order": True}
    s = parse_setting({"method": "sparsegpt", "density": 0.5, "scope": "2:4"})
    assert s.label == "sparsegpt@d0.5/2:4" and s.size((8, 64), None, 16) == (256, 256 * 16)
    for bad, message in [({"method": "gptq"}, "gptq needs bits"), ({"method": "gptq", "bits": 4, "damp": 2}, "damp 2"),
                         ({"method": "gptq", "bits": 4, "act_order": "yes"}, "act_order"),
                         ({"method": "sparsegpt", "density": 0.5, "scope": "matrix"}, "valid scopes are row, 2:4"),
                         ({"method": "sparsegpt", "density": 0.5, "bits": 4}, "bits does not apply to sparsegpt"),
                         ({"method": "wanda", "density": 0.5, "damp": 0.1}, "damp does not apply to wanda")]:
        with pytest.raises(BudgetError, match=message):
            parse_setting(bad)


@pytest.mark.parametrize("setting", [{"method": "gptq", "bits": 3, "group_size": 16},
                                     {"method": "sparsegpt", "density": 0.4}])
def test_compensated_methods_in_the_engine_beat_their_plain_twins(setting, calib_file):
    """On the tiny model: exact accounting, and lower layer-output error than RTN / Wanda at equal size."""
    from conftest import make_char_tokenizer, make_tiny_model

    from capsense.compress.budget import uniform_budget
    from capsense.compress.calibration import InputStats
    from capsense.compress.engine import calibrate, compress_model
    from capsense.compress.targets import find_targets

    twin = {"gptq": {"method": "rtn", "bits": 3, "group_size": 16}, "sparsegpt": {"method": "wanda", "density": 0.4}}
    errs, sizes = [], []
    for s in (setting, twin[setting["method"]]):
        model = make_tiny_model("llama")
        dense = {t.name: t.get().clone() for t in find_targets(model)}
        b = uniform_budget(s)
        stats, _ = calibrate(model, make_char_tokenizer(), uniform_budget({**setting}), str(calib_file), 8)
        result = compress_model(model, b, stats)
        sizes.append(result.summary["size_ratio"])
        errs.append(sum(float(((dense[t.name] - t.get()) @ stats[t.name].gram.float() * (dense[t.name] - t.get())).sum())
                        for t in find_targets(model)))
        assert all(isinstance(stats[t.name], InputStats) for t in find_targets(model))
    assert sizes[0] == sizes[1]
    assert errs[0] < 0.9 * errs[1]


def test_gptq_setting_keeps_protected_heads_at_full_precision():
    from capsense.compress.calibration import InputStats
    from capsense.compress.compensated import GPTQSetting
    from capsense.compress.protect import Protection

    w, x, _ = _data()
    prot = Protection(rows=torch.arange(24) < 4, cols=torch.arange(64) >= 60)
    out = GPTQSetting("gptq", 3, 16).apply("m", w, InputStats.from_inputs(x), prot, 16)
    assert torch.equal(out.weight[:4], w[:4]) and torch.equal(out.weight[:, 60:], w[:, 60:])
    assert out.scales is None  # a partly protected matrix has no packed form
    assert (out.stored, out.bits) == GPTQSetting("gptq", 3, 16).size((24, 64), prot, 16)
    assert len(torch.unique(out.weight[4:, :60])) > 8 and not torch.equal(out.weight[4:, :60], w[4:, :60])


def test_gptq_output_errors_solve_all_levels_as_gptq_does():
    """The stacked solve of several levels is each level's GPTQ, exactly in float64, closely in float32."""
    from capsense.compress.gptq import gptq_output_errors

    w, x, gram = _data()
    gram[5, :] = gram[:, 5] = 0.0  # a dead input column
    levels = [(3, 16), (4, 0), (2, 64), (6, 32)]
    exact = gptq_output_errors(w, gram, levels, dtype=torch.float64)
    fast = gptq_output_errors(w, gram, levels)
    for (bits, group), e, f in zip(levels, exact, fast):
        dw = w.double() - gptq_quantize(w, gram, bits, group)[0].double()
        assert torch.allclose(e, ((dw @ gram) * dw).sum(1), rtol=1e-9)
        assert torch.allclose(f.double(), e, rtol=1e-3)
    assert bool((exact[2] > exact[0]).all() and (exact[0] > exact[3]).all())  # fewer bits, more error per row


def test_gptq_levels_are_priced_by_the_fisher_weighted_output_error_of_gptq():
    """With a Kronecker-exact Fisher (F_ij = r_i G_jj), a level's price is sum_i r_i |dW_i X^T|^2 of
    GPTQ's own result; RTN's weight error would price it higher than GPTQ's output error says."""
    from capsense.compress.calibration import InputStats
    from capsense.compress.compensated import GPTQSetting

    w, x, gram = _data()
    stats = InputStats.from_inputs(x)
    r = torch.linspace(0.5, 2.0, w.shape[0]).double() / len(x)
    fisher = (r[:, None] * torch.diag(stats.gram)[None, :]).float()
    levels = [GPTQSetting("gptq", 3, 16), GPTQSetting("gptq", 4, 16), GPTQSetting("gptq", 3, 16, act_order=False)]
    cache: dict = {}
    priced = levels[0].level_costs(levels, "m", w, fisher, stats, None, 16, cache)
    for (s, bits, cost), level in zip(priced, levels):
        assert s == level and bits == level.size(tuple(w.shape), None, 16)[1]
        q = gptq_quantize(w, stats.gram, s.bits, s.group_size, act_order=s.act_order)[0]
        by_output = float((r * ((w - q).double() @ x.T.double()).pow(2).sum(1)).sum())
        assert cost == pytest.approx(by_output, rel=1e-3)
        rtn_priced = float((fisher * (w - rtn_quantize(w, s.bits, s.group_size)).pow(2)).sum())
        assert cost < rtn_priced
    assert priced[1][2] < priced[0][2]
    assert len(cache) == 3  # solved once per level; a second allocation reuses them
    again = levels[0].level_costs(levels, "m", w, 2 * fisher, stats, None, 16, cache)
    assert [c for *_, c in again] == pytest.approx([2 * c for *_, c in priced]) and len(cache) == 3


def test_sparsegpt_output_errors_match_separate_solves():
    """The stacked solve of several densities gives, in float64, each density's own SparseGPT result:
    the per-row output error ``dW G dW^T`` of :func:`sparsegpt_prune` (with protection both solve the
    free block: tests/unit/compress/test_compress_protect.py)."""
    torch.manual_seed(3)
    w, x = torch.randn(6, 32), torch.randn(80, 32)
    gram = (x.T @ x).double()
    gram[5, :], gram[:, 5] = 0.0, 0.0  # a dead input column
    densities = [0.25, 0.5, 0.775, 1.0]
    solved = sparsegpt_output_errors(w, gram, densities, dtype=torch.float64)
    assert solved.shape == (4, 6)
    for d, errs in zip(densities, solved):
        new, _ = sparsegpt_prune(w, gram, d)
        dw = w.double() - new.double()
        assert torch.allclose(errs, ((dw @ gram) * dw).sum(1), rtol=1e-5, atol=1e-6)
    assert torch.all(solved[-1] == 0) and bool((solved[0] >= solved[1]).all())
    fast = sparsegpt_output_errors(w, gram, densities)
    assert torch.allclose(fast.double(), solved, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("shape", [(96, 64), (128, 256), (192, 576), (12, 320)])
def test_the_stacked_solves_hold_what_output_errors_memory_counts(shape):
    """The tensor bytes a stacked solve holds at its peak (every aten allocation followed to its free:
    :class:`~capsense.core.memory.TensorPeak`) are at most what the guided memory check counts for it, and not
    far below: round 19's solve held 6.2-6.6 stacked copies (every column's scale and ``W - Q`` beside the stacked
    weight, the output error's product a second copy): GPTQ's 1.2-1.3x this count on the two larger shapes. (The
    count bounds each part by the most any step holds: 0.6-0.9 of it is held on these shapes, 0.70-0.86 on
    SmolLM2's.)"""
    from capsense.compress.gptq import gptq_output_errors, output_errors_memory
    from capsense.core.memory import TensorPeak

    w, _, gram = _data(*shape)
    levels = [(b, g) for b in (2, 3, 4, 8) for g in (0, 16, 32)]
    densities = [0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    for solve, n in ((lambda: gptq_output_errors(w, gram, levels), len(levels)),
                     (lambda: sparsegpt_output_errors(w, gram, densities), len(densities))):
        with TensorPeak() as peak:
            solve()
        counted = output_errors_memory(n, *shape)
        assert 0.55 * counted <= peak.peak <= counted, (peak.peak / counted)


# -- where the solve runs (solve_on: layer) ---------------------------------------------------------

def test_every_solve_runs_where_the_weight_is():
    """No tensor of a solve is made on the CPU behind the weight's back: on the ``meta`` device (shapes only, no
    data, and an error on any CPU tensor mixed in or any per-column host sync) every solve and pricing function runs
    and returns on the weight's device, the Gram matrix given on the CPU as calibration keeps it. What a GPU solve
    (``solve_on: layer``) needs; the CPU results of the same code are pinned by the tests above."""
    from capsense.compress.gptq import gptq_output_errors

    w, _, gram = _data(n_out=16, n_in=32)
    meta = w.to("meta")
    outs = [*gptq_quantize(meta, gram, 4, 8), *gptq_quantize(meta, gram, 3, 8, act_order=False),
            *sparsegpt_prune(meta, gram, 0.5), *sparsegpt_prune(meta, gram, 0.5, "2:4"),
            gptq_output_errors(meta, gram, [(4, 8), (3, 16)]), sparsegpt_output_errors(meta, gram, [0.5, 0.3])]
    assert [o.device.type for o in outs] == ["meta"] * len(outs)
    with pytest.raises(RuntimeError):  # the check can fail: a CPU tensor mixed into a meta solve is refused
        torch.zeros(3, device="meta") + torch.ones(3)


@pytest.mark.parametrize("setting", [{"method": "gptq", "bits": 3, "group_size": 16, "solve_on": "layer"},
                                     {"method": "sparsegpt", "density": 0.5, "solve_on": "layer"}])
def test_solve_on_layer_applies_on_the_weights_device_and_records_itself(setting):
    """The setting solves the weight it is given where it is (protected block included) and says so in its label
    and record; on the CPU it is the CPU solve, bit for bit."""
    from capsense.compress.calibration import InputStats
    from capsense.compress.methods import parse_setting
    from capsense.compress.protect import Protection

    w, x, _ = _data()
    s, cpu = parse_setting(setting), parse_setting({k: v for k, v in setting.items() if k != "solve_on"})
    assert s.solves_on_layer and not cpu.solves_on_layer and s.label == cpu.label + "/on-layer"
    assert s.to_dict() == {**cpu.to_dict(), "solve_on": "layer"} and "solve_on" not in cpu.to_dict()
    assert parse_setting(s.to_dict()) == s and all(level.solve_on == "layer" for level in s.levels())
    stats, prot = InputStats.from_inputs(x), Protection(rows=torch.arange(24) < 4, cols=torch.arange(64) >= 60)
    assert torch.equal(s.apply("m", w, stats, prot, 16).weight, cpu.apply("m", w, stats, prot, 16).weight)
    if s.family == "quant":  # SparseGPT's apply reads its kept count back (one host read per matrix): not on meta
        out = s.apply("m", w.to("meta"), stats, None, 16)
        assert out.weight.device.type == "meta" and out.scales.device.type == "meta"
    errors = s._output_errors(s.levels()[:2], "m", w.to("meta"), stats.gram, (torch.ones(24, dtype=torch.bool),
                                                                              torch.ones(64, dtype=torch.bool)), {})
    assert {e.device.type for e in errors.values()} == {"meta"}


def test_solve_on_is_refused_where_it_changes_nothing(tmp_path):
    from capsense.compress.engine import plan
    from capsense.compress.budget import uniform_budget
    from capsense.compress.methods import parse_setting
    from capsense.compress.engine import check_solve_on
    from capsense.compress.request import check_request
    from capsense.errors import CapsenseError
    from conftest import make_tiny_model

    for bad, message in [({"method": "rtn", "bits": 4, "solve_on": "layer"}, "solve_on does not apply to rtn"),
                         ({"method": "gptq", "bits": 4, "solve_on": "gpu"}, "valid are cpu, layer")]:
        with pytest.raises(BudgetError, match=message):
            parse_setting(bad)
    with pytest.raises(CapsenseError, match="without a device map every layer is on the CPU"):
        check_request("smollm2-135m", tmp_path / "out", False, None, "gptq", None, None, "layer")
    model = make_tiny_model("llama")
    with pytest.raises(CapsenseError, match=r"all \d+ it would solve are on the CPU"):
        check_solve_on(plan(model, uniform_budget({"method": "gptq", "bits": 4, "group_size": 16, "solve_on": "layer"})))
    check_solve_on(plan(model, uniform_budget({"method": "gptq", "bits": 4, "group_size": 16})))  # the default: fine


def test_solve_on_layer_is_refused_where_the_largest_solve_does_not_fit_its_device():
    """Each device's largest solve against what it has free, before any weight changes (here the ``meta`` device
    stands for a GPU, its free memory given); a guided pricing's stacked float32 levels are counted the same way."""
    from capsense.compress.budget import uniform_budget
    from capsense.compress.engine import check_solve_on, plan
    from capsense.compress.gptq import output_errors_memory
    from capsense.compress.targets import find_targets
    from capsense.errors import CapsenseError
    from conftest import make_tiny_model

    model = make_tiny_model("llama").to("meta")
    planned = plan(model, uniform_budget({"method": "sparsegpt", "density": 0.5, "solve_on": "layer"}))
    need = max(output_errors_memory(1, *t.shape, 8) for t in find_targets(model))
    check_solve_on(planned, available=lambda device: need)  # fits exactly
    with pytest.raises(CapsenseError, match=r"`solve_on` layer holds .* GiB of meta memory .*the largest matrix's "
                                            r"solve.* leave `solve_on` out") as e:
        check_solve_on(planned, available=lambda device: need - 1)
    stacked = max(output_errors_memory(18, *t.shape, 4) for t in find_targets(model))
    assert stacked > need
    check_solve_on(planned, 18, 4, available=lambda device: stacked)
    with pytest.raises(CapsenseError):
        check_solve_on(planned, 18, 4, available=lambda device: stacked - 1)
    assert "meta" in str(e.value)

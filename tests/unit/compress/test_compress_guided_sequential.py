"""Guided compression one decoder layer at a time (capsense.compress.guided_sequential): the one-pass guided
result (prices, allocations, the chosen candidate, the weights) with one layer's statistics held at a time."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from click.testing import CliRunner
from _guided_run import run_guided_sequential
from conftest import make_char_tokenizer, make_tiny_model

from capsense.compress.gptq import output_errors_memory
import capsense.compress.guided_sequential as gs
from capsense.cli import main
from capsense.compress.budget import uniform_budget
from capsense.compress.calibration import InputStats, calibration_samples, check_gram_memory
from capsense.compress.engine import calibrate
from capsense.compress.guided import Guide
from capsense.compress.select import compress_guided, guided_candidates
from capsense.compress.sensitivity import backward_memory
from capsense.compress.sequential import cached_bytes, check_sequential
from capsense.compress.targets import find_targets
from capsense.errors import CapsenseError

CALIBRATION, N = "prose,math", 6
GPTQ = {"method": "gptq", "bits": 3, "group_size": 16}
SPARSEGPT = {"method": "sparsegpt", "density": 0.5}
GEMMA_MIXED = {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "sliding_window": 4}
#: initializer range 0.2: outputs sharp enough that the levels' prices and the candidates' dL differ visibly
CASES = [("llama", {"initializer_range": 0.2}, GPTQ, 0),
         ("gemma3_text", {"initializer_range": 0.2, **GEMMA_MIXED}, GPTQ, 0),
         ("llama", {"initializer_range": 0.2}, SPARSEGPT, 1),  # one protected head: protections priced and applied
         ("llama", {"initializer_range": 0.2}, {"method": "svd-llm", "ratio": 0.5}, 1),  # low rank: factors per layer
         ("llama", {"initializer_range": 0.2}, {"method": "wanda", "density": 0.5}, 1)]  # no Gram: input norms


def _one_pass(arch, overrides, setting, guide):
    model, tok = make_tiny_model(arch, **overrides), make_char_tokenizer()
    uni = uniform_budget(setting)
    stats, _ = calibrate(model, tok, uni, CALIBRATION, N)
    allocations = guided_candidates(model, tok, uni, stats, guide)
    return model, allocations, compress_guided(model, tok, uni, allocations, stats, guide)


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("arch,overrides,setting,top_k", CASES)
def test_guided_sequential_is_the_one_pass_guided_run(arch, overrides, setting, top_k):
    """Same prices (estimated cost to the bit), allocations, candidates' dL, choice and weights."""
    guide = Guide(["math"], samples=2, protect_top_k=top_k)
    one, one_allocs, (one_result, one_budget, one_al) = _one_pass(arch, overrides, setting, guide)
    seq, seq_allocs, (seq_result, seq_budget, seq_al), _ = run_guided_sequential(arch, overrides, setting, guide,
                                                                                 CALIBRATION, N)
    proxy = {"gptq": ["guided-rtn"], "sparsegpt": ["guided-wanda"]}.get(setting["method"], [])
    assert [n for n, _ in seq_allocs] == [n for n, _ in one_allocs] == ["guided", *proxy]
    for (_, a), (_, b) in zip(one_allocs, seq_allocs):
        assert a.info == b.info and a.budget.describe() == b.budget.describe()
    assert len(set(one_allocs[0][1].info["per_matrix"].values())) > 1  # a mixed allocation, not the uniform one
    assert (top_k > 0) == (one_allocs[0][1].info["protected_heads"] is not None)
    assert one_al.info["selection"] == seq_al.info["selection"]  # the same dL per candidate, the same choice
    assert one_budget.describe() == seq_budget.describe() and seq_result.sequential["propagate"] == "original"
    assert [a.to_dict() for a in one_result.accounts] == [a.to_dict() for a in seq_result.accounts]
    a, b = _weights(one), _weights(seq)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_prices_from_unpropagated_inputs_would_not_match(monkeypatch):
    """The test above can fail: layers priced on the first layer's inputs (no outputs passed on) price
    the later layers' levels differently."""
    guide = Guide(["math"], samples=2, protect_top_k=0)
    tok, uni = make_char_tokenizer(), uniform_budget(GPTQ)
    model = make_tiny_model("llama", initializer_range=0.2)
    stats, _ = calibrate(model, tok, uni, CALIBRATION, N)
    one = guided_candidates(model, tok, uni, stats, guide)
    run = gs.run_layer
    monkeypatch.setattr(gs, "run_layer", lambda layer, cached, i, j: (run(layer, cached, i, j), cached.hidden[j])[1])
    samples, _ = calibration_samples(CALIBRATION, tok, N)
    seq = gs.guided_candidates_sequential(make_tiny_model("llama", initializer_range=0.2), tok, uni, samples, guide)
    assert one[0][1].info["estimated_cost"] != seq[0][1].info["estimated_cost"]


def test_pricing_holds_one_layers_statistics_and_one_fisher(monkeypatch):
    """At each layer's pricing, 4 InputStats are alive (llama's distinct inputs of one layer), and both
    pricings read the same summed Fisher diagonal (one copy; the per-capability ones dropped)."""
    seen = []
    price = gs.price_matrices

    def spying(plan, targets, stats, cache=None):
        gc.collect()
        seen.append((sum(isinstance(o, InputStats) for o in gc.get_objects()), {t.layer for t in targets}, plan))
        return price(plan, targets, stats, cache)

    monkeypatch.setattr(gs, "price_matrices", spying)
    tok = make_char_tokenizer()
    samples, _ = calibration_samples(CALIBRATION, tok, N)
    gs.guided_candidates_sequential(make_tiny_model("llama"), tok, uniform_budget(GPTQ), samples,
                                    Guide(["math", "code"], samples=2, protect_top_k=0))
    assert [(alive, layers) for alive, layers, _ in seen] == [(4, {i}) for i in range(3) for _ in range(2)]
    plans = {id(p): p for _, _, p in seen}.values()
    assert len(plans) == 2 and len({id(p.fisher) for p in plans}) == 1


def test_the_memory_check_counts_what_each_phase_holds_beside_one_layers_grams():
    """Nothing of the model's size beside one Fisher's sums while they are summed: the Fisher read back one
    matrix at a time, the original and chosen weights one layer at a time (capsense.compress.spill)."""
    model, tok = make_tiny_model("llama"), make_char_tokenizer()
    samples, _ = calibration_samples(CALIBRATION, tok, N)
    guide, uni = Guide(["math"], samples=2, protect_top_k=0), uniform_budget(GPTQ)
    targets = find_targets(model)
    grams = check_gram_memory(model, targets, samples[0], sequential=True)
    hidden, n_params = cached_bytes(model, samples), sum(t.n_params for t in targets)
    layer = max(sum(4 * t.n_params for t in targets if t.layer == i) for i in range(3))
    matrix = 2 * 4 * max(t.n_params for t in targets)
    n_levels = len(gs.guided_levels(gs.parse_setting(GPTQ), guide, targets))
    errors = 8 * n_levels * max(sum(t.shape[0] for t in targets if t.layer == i) for i in range(3))  # solved, per row
    backward = sum(backward_memory(model).values())  # a Fisher pass's activations (test_compress_backward_memory)
    solve = max(output_errors_memory(n_levels, *t.shape) for t in targets)  # the largest matrix's levels, stacked
    need = gs.check_guided_memory(model, uni, samples, guide)
    assert need == {"sensitivity": 4 * n_params + layer + backward,
                    "pricing": grams + hidden + matrix + gs.PRICE_BYTES * len(targets) * n_levels * 2 + errors + solve,
                    "compressing": grams + hidden + layer}
    assert gs.check_guided_memory(model, uni, samples, guide, available=max(need.values())) == need
    with pytest.raises(CapsenseError, match="Fisher sums") as e:  # the first phase checked
        gs.check_guided_memory(model, uni, samples, guide, available=need["sensitivity"] - 1)
    assert "one layer's gradients" in str(e.value) and "(`fisher_groups`;" in str(e.value)  # what to do
    assert "saved activations" in str(e.value) and "(`dtype`:" in str(e.value)  # a Fisher pass's, and what halves them
    flat = Guide(["math"], sensitivity="flat", protect_top_k=0)  # no Fisher: no sensitivity phase
    flat_need = gs.check_guided_memory(model, uni, samples, flat)
    assert flat_need["sensitivity"] == 0 and flat_need["compressing"] == need["compressing"]
    with pytest.raises(CapsenseError, match="kept prices") as e:
        gs.check_guided_memory(model, uni, samples, flat, available=flat_need["pricing"] - 1)
    assert "one decoder layer at a time" in str(e.value) and "Fisher, read back" in str(e.value)
    assert "compress fewer matrices" in str(e.value) and "`sequential`" not in str(e.value)  # already one at a time
    unchecked = Guide(["math"], samples=2, protect_top_k=0, check_uniform=False)  # one pricing, no weights on disk
    alone = gs.check_guided_memory(model, uni, samples, unchecked)
    assert alone == {"sensitivity": need["sensitivity"], "compressing": grams + hidden,
                     "pricing": need["pricing"] - gs.PRICE_BYTES * len(targets) * n_levels}
    on_layer = {phase: sum(parts.values()) for phase, parts in gs.guided_memory(  # the parts in CPU memory
        model, uniform_budget({**GPTQ, "solve_on": "layer"}), samples, guide).items()}
    assert on_layer == {**need, "pricing": need["pricing"] - solve}  # solved in the layer's device memory
    with pytest.raises(CapsenseError, match="all 21 it would solve are on the CPU"):  # and the check says so
        gs.check_guided_memory(model, uniform_budget({**GPTQ, "solve_on": "layer"}), samples, guide)


def _compress(tiny_model_dir, out, *extra):
    return CliRunner().invoke(main, ["compress", str(tiny_model_dir), "--method", "gptq", "--bits", "3", "--group-size",
                                     "32", "--keep", "math", "--calibration-samples", "4", "--out", str(out), *extra])


def test_the_command_ships_the_one_pass_checkpoint_and_refuses_what_it_cannot_do(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file

    r = _compress(tiny_model_dir, tmp_path / "one")
    assert r.exit_code == 0, r.output
    r = _compress(tiny_model_dir, tmp_path / "seq", "--sequential")
    assert r.exit_code == 0, r.output
    a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("one", "seq"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    one, seq = (json.loads((tmp_path / d / "capsense.json").read_text()) for d in ("one", "seq"))
    assert one["allocation"] == seq["allocation"] and one["measured"] == seq["measured"]
    assert "sequential" not in one and seq["sequential"] == {"propagate": "original", "layers": 3}
    assert (tmp_path / "one" / "budget.yaml").read_text() == (tmp_path / "seq" / "budget.yaml").read_text()
    r = _compress(tiny_model_dir, tmp_path / "no", "--sequential", "--sensitivity", "measured")
    assert r.exit_code == 1 and "sensitivity measured prices each layer" in r.output and r.output.count("Error") == 1, r.output
    assert not (tmp_path / "no").exists()


def test_compressed_propagation_compresses_each_candidate_as_compress_sequential_alone(tmp_path, tiny_model_dir,
                                                                                      monkeypatch):
    """``--keep --sequential --sequential-propagate compressed``: every candidate (guided, guided-rtn, uniform)
    gets exactly the weights ``compress_sequential(budget, propagate="compressed")`` gives its budget alone from
    the original model, not the original-propagation ones; the checkpoint is the chosen candidate's and its
    capsense.json and card say how it was calibrated."""
    from safetensors.torch import load_file

    import capsense.compress.pipeline as pipeline
    from capsense.compress.sequential import compress_sequential
    from capsense.core.models import load_model

    seen = []

    def spy(model, budget, samples, propagate, log=None):
        result = compress_sequential(model, budget, samples, propagate, log=log)
        seen.append((budget, samples, propagate, _weights(model)))
        return result

    monkeypatch.setattr(pipeline, "compress_sequential", spy)
    out = tmp_path / "c"
    r = _compress(tiny_model_dir, out, "--sequential", "--sequential-propagate", "compressed", "--format", "dense",
                  "--save-dtype", "float32")
    assert r.exit_code == 0, r.output
    meta = json.loads((out / "capsense.json").read_text())
    assert meta["sequential"] == {"propagate": "compressed", "layers": 3}
    assert "outputs of the compressed layers before it" in (out / "README.md").read_text()
    selection = meta["allocation"]["selection"]
    assert list(selection["dL"]) == ["guided", "guided-rtn", "uniform"] and len(seen) == 3
    assert [p for *_, p, _ in seen] == ["compressed"] * 3
    for budget, samples, _, got in seen:
        for propagate, same in (("compressed", True), ("original", False)):
            model, _ = load_model(str(tiny_model_dir), dtype="float32")
            compress_sequential(model, budget, samples, propagate)
            want = _weights(model)
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want) == same, propagate
    chosen = seen[list(selection["dL"]).index(selection["chosen"])][3]
    written = load_file(out / "model.safetensors")
    assert all(torch.equal(written[k], chosen[k]) for k in written)


def test_guided_sequential_refusals_come_before_the_model_loads():
    for propagate in ("original", "compressed"):  # accepted: the propagation applies to compressing the candidates
        check_sequential(uniform_budget(GPTQ), Guide(["math"]), propagate)
    with pytest.raises(CapsenseError, match="every layer's statistics"):
        check_sequential(uniform_budget(GPTQ), Guide(["math"], sensitivity="measured"), "original")
    with pytest.raises(CapsenseError, match="rtn needs no calibration"):
        check_sequential(uniform_budget({"method": "rtn", "bits": 3}), Guide(["math"]), "original")

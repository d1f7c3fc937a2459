"""What a one-pass guided run holds at once (capsense.compress.guided_sequential.check_guided_memory with
``sequential=False``): every matrix's Gram matrices from calibration to the end, beside one capability's Fisher
sums while they are summed, beside the prices and the cached solved errors while pricing, beside one layer's
weights on their way to or from disk while compressing; refused before calibration, naming the parts."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from conftest import make_char_tokenizer, make_tiny_model

import capsense.compress.guided_sequential as gs
import capsense.core.placement as placement
from capsense.cli import main
from capsense.compress.budget import uniform_budget
from capsense.compress.calibration import calibration_samples, gram_memory
from capsense.compress.engine import calibrate
from capsense.compress.gptq import output_errors_memory
from capsense.compress.guided import Guide
from capsense.compress.select import guided_candidates
from capsense.compress.sensitivity import backward_memory
from capsense.compress.targets import find_targets
from capsense.errors import CapsenseError

CALIBRATION, N = "prose,math", 6
GPTQ = {"method": "gptq", "bits": 3, "group_size": 16}
#: the tiny Llama (conftest): 3 layers, hidden 64, MLP 128; q/k/v share an input, gate/up share one
GRAMS = 3 * 8 * (64**2 + 64**2 + 64**2 + 128**2)


def _setup():
    model, tok = make_tiny_model("llama"), make_char_tokenizer()
    samples, _ = calibration_samples(CALIBRATION, tok, N)
    return model, tok, samples, uniform_budget(GPTQ)


def test_one_pass_counts_every_matrix_s_grams_in_every_phase():
    """The exact bytes per phase; the solved output errors counted are the bytes the run's cache holds."""
    model, tok, samples, uni = _setup()
    guide = Guide(["math"], samples=2, protect_top_k=0)
    targets = find_targets(model)
    assert sum(gram_memory(model, targets, samples[0]).values()) == GRAMS
    n_levels = len(gs.guided_levels(gs.parse_setting(GPTQ), guide, targets))
    layer = max(sum(4 * t.n_params for t in targets if t.layer == i) for i in range(3))
    errors = 8 * n_levels * sum(t.shape[0] for t in targets)  # one float64 per row and level, every matrix
    need = gs.check_guided_memory(model, uni, samples, guide, sequential=False)
    backward = sum(backward_memory(model).values())  # a Fisher pass's activations (test_compress_backward_memory)
    solve = max(output_errors_memory(n_levels, *t.shape) for t in targets)  # the largest matrix's levels, stacked
    assert need == {"sensitivity": GRAMS + 4 * sum(t.n_params for t in targets) + layer + backward,
                    "pricing": GRAMS + 2 * 4 * max(t.n_params for t in targets)
                    + gs.PRICE_BYTES * len(targets) * n_levels + errors + solve,  # one pricing's prices at a time
                    "compressing": GRAMS + layer}
    cache: dict = {}
    stats, _ = calibrate(model, tok, uni, CALIBRATION, N)
    guided_candidates(model, tok, uni, stats, guide, cache=cache)
    assert sum(e.numel() * e.element_size() for e in cache["level_costs"].values()) == errors
    seq = gs.check_guided_memory(model, uni, samples, guide)  # sequential: the Fisher summed before any Gram
    assert seq["sensitivity"] == need["sensitivity"] - GRAMS


def test_one_pass_refused_one_byte_short_naming_the_parts_and_what_to_do():
    model, _, samples, uni = _setup()
    guide = Guide(["math"], samples=2, protect_top_k=0)
    need = gs.check_guided_memory(model, uni, samples, guide, sequential=False)
    assert gs.check_guided_memory(model, uni, samples, guide, sequential=False, available=max(need.values())) == need
    with pytest.raises(CapsenseError) as e:
        gs.check_guided_memory(model, uni, samples, guide, sequential=False, available=need["sensitivity"] - 1)
    text = str(e.value)
    assert "in one pass" in text and "while the Fisher diagonal is summed" in text
    for part in ("Fisher sums", "one layer's gradients", "Gram matrices (attn)", "Gram matrices (mlp)"):
        assert part in text
    assert "(`sequential`" in text and "(`fisher_groups`;" in text and "compress fewer matrices" in text
    flat = Guide(["math"], sensitivity="flat", protect_top_k=0)  # no Fisher summed: pricing is the first phase held
    flat_need = gs.check_guided_memory(model, uni, samples, flat, sequential=False)
    assert flat_need["sensitivity"] == 0 and flat_need["compressing"] == need["compressing"]
    with pytest.raises(CapsenseError, match="while every matrix's levels are priced") as e:
        gs.check_guided_memory(model, uni, samples, flat, sequential=False, available=flat_need["pricing"] - 1)
    for part in ("kept prices", "every matrix's solved output errors", "Gram matrices (mlp)", "(`sequential`"):
        assert part in str(e.value)
    assert "fisher_groups" not in str(e.value)  # no Fisher in this phase: not the advice


def test_one_pass_low_rank_counts_every_matrix_s_factors():
    """SVD-LLM prices from each matrix's full factors, cached for the other pricing: every matrix's in one pass."""
    model, _, samples, _ = _setup()
    uni, guide = uniform_budget({"method": "svd-llm", "ratio": 0.5}), Guide(["math"], samples=2, protect_top_k=0)
    targets = find_targets(model)
    factors = sum(4 * (t.shape[0] + t.shape[1] + 1) * min(t.shape) for t in targets)
    held = gs.guided_memory(model, uni, samples, guide, sequential=False)
    assert held["pricing"]["every matrix's low-rank factors"] == factors
    assert "one layer's low-rank factors" in gs.guided_memory(model, uni, samples, guide)["pricing"]


def test_the_one_pass_command_is_refused_before_calibrating_or_writing(monkeypatch, tmp_path, tiny_model_dir):
    """Memory enough for the Grams alone (round 17's only one-pass check) but not the Grams and the Fisher: the
    command refuses with one Error line before calibration starts, and writes nothing."""
    import capsense.compress.engine as engine

    grams = {}
    real = gs.gram_memory
    monkeypatch.setattr(gs, "gram_memory", lambda *a, **k: grams.setdefault("need", real(*a, **k)))
    monkeypatch.setattr(placement, "available_cpu_memory", lambda: sum(grams.get("need", {}).values()) + 1)
    monkeypatch.setattr(engine, "collect_stats", lambda *a, **k: pytest.fail("calibrated before the memory check"))
    r = CliRunner().invoke(main, ["compress", str(tiny_model_dir), "--method", "gptq", "--bits", "3", "--group-size",
                                  "32", "--keep", "math", "--calibration-samples", "4", "--out", str(tmp_path / "no")])
    assert r.exit_code == 1 and r.output.count("Error") == 1, r.output
    assert "in one pass" in r.output and "Fisher sums" in r.output and "Gram matrices (mlp)" in r.output
    assert "(--sequential" in r.output and "(--fisher-groups;" in r.output and "(--dtype:" in r.output  # the command's flags, what to do
    assert not (tmp_path / "no").exists()


def test_a_one_pass_guided_run_builds_its_calibration_samples_once(monkeypatch):
    """The samples the memory check counts the Grams from are the ones calibration runs on (round 18 built them
    twice: once for the check, once inside ``calibrate``); what ships equals a run on ``calibrate``'s own samples."""
    import torch

    import capsense.compress.engine as engine
    import capsense.compress.pipeline as pipeline
    from capsense.compress.select import compress_guided
    from capsense.compress.targets import find_targets as targets_of

    guide = Guide(["math"], samples=2, protect_top_k=0)
    uni = uniform_budget(GPTQ)
    model, tok = make_tiny_model("llama"), make_char_tokenizer()
    stats, _ = calibrate(model, tok, uni, CALIBRATION, N)  # the path before: calibrate builds its own samples
    want, _, want_al = compress_guided(model, tok, uni, guided_candidates(model, tok, uni, stats, guide), stats, guide)
    built = []

    def counted(spec, *a, **k):
        built.append(spec)
        return calibration_samples(spec, *a, **k)

    monkeypatch.setattr(pipeline, "calibration_samples", counted)
    monkeypatch.setattr(engine, "calibration_samples", counted)
    one = make_tiny_model("llama")
    got, shipped, al, _ = pipeline._compress_one_pass(one, tok, uni, engine.plan(one, uni), CALIBRATION, N, guide, 0,
                                                      "float32", lambda _m: None, "dense")
    assert built == [CALIBRATION]
    assert [a.to_dict() for a in got.accounts] == [a.to_dict() for a in want.accounts]
    assert al.info["selection"]["chosen"] == want_al.info["selection"]["chosen"]
    assert all(torch.equal(t.get(), w.get()) for t, w in zip(targets_of(one), targets_of(model)))


@pytest.mark.parametrize("sequential", [False, True])
def test_a_guided_run_tokenizes_its_fisher_texts_once(monkeypatch, sequential):
    """The Fisher texts the memory check counts (their longest) are the ones the Fisher passes read (round 19
    tokenized them twice: for the check, then in ``plan_guided``), in one pass and sequential; the Fisher sums
    equal (torch.equal) those of a plan that tokenizes them in the pass, as before."""
    import torch

    import capsense.compress.calibration as calibration
    import capsense.compress.engine as engine
    import capsense.compress.pipeline as pipeline
    import capsense.compress.sensitivity as sensitivity
    from capsense.compress.guided import plan_guided

    guide = Guide(["math", "prose"], samples=2, protect_top_k=0)  # two sources: a Fisher each
    uni, tok = uniform_budget(GPTQ), make_char_tokenizer()
    build, diagonal = calibration.calibration_samples, sensitivity.fisher_diagonal
    tokenized, sums = [], []

    def counted(spec, *a, **k):
        if k.get("max_tokens") == sensitivity.FISHER_MAX_TOKENS:
            tokenized.append(spec)
        return build(spec, *a, **k)

    def recorded(*a, **k):
        out = diagonal(*a, **k)
        sums.append({n: f.clone() for n, f in out.items()})  # spill_fisher empties it
        return out

    monkeypatch.setattr(calibration, "calibration_samples", counted)
    monkeypatch.setattr(sensitivity, "fisher_diagonal", recorded)
    plan_guided(make_tiny_model("llama"), tok, uni, guide, lambda _m: None)  # the path before: tokenized in the pass
    want, sums[:], tokenized[:] = list(sums), [], []
    model = make_tiny_model("llama")
    if sequential:
        pipeline._compress_sequential(model, tok, uni, CALIBRATION, N, "original", guide, 0, "float32",
                                      lambda _m: None, "dense")
    else:
        pipeline._compress_one_pass(model, tok, uni, engine.plan(model, uni), CALIBRATION, N, guide, 0, "float32",
                                    lambda _m: None, "dense")
    assert tokenized == ["math", "prose"]
    assert len(sums) == len(want) == 2
    assert all(g.keys() == w.keys() and all(torch.equal(g[n], w[n]) for n in w) for g, w in zip(sums, want))


def test_pricing_holds_at_most_what_the_check_counts(monkeypatch):
    """The tensor bytes each pricing allocates and holds at once (:class:`~capsense.core.memory.TensorPeak` around
    :func:`~capsense.compress.guided.price_matrices`: one matrix's Fisher read back, its stacked solve, the cached
    solved errors) are at most the pricing phase's count less what was there before (the Grams) and the prices
    (Python objects, not tensors). Round 19's count had no solve: the tiny run's output pricing held 12.7x it (0.83
    of the count now)."""
    import capsense.compress.guided as guided
    from capsense.core.memory import TensorPeak

    model, tok, samples, uni = _setup()
    guide = Guide(["math"], samples=2, protect_top_k=0)
    counted = gs.guided_memory(model, uni, samples, guide, sequential=False)["pricing"]
    tensors = sum(v for k, v in counted.items() if not k.startswith(("Gram matrices", "kept prices")))
    peaks, real = [], guided.price_matrices

    def measured(*a, **k):
        with TensorPeak() as p:
            out = real(*a, **k)
        peaks.append(p.peak)
        return out

    monkeypatch.setattr(guided, "price_matrices", measured)
    stats, _ = calibrate(model, tok, uni, CALIBRATION, N)
    guided_candidates(model, tok, uni, stats, guide)
    assert len(peaks) == 2 and 0.5 * tensors <= max(peaks) <= tensors, (peaks, tensors)


def test_each_step_hands_back_what_it_freed(monkeypatch):
    """Every calibration forward, Fisher text, matrix priced or compressed and probe set measured returns its freed
    heap pages (:func:`~capsense.core.memory.return_freed_memory`): without it a SmolLM2-width run's resident memory
    grew by 45-70 MiB per layer priced with the live tensors flat (round 20), memory no count can name."""
    import capsense.compress.calibration as calibration
    import capsense.compress.engine as engine
    import capsense.compress.sensitivity as sensitivity
    import capsense.core.memory as memory
    from capsense.compress.select import compress_guided

    calls: list[str] = []
    for module in (calibration, engine, sensitivity, memory):
        if hasattr(module, "return_freed_memory"):
            monkeypatch.setattr(module, "return_freed_memory",
                                lambda m=module.__name__: calls.append(m.rsplit(".", 1)[-1]) or True)
    model, tok, samples, uni = _setup()
    guide = Guide(["math"], samples=2, protect_top_k=0)
    targets = find_targets(model)
    stats, _ = calibrate(model, tok, uni, CALIBRATION, N)
    assert calls == ["calibration"] * N
    allocations = guided_candidates(model, tok, uni, stats, guide)
    assert calls[N:] == ["sensitivity"] * 2 + ["memory"] * 2 * len(targets)  # 2 Fisher texts; two pricings
    del calls[:]
    compress_guided(model, tok, uni, allocations, stats, guide)
    # the calibration documents measured before and after each of three candidates, each compressed matrix by matrix
    assert calls == ["memory"] + (["engine"] * len(targets) + ["memory"]) * 3

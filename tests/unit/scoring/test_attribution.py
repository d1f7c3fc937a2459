"""Gradient attribution: the gradient is the derivative of the hooked score (fp64 finite differences)."""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch

from capsense.core.ablation import HeadAblator
from capsense.core.distributed import DistContext
from capsense.errors import CapsenseError
from capsense.scoring.attribution import AttributionScorer, attribute_probes, check_gradient_metric
from capsense.scoring.probe import Probe, ProbeScorer
from conftest import N_HEADS, N_LAYERS, VOCAB, choice_probe, loglik_probe, make_tiny_model

# Richardson-extrapolated central differences with steps 1e-2 and 5e-3: truncation error
# below 1e-9 (GPT-2, whose forward is all fp64, checks it). Other architectures keep attention softmax and norm statistics in
# float32 even in an fp64 model, a ~1e-7 floor on score differences (~1e-6 on a derivative
# at these steps), so their tolerance is 1e-4 of the largest derivative or 3e-6.
EPS = 1e-2


def _assert_close(grad: np.ndarray, fd: np.ndarray, all_fp64: bool) -> None:
    tol = 1e-9 if all_fp64 else max(1e-4 * np.abs(fd).max(), 3e-6)
    assert np.abs(grad - fd).max() <= tol, (np.abs(grad - fd).max(), tol)


def _means(model) -> dict[int, torch.Tensor]:
    """Each layer's mean output-projection input over random token sequences (as mean ablation uses)."""
    from capsense.core.arch import out_projections

    sums: dict[int, torch.Tensor] = {}

    def make(layer: int):
        def hook(module, args):
            sums[layer] = args[0].detach().reshape(-1, args[0].shape[-1]).mean(0)

        return hook

    handles = [p.register_forward_pre_hook(make(i)) for i, p in enumerate(out_projections(model))]
    try:
        with torch.no_grad():
            model(torch.randint(4, VOCAB, (4, 16), generator=torch.Generator().manual_seed(9)))
    finally:
        for h in handles:
            h.remove()
    return sums


def _derivative(scorer: AttributionScorer, v: torch.Tensor) -> float:
    """d score / d t at xi = 1 + t v: central differences, Richardson-extrapolated (steps EPS, EPS/2)."""
    def central(eps: float) -> float:
        one = torch.ones(N_LAYERS, N_HEADS, dtype=torch.float64)
        return (scorer.score(one + eps * v) - scorer.score(one - eps * v)) / (2 * eps)

    return (4 * central(EPS / 2) - central(EPS)) / 3


def _directions(n: int = 3, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(N_LAYERS, N_HEADS, generator=g, dtype=torch.float64) / (N_LAYERS * N_HEADS) ** 0.5 for _ in range(n)]


def _assert_gradient(scorer: AttributionScorer, grad: np.ndarray, all_fp64: bool, per_head: bool = False) -> None:
    dirs = _directions()
    if per_head:  # every head's own derivative
        dirs = [torch.eye(N_LAYERS * N_HEADS, dtype=torch.float64)[i].reshape(N_LAYERS, N_HEADS) for i in range(N_LAYERS * N_HEADS)]
    fd = np.array([_derivative(scorer, v) for v in dirs])
    analytic = np.array([float((torch.from_numpy(grad) * v).sum()) for v in dirs])
    _assert_close(analytic, fd, all_fp64)
    assert np.abs(fd).max() > 1e-4  # the heads matter to the score


@pytest.mark.parametrize("ablation", ["zero", "mean"])
def test_gradient_equals_finite_difference(arch, ablation):
    model = make_tiny_model(arch).double()
    scorer = AttributionScorer(model, loglik_probe(), batch_size=2, ablation=ablation,
                               means=_means(model) if ablation == "mean" else None)
    att = scorer.attribute()
    _assert_gradient(scorer, att.gradient, all_fp64=arch == "gpt2")
    assert att.nll == pytest.approx(scorer.score(torch.ones(N_LAYERS, N_HEADS, dtype=torch.float64)), abs=1e-12)
    np.testing.assert_array_equal(att.estimate, -att.gradient)


@pytest.mark.parametrize("arch_", ["mixtral", "gpt_oss", "cohere", "granite", "phi"])
def test_gradient_equals_finite_difference_on_more_families(arch_):
    """Families outside ``ARCHS``: two MoE (gradients through routed experts), Cohere and Granite
    (their logits are scaled after the head), Phi-2 (projection ``dense``). The experts run their
    eager loop: the default grouped matmul has no float64 kernel. (Tiny qwen3_moe is left out: a
    step of EPS moves some token across a top-2 routing boundary, so the difference quotient jumps;
    at step 1e-3 it equals the gradient to 1e-6, checked by hand.)"""
    model = make_tiny_model(arch_, _experts_implementation="eager").double()
    scorer = AttributionScorer(model, loglik_probe(), batch_size=2)
    att = scorer.attribute()
    _assert_gradient(scorer, att.gradient, all_fp64=False)
    assert att.nll == pytest.approx(scorer.score(torch.ones(N_LAYERS, N_HEADS, dtype=torch.float64)), abs=1e-12)


@pytest.mark.parametrize("arch_", ["gpt2", "llama"])
def test_every_head_gradient_equals_its_finite_difference(arch_):
    model = make_tiny_model(arch_).double()
    scorer = AttributionScorer(model, loglik_probe(), batch_size=2)
    _assert_gradient(scorer, scorer.attribute().gradient, all_fp64=arch_ == "gpt2", per_head=True)


def one_head(layer: int, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Head (layer, head) knocked out: as a knockout mask [1, layers, heads] and as multipliers (0 there, else 1)."""
    ko = torch.zeros(1, N_LAYERS, N_HEADS, dtype=torch.bool)
    ko[0, layer, head] = True
    return ko, (~ko[0]).float()


def test_multiplier_zero_is_the_knockout_and_batching_does_not_matter(arch):
    model = make_tiny_model(arch)
    probe = loglik_probe()
    scorer = AttributionScorer(model, probe, batch_size=2)
    ko, scale = one_head(1, 2)
    knocked = ProbeScorer(model, probe, batch_size=3).score(ko)["nll"][0]
    assert scorer.score(scale) == pytest.approx(knocked, abs=1e-5)
    whole = AttributionScorer(model, probe, batch_size=64).attribute()
    np.testing.assert_allclose(scorer.attribute().gradient, whole.gradient, atol=1e-5)


def test_mean_multiplier_zero_is_mean_ablation():
    model = make_tiny_model("llama")
    means = _means(model)
    probe = loglik_probe()
    scorer = AttributionScorer(model, probe, ablation="mean", means=means)
    ko, scale = one_head(2, 1)
    knocked = ProbeScorer(model, probe, HeadAblator(model, "mean", means)).score(ko)["nll"][0]
    assert scorer.score(scale) == pytest.approx(knocked, abs=1e-5)


def test_multiple_choice_scores_the_gold_choice_like_theloglik_probe():
    model = make_tiny_model("qwen2")
    probe = choice_probe()
    att = attribute_probes(model, {"mc": probe}, batch_size=4)["mc"]
    assert att.nll == pytest.approx(ProbeScorer(model, probe).score()["nll"][0], abs=1e-5)
    scorer = AttributionScorer(model.double(), probe)
    _assert_gradient(scorer, scorer.attribute().gradient, all_fp64=False)


def test_multiple_choice_on_the_shared_context_equals_the_gold_requests_alone(arch):
    """A multiple-choice attribution runs the shared-context passes (every choice: the clean forward it
    hands on) where their check passes; nll, gradient and magnitude equal attributing the gold requests
    alone, the gradient flowing back through the KV cache."""
    from test_shared_prefix import SHARED_ON

    model = make_tiny_model(arch)
    probe = choice_probe(n_docs=5)
    shared = AttributionScorer(model, probe, batch_size=6)
    gold = AttributionScorer(model, probe, batch_size=6)
    gold.shared = None  # the gold requests alone, as before round 12
    assert shared.on_shared_context or arch not in SHARED_ON  # (sliding windows: on where these short documents fit)
    a, b = shared.attribute(), gold.attribute()
    assert a.nll == pytest.approx(b.nll, abs=1e-5)
    np.testing.assert_allclose(a.gradient, b.gradient, atol=1e-5, rtol=0)
    np.testing.assert_allclose(a.magnitude, b.magnitude, atol=1e-5, rtol=0)
    assert np.abs(b.gradient).max() > 1e-3


def test_bfloat16_gradient_is_close_to_float32():
    model = make_tiny_model("llama")
    g32 = AttributionScorer(model, loglik_probe()).attribute().gradient
    g16 = AttributionScorer(model.to(torch.bfloat16), loglik_probe()).attribute().gradient
    assert np.corrcoef(g32.ravel(), g16.ravel())[0, 1] > 0.95


@pytest.mark.parametrize("metric", ["acc", "exact_match", "pass@1"])
def test_metric_without_gradient_is_refused(metric):
    with pytest.raises(CapsenseError) as e:
        check_gradient_metric(metric)
    assert isinstance(e.value, CapsenseError)
    msg = str(e.value)
    assert "nll" in msg and metric in msg and "exhaustive" in msg and "cs" in msg
    check_gradient_metric("nll")  # no error


class _ThreadWorld(DistContext):
    """A world of processes simulated by threads: ``gather`` exchanges through shared slots."""

    def __init__(self, rank: int, world: int, slots: list, barrier: threading.Barrier) -> None:
        super().__init__(rank=rank, world=world)
        object.__setattr__(self, "slots", slots)
        object.__setattr__(self, "sync", barrier)

    def gather(self, obj):
        self.slots[self.rank] = obj
        self.sync.wait()
        return list(self.slots)


@pytest.mark.parametrize("world", [2, 3])
def test_batches_split_across_processes_give_the_same_attribution_to_the_bit(world):
    model = make_tiny_model("llama")
    probes = {"t": loglik_probe(7, seed=3), "mc": choice_probe()}
    alone = attribute_probes(model, probes, batch_size=2)
    slots: list = [None] * world
    barrier = threading.Barrier(world, timeout=60)
    results: dict[int, dict] = {}

    def work(rank: int) -> None:
        results[rank] = attribute_probes(copy.deepcopy(model), probes, batch_size=2,
                                         ctx=_ThreadWorld(rank, world, slots, barrier))

    threads = [threading.Thread(target=work, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shares = [[(name, term.batch) for name, term in share] for share in slots]
    assert all(shares) and sum(map(len, shares)) == len({x for s in shares for x in s}) == 4 + 3  # each batch once
    # (multiple choice: whole documents on the shared context, 3 choices > batch size 2: one document per batch)
    for rank in range(world):
        for name, att in alone.items():
            assert results[rank][name].nll == att.nll
            np.testing.assert_array_equal(results[rank][name].gradient, att.gradient)


def test_batch_terms_sum_in_batch_order_whatever_order_they_come_in():
    model = make_tiny_model("gpt2")
    scorer = AttributionScorer(model, loglik_probe(7), batch_size=2)
    terms = scorer.terms(range(scorer.n_batches))
    assert scorer.n_batches == 4 and len({t.gradient.tobytes() for t in terms}) == 4
    whole = scorer.attribute()
    mixed = scorer.combine(scorer.terms([3, 1]) + scorer.terms([0, 2]))
    assert mixed.nll == whole.nll and mixed.gradient.tobytes() == whole.gradient.tobytes()
    with pytest.raises(CapsenseError, match="needs each of its 4 batches once"):
        scorer.combine(terms[:3])


def test_magnitude_sums_each_documents_own_gradient():
    """``magnitude`` = sum over documents of |that document's gradient| (token-weighted as the nll is),
    from the same backward: checked against one attribution per one-document probe."""
    model = make_tiny_model("llama").double()
    probe = loglik_probe(n=5)
    att = AttributionScorer(model, probe, batch_size=2).attribute()
    total = sum(len(c) for c in probe.continuation_ids)
    expect, summed = np.zeros((N_LAYERS, N_HEADS)), np.zeros((N_LAYERS, N_HEADS))
    for d in range(5):
        one = Probe("toy", "loglikelihood", [probe.context_ids[d]], [probe.continuation_ids[d]], np.arange(1), [0])
        g = AttributionScorer(model, one).attribute().gradient * len(probe.continuation_ids[d]) / total
        expect += np.abs(g)
        summed += g
    np.testing.assert_allclose(att.gradient, summed, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(att.magnitude, expect, rtol=1e-5, atol=1e-8)
    assert (att.magnitude > np.abs(att.gradient) + 1e-9).any()  # the documents do pull heads both ways here
    np.testing.assert_allclose(att.flat_magnitude(), expect.reshape(-1), rtol=1e-5, atol=1e-8)
    whole = AttributionScorer(model, probe, batch_size=64).attribute()
    np.testing.assert_allclose(whole.magnitude, att.magnitude, rtol=1e-5, atol=1e-8)  # batching does not matter

"""End to end on the embedded SmolLM2-135M-Instruct (slow; CI runs it)."""

import copy

import pytest
import torch

pytestmark = pytest.mark.slow

HEADS = "L2H3+L9H0+L17H5+L25H8"


@pytest.fixture(scope="module")
def smollm2():
    from capsense.core.models import load_model

    return load_model("smollm2-135m")


def test_embedded_model_layout_and_exact_ablation(smollm2):
    from capsense.core.ablation import HeadAblator, zero_heads_in_weights
    from capsense.core.arch import head_layout

    model, tok = smollm2
    layout = head_layout(model)
    assert (layout.n_layers, layout.n_heads, layout.head_dim) == (30, 9, 64)
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog. 12 + 34 = 46")])
    with torch.no_grad():
        with HeadAblator(model).apply(HEADS):
            hooked = model(ids).logits
        edited = copy.deepcopy(model)
        zero_heads_in_weights(edited, HEADS)
        zeroed = edited(ids).logits
    assert (hooked - zeroed).abs().max().item() <= 1e-4


def test_capsense_masked_on_smollm2_matches_probe(smollm2):
    from capsense.evaluation.evaluate import evaluate_head_sets, load_lm
    from capsense.core.heads import HeadSet
    from capsense.scoring.probe import Probe, ProbeScorer

    model, tok = smollm2
    lm = load_lm("smollm2-135m", batch_size=16)
    rows = evaluate_head_sets(lm, {"base": HeadSet(), "ablated": HeadSet.parse(HEADS)}, ["capsense_induction"], limit=40)
    by_metric = {r.metric: r.values for r in rows}
    assert by_metric["acc"]["base"] >= 0.5  # the model can do the task
    # The probe path scores the same requests to the same numbers.
    probe = Probe.from_task("capsense_induction", tok, doc_ids=list(range(40)))
    scorer = ProbeScorer(model, probe, batch_size=20)
    ko = scorer.ablator.knockouts(HEADS)
    scores = scorer.score(torch.cat([torch.zeros_like(ko), ko]))
    assert scores["nll"][0] == pytest.approx(by_metric["nats_per_token"]["base"], abs=1e-4)
    assert scores["nll"][1] == pytest.approx(by_metric["nats_per_token"]["ablated"], abs=1e-4)
    assert scores["acc"][1] == pytest.approx(by_metric["acc"]["ablated"])

"""End to end on the embedded models, SmolLM2-135M-Instruct and Gemma 3 270M (slow; CI runs it)."""

import copy

import pytest
import torch

pytestmark = pytest.mark.slow

HEADS = "L2H3+L9H0+L17H5+L25H8"
#: per embedded model: (layers, query heads, head_dim) and heads to ablate (Gemma's layer 5 and
#: 11 are global-attention layers, 9 and 16 sliding-window ones)
MODELS = {
    "smollm2-135m": ((30, 9, 64), HEADS),
    "gemma3-270m": ((18, 4, 256), "L5H1+L9H3+L11H0+L16H2"),
}
PROMPTS = ["The quick brown fox jumps over the lazy dog. 12 + 34 = 46",
           "apple river stone candle forest mirror\napple river stone"]


@pytest.fixture(scope="module", params=list(MODELS))
def embedded(request):
    from capsense.core.models import load_model

    model, tok = load_model(request.param)
    return request.param, model, tok


def test_embedded_model_layout_and_exact_ablation(embedded):
    from capsense.core.ablation import HeadAblator, zero_heads_in_weights
    from capsense.core.arch import head_layout

    name, model, tok = embedded
    shape, heads = MODELS[name]
    layout = head_layout(model)
    assert (layout.n_layers, layout.n_heads, layout.head_dim) == shape
    edited = copy.deepcopy(model)
    zero_heads_in_weights(edited, heads)
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            with HeadAblator(model).apply(heads):
                hooked = model(ids).logits
            zeroed, base = edited(ids).logits, model(ids).logits
        assert (hooked - zeroed).abs().max().item() <= 1e-4
        assert (hooked - base).abs().max().item() > 1e-2  # the ablation changes the output


@pytest.mark.parametrize("embedded", ["smollm2-135m"], indirect=True)
def test_capsense_masked_on_smollm2_matches_probe(embedded):
    from capsense.evaluation.evaluate import evaluate_head_sets, load_lm
    from capsense.core.heads import HeadSet
    from capsense.scoring.probe import Probe, ProbeScorer

    _, model, tok = embedded
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

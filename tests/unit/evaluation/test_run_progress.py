"""`capsense run` shows one progress display: phases locate 1/3, refine 2/3, validate 3/3, no other bar."""

from __future__ import annotations

from click.testing import CliRunner

from capsense.cli import main
from _toy_task import write_toy_recipe


def test_run_shows_one_bar_with_three_phases(tmp_path):
    recipe = write_toy_recipe(
        tmp_path,
        {"method": "cs", "masks": 6, "heads_per_mask": 2, "limit": 8, "refine": 3, "top_k": 2},
        {"top_k": 2, "random": 1, "limit": 6},
    )
    r = CliRunner().invoke(main, ["run", str(recipe)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    for label in ("locate 1/3", "refine 2/3", "validate 3/3"):
        assert label in r.output, label
    assert "FE" in r.output  # locate's forward-equivalents beside the counts
    # no second bar of ours: neither locate's old per-phase bars (mask/s, "refine top-") nor an unlabelled one
    # (model loading and dataset bars come from transformers / datasets)
    assert "mask/s" not in r.output and "refine top-" not in r.output and "locate toy_copy" not in r.output
    bars = [seg for seg in r.output.replace("\r", "\n").splitlines() if "%|" in seg and "/3:" in seg]
    assert bars and all(" total" in seg for seg in bars)  # one ETA over the whole run

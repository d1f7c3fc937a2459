"""One progress display for a run: phase labels, one bar over all phases, early exits jump ahead."""

from __future__ import annotations

import io

import pytest

from capsense.core.progress import Phase, RunProgress


def test_phases_share_one_bar_and_label_themselves():
    out = io.StringIO()
    run = RunProgress([Phase("locate", 4, "masks"), Phase("refine", 2, "sets"),
                       Phase("validate", 2, "conditions", unit_cost=3.0)], file=out)
    assert run.total_cost == 4 + 2 + 6
    with run.phase("locate") as p:
        p.update(1, resumed=True)
        p.update(3)
        assert p.description == "locate 1/3" and p.postfix == "4/4 masks"
    with run.phase("refine") as p:
        p.update(1)  # converged early: leaving the phase moves the bar to its end
    assert run._bar.n == pytest.approx(6)
    with run.phase("validate") as p:
        p.label("random 1 (3/5)")
        assert p.description == "validate 3/3" and p.postfix == "0/2 conditions, random 1 (3/5)"
        p.update(2)
    assert run._bar.n == pytest.approx(run.total_cost)
    run.close()
    text = out.getvalue()
    assert "locate 1/3" in text and "refine 2/3" in text and "validate 3/3" in text


def test_skipped_phases_and_disabled_display():
    out = io.StringIO()
    run = RunProgress([Phase("locate", 3), Phase("validate", 1)], enabled=False, file=out)
    with run.phase("validate") as p:  # locate skipped (e.g. a finished run folder)
        p.update()
    assert out.getvalue() == "[validate 2/2] validate: 1 steps\n"
    with pytest.raises(KeyError, match="phases are locate, validate"):
        run.index("refine")


def test_transformers_bars_are_off_within_and_as_they_were_after():
    """Loads switched transformers' bars back on after each load, whatever the user had set."""
    from transformers.utils import logging as hf_logging

    from capsense.core.progress import without_library_bars

    for before in (True, False):
        (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()
        with without_library_bars():
            assert not hf_logging.is_progress_bar_enabled()
        assert hf_logging.is_progress_bar_enabled() == before
    hf_logging.enable_progress_bar()


def test_a_library_bar_started_within_shows_nothing_whatever_it_passes():
    """compressed-tensors passes its own ``disable=False`` to tqdm and has no switch: a bar started within the block
    shows nothing even so (nested blocks too), and bars show again after it."""
    import io

    from tqdm import tqdm

    from capsense.core.progress import without_library_bars

    def shown(**kw) -> str:
        out = io.StringIO()
        for _ in tqdm(range(3), file=out, desc="Dispatching model", **kw):
            pass
        return out.getvalue()

    assert "Dispatching model" in shown(disable=False)
    with without_library_bars():
        assert shown(disable=False) == shown() == ""
        with without_library_bars():
            assert shown(disable=False) == ""
        assert shown(disable=False) == ""
    assert "Dispatching model" in shown(disable=False)

"""Run folder: durable appends, torn-line recovery, refusing a folder that holds another run."""

from __future__ import annotations

import json

import pytest

from capsense.localize.store import EVALUATIONS, Evaluation, RunStore
from capsense.errors import RunStoreError

KEYS = ["model", "task", "seed"]


def _manifest(**identity):
    return {"identity": {"model": "m", "task": "t", "seed": 0, **identity}}


def test_append_and_resume(tmp_path):
    store = RunStore.open(tmp_path / "run", _manifest(), KEYS, n_heads=4)
    store.append(Evaluation(0, [], {"t": {"nll": 1.0, "acc": 0.5}}))
    store.append(Evaluation(1, [1, 6], {"t": {"nll": 1.25, "acc": 0.25}}))
    line = json.loads((tmp_path / "run" / EVALUATIONS).read_text().splitlines()[1])
    assert line["heads"] == ["L0H1", "L1H2"]
    again = RunStore.open(tmp_path / "run", _manifest(), KEYS, n_heads=4)
    assert [e.heads for e in again.evaluations] == [[], [1, 6]]
    assert again.evaluations[1].scores == {"t": {"nll": 1.25, "acc": 0.25}}
    assert again.manifest["resumed"] == 1


def test_torn_last_line_is_dropped(tmp_path):
    store = RunStore.open(tmp_path, _manifest(), KEYS, n_heads=4)
    store.append(Evaluation(0, [], {"t": {"nll": 1.0, "acc": 0.5}}))
    with (tmp_path / EVALUATIONS).open("a") as f:
        f.write('{"i": 1, "heads": ["L0H')  # killed mid-write
    again = RunStore.open(tmp_path, _manifest(), KEYS, n_heads=4)
    assert len(again.evaluations) == 1
    again.append(Evaluation(1, [2], {"t": {"nll": 2.0, "acc": 0.0}}))
    assert len(RunStore.open(tmp_path, _manifest(), KEYS, n_heads=4).evaluations) == 2


def test_refuses_a_different_run(tmp_path):
    RunStore.open(tmp_path, _manifest(), KEYS, n_heads=4)
    with pytest.raises(RunStoreError, match=r"holds a different run \(task: 't' there, 'other' now"):
        RunStore.open(tmp_path, _manifest(task="other"), KEYS, n_heads=4)


def test_a_key_an_earlier_release_did_not_record(tmp_path):
    """A folder whose identity lacks a key resumes when the key is None (what it was then); else
    the refusal says the key was not recorded, and quotes ``earlier``'s way to resume it only
    when that alone would do."""
    RunStore.open(tmp_path, _manifest(), KEYS, n_heads=4)  # identity without "screen"
    keys = [*KEYS, "screen"]
    earlier = {"screen": "`screen` 0"}
    with pytest.raises(RunStoreError, match=r"\(screen: not recorded there \(written by an earlier release\), 3.0 now\); "
                                            r"to resume it give `screen` 0, or choose another `out`"):
        RunStore.open(tmp_path, _manifest(screen=3.0), keys, n_heads=4, earlier=earlier)
    with pytest.raises(RunStoreError, match=r"\(seed: 0 there, 1 now; screen: not recorded there .*3.0 now\); rerun with its settings to resume it"):
        RunStore.open(tmp_path, _manifest(screen=3.0, seed=1), keys, n_heads=4, earlier=earlier)
    assert RunStore.open(tmp_path, _manifest(screen=None), keys, n_heads=4).manifest["identity"]["screen"] is None
    with pytest.raises(RunStoreError, match=r"\(screen: None there, 3.0 now\); rerun with its settings"):  # recorded now
        RunStore.open(tmp_path, _manifest(screen=3.0), keys, n_heads=4, earlier=earlier)
    # a key no setting reproduces (None in ``earlier``): the earlier release computed differently
    lost = {**earlier, "kernel": None}
    with pytest.raises(RunStoreError, match=r"\(kernel: not recorded there .*'float32' now\); no setting of this release "
                                            r"computes kernel as that one did, so none resumes it: choose another `out`"):
        RunStore.open(tmp_path, _manifest(screen=None, kernel="float32"), [*keys, "kernel"], n_heads=4, earlier=lost)
    assert RunStore.open(tmp_path, _manifest(screen=None, kernel=None), [*keys, "kernel"], n_heads=4, earlier=lost)


def test_refuses_a_non_run_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(RunStoreError, match="not a capsense run folder"):
        RunStore.open(tmp_path, _manifest(), KEYS, n_heads=4)


def test_a_last_line_without_its_newline_is_dropped_and_appending_stays_clean(tmp_path):
    store = RunStore.open(tmp_path, _manifest(), KEYS, n_heads=4)
    store.append(Evaluation(0, [], {"t": {"nll": 1.0, "acc": 0.5}}))
    with (tmp_path / EVALUATIONS).open("a") as f:
        f.write(Evaluation(1, [3], {"t": {"nll": 1.5, "acc": 0.5}}).to_json(4))  # killed before the newline
    again = RunStore.open(tmp_path, _manifest(), KEYS, n_heads=4)
    assert len(again.evaluations) == 1
    again.append(Evaluation(1, [2], {"t": {"nll": 2.0, "acc": 0.0}}))
    lines = (tmp_path / EVALUATIONS).read_text().splitlines()
    assert [json.loads(ln)["heads"] for ln in lines] == [[], ["L0H2"]]


def test_a_damaged_line_inside_the_file_is_refused(tmp_path):
    store = RunStore.open(tmp_path, _manifest(), KEYS, n_heads=4)
    store.append(Evaluation(0, [], {"t": {"nll": 1.0, "acc": 0.5}}))
    with (tmp_path / EVALUATIONS).open("a") as f:
        f.write("not json\n")
    store.append(Evaluation(1, [2], {"t": {"nll": 2.0, "acc": 0.0}}))
    with pytest.raises(RunStoreError, match="the file is damaged"):
        RunStore.open(tmp_path, _manifest(), KEYS, n_heads=4)


def test_a_different_run_s_refusal_tells_a_long_field_by_its_keys():
    """Adding one control changed doc_ids, every task's document ids: the refusal printed both mappings whole (some
    5,000 characters on the main job). Now the tasks that differ, and short fields as they are."""
    from capsense.localize.store import _difference

    old = {"capsense_induction": list(range(100))}
    new = {**old, "capsense_facts": list(range(55)), "capsense_names": list(range(40))}
    assert _difference("doc_ids", old, new) == "doc_ids differ (capsense_facts, capsense_names only now)"
    assert _difference("doc_ids", new, {**new, "capsense_facts": [1] * 55}) == "doc_ids differ (capsense_facts changed)"
    assert _difference("method", "cs", "exhaustive") == "method: 'cs' there, 'exhaustive' now"
    assert _difference("controls", [], ["capsense_facts"] * 9).endswith("... (9 items) now")

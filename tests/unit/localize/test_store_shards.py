"""Per-process evaluation shards: merged by mask index, compacted by the main process, resumable."""

from __future__ import annotations

import json

import pytest

from capsense.localize.store import EVALUATIONS, Evaluation, RunStore, read_evaluations, shard_name
from capsense.errors import RunStoreError

KEYS = ["model", "task", "seed"]


def _manifest():
    return {"identity": {"model": "m", "task": "t", "seed": 0}, "layout": {"n_heads": 4}}


def _ev(i: int) -> Evaluation:
    return Evaluation(i, [i % 8], {"t": {"nll": 1.0 + i / 8, "acc": 0.5}})


def test_shards_merge_by_index_and_compact(tmp_path):
    main = RunStore.open(tmp_path, _manifest(), KEYS, n_heads=4)
    other = RunStore.attach(tmp_path, n_heads=4, rank=1)
    for i in (0, 1, 2):
        main.append(_ev(i))
    for i in (3, 5):  # rank 1's share; 4 was in flight when it was killed
        other.append(_ev(i))
    assert (tmp_path / shard_name(1)).is_file()
    assert [e.index for e in read_evaluations(tmp_path)] == [0, 1, 2, 3, 5]
    again = RunStore.open(tmp_path, _manifest(), KEYS, n_heads=4)  # resume: compacts
    assert sorted(again.done) == [0, 1, 2, 3, 5]
    assert not list(tmp_path.glob("evaluations.rank*"))
    lines = [json.loads(x)["i"] for x in (tmp_path / EVALUATIONS).read_text().splitlines()]
    assert lines == [0, 1, 2, 3, 5]


def test_record_copies_other_processes_into_the_main_log_once(tmp_path):
    main = RunStore.open(tmp_path, _manifest(), KEYS, n_heads=4)
    other = RunStore.attach(tmp_path, n_heads=4, rank=1)
    main.append(_ev(0))
    other.append(_ev(1))
    main.record([_ev(1)])
    main.record([_ev(1)])  # the same evaluation handed on twice is kept once
    lines = [json.loads(x)["i"] for x in (tmp_path / EVALUATIONS).read_text().splitlines()]
    assert lines == [0, 1]
    # a kill between the copy and the shard's removal leaves the mask in two logs: counted once
    assert [e.index for e in read_evaluations(tmp_path)] == [0, 1]
    assert sorted(RunStore.open(tmp_path, _manifest(), KEYS, n_heads=4).done) == [0, 1]


def test_torn_shard_tail_is_dropped(tmp_path):
    RunStore.open(tmp_path, _manifest(), KEYS, n_heads=4).append(_ev(0))
    RunStore.attach(tmp_path, n_heads=4, rank=2).append(_ev(1))
    with (tmp_path / shard_name(2)).open("a") as f:
        f.write('{"i": 2, "heads": ["L0')
    assert sorted(RunStore.open(tmp_path, _manifest(), KEYS, n_heads=4).done) == [0, 1]


def test_conflicting_logs_are_refused(tmp_path):
    RunStore.open(tmp_path, _manifest(), KEYS, n_heads=4).append(_ev(0))
    RunStore.attach(tmp_path, n_heads=4, rank=1).append(Evaluation(0, [3], {"t": {"nll": 1.0, "acc": 0.5}}))
    with pytest.raises(RunStoreError, match="mask 0 is logged with two different head sets"):
        RunStore.open(tmp_path, _manifest(), KEYS, n_heads=4)


def test_old_single_log_folder_resumes_unchanged(tmp_path):
    RunStore.open(tmp_path, _manifest(), KEYS, n_heads=4)
    text = "".join(_ev(i).to_json(4) + "\n" for i in range(3))
    (tmp_path / EVALUATIONS).write_text(text)
    store = RunStore.open(tmp_path, _manifest(), KEYS, n_heads=4)
    assert [e.index for e in store.evaluations] == [0, 1, 2]
    assert (tmp_path / EVALUATIONS).read_text() == text

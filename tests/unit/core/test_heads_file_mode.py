"""heads.json gets the same mode as the rest of a run folder (the umask's, 0644 usually), not mkstemp's 0600."""

from __future__ import annotations

import os

from capsense.core.heads import HeadsFile, load_heads_file, write_heads_file


def test_heads_file_mode_and_round_trip(tmp_path):
    old = os.umask(0o022)
    try:
        p = write_heads_file(tmp_path / "heads.json", HeadsFile("m", [{"layer": 1, "head": 2}], {"task": "t"}))
        (tmp_path / "report.md").write_text("x")
    finally:
        os.umask(old)
    assert (p.stat().st_mode & 0o777) == (tmp_path / "report.md").stat().st_mode & 0o777 == 0o644
    assert p.read_text().endswith("}\n")
    hf = load_heads_file(p)
    assert (hf.model, hf.heads, hf.meta) == ("m", [{"layer": 1, "head": 2}], {"task": "t"})
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

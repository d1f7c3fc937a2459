"""The model folder's content hash: the bytes' sha256, read again only when a file's stat changes."""

from __future__ import annotations

import hashlib
import os

import pytest

from capsense.core import content_hash
from capsense.core.content_hash import folder_hash


def _reference(folder) -> str:
    """sha256 over names and bytes of the config and weight files, by name, as manifests always recorded it."""
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        if p.suffix in (".safetensors", ".bin", ".json") and p.is_file() and not p.name.startswith("."):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPSENSE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CAPSENSE_HASH_CACHE", raising=False)
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"a": 1}')
    (d / "model.safetensors").write_bytes(b"\x01" * 4096)
    (d / "README.md").write_text("not hashed")
    (d / ".hidden.json").write_text("not hashed")
    return d


@pytest.fixture
def reads(monkeypatch):
    calls = []
    real = content_hash._read_hash

    def counted(files):
        calls.append([p.name for p in files])
        return real(files)

    monkeypatch.setattr(content_hash, "_read_hash", counted)
    return calls


def test_value_is_the_bytes_hash_and_is_read_once(folder, reads):
    first = folder_hash(folder)
    assert first == _reference(folder)
    assert folder_hash(folder) == first
    assert reads == [["config.json", "model.safetensors"]]  # the second call read nothing


def test_a_rewrite_that_keeps_size_and_mtime_is_read_again(folder, reads):
    before = folder_hash(folder)
    w = folder / "model.safetensors"
    st = w.stat()
    w.write_bytes(b"\x02" * 4096)
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same size and modification time: only ctime moved
    after = folder_hash(folder)
    assert len(reads) == 2
    assert after == _reference(folder) != before


def test_an_added_or_removed_file_is_read_again(folder, reads):
    before = folder_hash(folder)
    (folder / "generation_config.json").write_text("{}")
    added = folder_hash(folder)
    assert added == _reference(folder) != before
    (folder / "generation_config.json").unlink()
    assert folder_hash(folder) == before
    assert len(reads) == 3


def test_an_unwritable_cache_costs_the_read_not_the_run(folder, reads, tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("x")
    monkeypatch.setenv("CAPSENSE_CACHE", str(blocker))  # cache_dir()/hashes cannot be made under a file
    assert folder_hash(folder) == _reference(folder)
    assert folder_hash(folder) == _reference(folder)
    assert len(reads) == 2


def test_a_corrupt_entry_is_replaced(folder, reads):
    folder_hash(folder)
    entries = list((folder.parent / "cache" / "hashes").iterdir())
    assert len(entries) == 1
    entries[0].write_text('{"path": "elsewhere", "files": [], "sha256": "0"}')
    assert folder_hash(folder) == _reference(folder)
    entries[0].write_text("not json")
    assert folder_hash(folder) == _reference(folder)
    assert folder_hash(folder) == _reference(folder)
    assert len(reads) == 3  # the last call found the entry the third wrote


def test_the_cache_can_be_turned_off(folder, reads, monkeypatch):
    monkeypatch.setenv("CAPSENSE_HASH_CACHE", "0")
    folder_hash(folder)
    folder_hash(folder)
    assert len(reads) == 2
    assert not (folder.parent / "cache" / "hashes").exists()

"""The content hash a manifest records for a local model folder, read once per version of its files.

:func:`folder_hash` is sha256 over the names and bytes of a folder's config and weight files: what a run
folder's identity and a model card name as the base weights. Reading every byte costs about a second per
GB on this project's CPU machines (``recipes/bench/bench_content_hash.py``: SmolLM2-135M's 0.54 GB float32
folder in 0.52 s, Gemma 3 270M's 1.11 GB in 1.03 s, page cache warm), so an 8B model's 16 GB took about 15 s and
a 70B model's 140 GB about 2 min, on every ``locate``, ``export`` and ``compress``, before any work, and longer
from a cold or network disk.

So the hash is kept in the capsense cache (:func:`~capsense.core.files.cache_dir`, ``hashes/``), keyed by
the folder's resolved path, beside what :func:`os.stat` says of each hashed file: its name, size,
modification time and inode change time (nanoseconds). While every file's stat is the same the recorded
hash is returned; any difference (a file rewritten, added, removed, touched, copied elsewhere) reads the
bytes again. The inode change time cannot be set back by a user (``touch -d`` sets the modification time
and moves the change time), so a rewrite that keeps size and modification time is still seen. The value is
the same either way (the hash of the bytes, as before the cache: run folders made before it resume).

A cache that cannot be written (a read-only home, a full disk) costs the read, never the run: the hash is
computed and returned. ``CAPSENSE_HASH_CACHE=0`` turns the cache off (every call reads every byte).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from capsense.core.files import atomic_write_json, cache_dir

#: The suffixes of the files hashed (config and weights; a tokenizer's JSON files too).
HASHED_SUFFIXES = (".safetensors", ".bin", ".json")
_CHUNK = 1 << 20


def hashed_files(folder: Path) -> list[Path]:
    """The files :func:`folder_hash` reads, in the order it reads them (by name; hidden files skipped)."""
    return [p for p in sorted(folder.iterdir())
            if p.suffix in HASHED_SUFFIXES and p.is_file() and not p.name.startswith(".")]


def _stats(files: list[Path]) -> list[list]:
    out = []
    for p in files:
        st = p.stat()
        out.append([p.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
    return out


def _read_hash(files: list[Path]) -> str:
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode())
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                h.update(chunk)
    return h.hexdigest()


def _cache_file(folder: Path) -> Path:
    key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:32]
    return cache_dir() / "hashes" / f"{key}.json"


def _cached(entry: Path, folder: Path, stats: list[list]) -> str | None:
    try:
        got = json.loads(entry.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(got, dict) or got.get("path") != str(folder.resolve()) or got.get("files") != stats:
        return None
    value = got.get("sha256")
    return value if isinstance(value, str) and len(value) == 64 else None


def folder_hash(folder: Path) -> str:
    """sha256 over the names and bytes of ``folder``'s config and weight files (:func:`hashed_files`), read
    again only when a file's stat differs from the last read's (see the module docstring)."""
    folder = Path(folder)
    files = hashed_files(folder)
    if os.environ.get("CAPSENSE_HASH_CACHE", "1") == "0":
        return _read_hash(files)
    stats = _stats(files)
    entry = _cache_file(folder)
    if (value := _cached(entry, folder, stats)) is not None:
        return value
    value = _read_hash(files)
    if _stats(files) != stats:  # a file changed while it was read: the value names no one version, keep none
        return value
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(entry, {"path": str(folder.resolve()), "files": stats, "sha256": value})
    except OSError:
        pass  # (an unwritable cache costs the read, not the run)
    return value

"""A validation's finished conditions, kept in its output folder so that a killed validation resumes.

A validation runs lm-eval once per condition (the clean model, the set under test, each random set): on an 8B-70B
model each condition over the held-out suite takes minutes to hours, and a validation killed in its last condition
lost them all. ``<out>/conditions.jsonl`` records what makes the numbers on its first line (model, ablation with a
digest of its reference texts, dtype, device, batch size, the held-out documents of every task, library versions)
and each finished condition's lm-eval results on a line of its own, written and synced as the condition ends.
A rerun of the same settings reads the finished conditions and evaluates only the rest, so ``capsense validate``
and ``capsense run`` resume as a locate run does. A file recorded under other settings is set aside as
``conditions.jsonl.stale`` and the validation starts over, saying which setting differs; a line cut short by a kill
is ignored. One writer per folder (:class:`capsense.core.lock.RunFolderLock`), taken by the main process only
under ``accelerate launch``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from capsense.core.files import append_jsonl, read_jsonl, repair_jsonl_tail
from capsense.core.lock import RunFolderLock

CONDITIONS_FILE = "conditions.jsonl"


class ConditionStore:
    """The finished conditions of a validation writing to ``folder``, under the settings ``key``.

    :meth:`open` takes the folder's lock and reads what a matching earlier run finished; :meth:`get` answers a
    finished condition (a label and its head set) or None; :meth:`put` appends one; :meth:`close` drops the lock."""

    def __init__(self, folder: str | os.PathLike, key: dict[str, Any], log: Callable[[str], None] = print) -> None:
        self.folder = Path(folder)
        self.key = json.loads(json.dumps(key))  # as it reads back from the file (tuples as lists)
        self.log = log
        self.finished: dict[str, dict[str, Any]] = {}
        self._lock = RunFolderLock(self.folder)

    @property
    def path(self) -> Path:
        return self.folder / CONDITIONS_FILE

    def open(self) -> dict[str, dict[str, Any]]:
        """Take the lock; load the finished conditions of an earlier run of the same settings (set a file of other
        settings aside); return them by label."""
        self._lock.acquire()
        repair_jsonl_tail(self.path)  # a line a kill cut short
        lines = read_jsonl(self.path)
        if lines and lines[0].get("key") == self.key:
            self.finished = {c["label"]: c for c in lines[1:] if "label" in c}
            if self.finished:
                self.log(f"Resuming the validation in {self.folder}: {len(self.finished)} condition(s) finished "
                         f"({', '.join(self.finished)})")
            return self.finished
        if self.path.exists():
            old = lines[0].get("key", {}) if lines else {}
            differs = sorted(k for k in set(old) | set(self.key) if old.get(k) != self.key.get(k)) or ["unreadable"]
            os.replace(self.path, self.path.with_name(CONDITIONS_FILE + ".stale"))
            self.log(f"{self.path} was recorded under other settings ({', '.join(differs)}): set aside as "
                     f"{CONDITIONS_FILE}.stale; the validation starts over")
        append_jsonl(self.path, {"key": self.key})
        return self.finished

    def get(self, label: str, heads: str) -> dict[str, Any] | None:
        """The finished condition ``label`` if it ablated ``heads`` (its ``results`` and ``higher_is_better``)."""
        c = self.finished.get(label)
        return c if c is not None and c.get("heads") == heads else None

    def put(self, label: str, heads: str, results: dict[str, Any], higher_is_better: dict[str, Any]) -> None:
        """Record a finished condition (synced before the next one starts)."""
        entry = {"label": label, "heads": heads, "results": results, "higher_is_better": higher_is_better}
        append_jsonl(self.path, json.dumps(entry, default=str))  # lm-eval's results: strings where not numbers
        self.finished[label] = entry

    def close(self) -> None:
        self._lock.release()

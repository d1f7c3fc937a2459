"""The run folder: ``manifest.json``, append-only ``evaluations.jsonl``, resume.

Each evaluated mask is one JSON line, written, flushed and fsynced before the next mask
starts, so a run killed with SIGKILL loses at most the mask in flight. A torn last line
(killed mid-write) is dropped on reopening. Reopening a folder whose manifest has a
different *identity* (model, tasks, documents, design, seed: everything that changes
which masks are evaluated or how they score) is refused with the differing fields named.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capsense.core.files import append_jsonl, atomic_write_json, read_jsonl, repair_jsonl_tail
from capsense.core.heads import Head, HeadSet
from capsense.errors import CapsenseError

MANIFEST = "manifest.json"
EVALUATIONS = "evaluations.jsonl"
REFINE_ROUND = -1  # ``round`` of the evaluations that measure candidate top-K sets (capsense.localize.refine)


class RunStoreError(CapsenseError):
    """The output folder cannot hold this run."""


@dataclass
class Evaluation:
    """One evaluated mask: its index in the run, the heads it knocks out, scores per task."""

    index: int
    heads: list[int]  # flat head indices (layer * n_heads + head)
    scores: dict[str, dict[str, float]]  # task -> {"nll": ..., "acc": ...}
    seconds: float = 0.0
    round: int = 0

    def to_json(self, n_heads: int) -> str:
        names = [str(Head.from_index(h, n_heads)) for h in self.heads]
        return json.dumps(
            {"i": self.index, "round": self.round, "heads": names, "scores": self.scores, "seconds": round(self.seconds, 4)}
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any], n_heads: int) -> "Evaluation":
        heads = [h.flat_index(n_heads) for h in HeadSet.from_pairs(d["heads"])]
        return cls(int(d["i"]), heads, d["scores"], float(d.get("seconds", 0.0)), int(d.get("round", 0)))


@dataclass
class RunStore:
    """An open run folder; :attr:`evaluations` holds what earlier attempts evaluated."""

    path: Path
    manifest: dict[str, Any]
    n_heads: int
    evaluations: list[Evaluation] = field(default_factory=list)

    @classmethod
    def open(cls, path: str | os.PathLike, manifest: dict[str, Any], identity_keys: list[str], n_heads: int) -> "RunStore":
        """Create ``path`` or resume the run in it; refuse a folder holding something else."""
        p = Path(path)
        mpath = p / MANIFEST
        if p.exists() and not p.is_dir():
            raise RunStoreError(f"--out {str(p)!r} is a file, not a run folder")
        if mpath.is_file():
            try:
                old = json.loads(mpath.read_text())
            except json.JSONDecodeError:
                raise RunStoreError(f"{mpath} is not valid JSON: not a capsense run folder; choose another --out") from None
            diffs = [k for k in identity_keys if old.get("identity", {}).get(k) != manifest["identity"].get(k)]
            if diffs:
                shown = "; ".join(
                    f"{k}: {old.get('identity', {}).get(k)!r} there, {manifest['identity'].get(k)!r} now" for k in diffs[:4]
                )
                raise RunStoreError(
                    f"--out {str(p)!r} holds a different run ({shown}); rerun with its settings to resume it, "
                    "or choose another --out"
                )
            manifest = {**manifest, "created": old.get("created", manifest.get("created")), "resumed": old.get("resumed", 0) + 1}
        elif p.is_dir() and any(p.iterdir()):
            raise RunStoreError(f"--out {str(p)!r} is not empty and holds no {MANIFEST}: not a capsense run folder; choose another --out")
        p.mkdir(parents=True, exist_ok=True)
        store = cls(p, manifest, n_heads)
        store.evaluations = store._read()
        store.write_manifest()
        return store

    def _read(self) -> list[Evaluation]:
        epath = self.path / EVALUATIONS
        repair_jsonl_tail(epath)  # the torn last line of a killed run
        try:
            out = [Evaluation.from_dict(d, self.n_heads) for d in read_jsonl(epath)]
        except (CapsenseError, KeyError, TypeError, ValueError) as e:  # CorruptFileError, HeadSpecError among them
            raise RunStoreError(f"{epath} holds a line that is not an evaluation ({e}); the file is damaged") from None
        for i, e in enumerate(out):
            if e.index != i:
                raise RunStoreError(f"{epath}: line {i + 1} holds mask {e.index}, expected {i}; the file is damaged")
        return out

    def write_manifest(self) -> None:
        atomic_write_json(self.path / MANIFEST, self.manifest)

    def append(self, ev: Evaluation) -> None:
        """Append one evaluation durably (flush + fsync)."""
        append_jsonl(self.path / EVALUATIONS, ev.to_json(self.n_heads))
        self.evaluations.append(ev)


def read_evaluations(run_dir: str | os.PathLike, design_only: bool = False) -> list[Evaluation]:
    """The evaluations in a run folder (head names resolved with its manifest's layout).

    ``design_only`` keeps the masks of the method's design and drops the candidate top-K
    sets refine measured, which are not random and must not enter a fit.
    """
    p = Path(run_dir)
    n_heads = int(json.loads((p / MANIFEST).read_text())["layout"]["n_heads"])
    evals = [Evaluation.from_dict(d, n_heads) for d in read_jsonl(p / EVALUATIONS)]
    return [e for e in evals if e.round != REFINE_ROUND] if design_only else evals

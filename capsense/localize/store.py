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
        names = [f"L{h // n_heads}H{h % n_heads}" for h in self.heads]
        return json.dumps(
            {"i": self.index, "round": self.round, "heads": names, "scores": self.scores, "seconds": round(self.seconds, 4)}
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any], n_heads: int) -> "Evaluation":
        heads = []
        for name in d["heads"]:
            layer, head = name[1:].split("H")
            heads.append(int(layer) * n_heads + int(head))
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
        if not epath.is_file():
            return []
        data = epath.read_bytes()
        out, good = [], 0
        for line in data.split(b"\n"):
            if not line.endswith(b"}"):
                break  # torn last line of a killed run
            try:
                out.append(Evaluation.from_dict(json.loads(line), self.n_heads))
            except (json.JSONDecodeError, KeyError, ValueError):
                break
            good += len(line) + 1
        if good != len(data):
            with epath.open("r+b") as f:
                f.truncate(good)
        for i, e in enumerate(out):
            if e.index != i:
                raise RunStoreError(f"{epath}: line {i + 1} holds mask {e.index}, expected {i}; the file is damaged")
        return out

    def write_manifest(self) -> None:
        _atomic_write(self.path / MANIFEST, json.dumps(self.manifest, indent=2, default=str) + "\n")

    def append(self, ev: Evaluation) -> None:
        """Append one evaluation durably (flush + fsync)."""
        with (self.path / EVALUATIONS).open("a") as f:
            f.write(ev.to_json(self.n_heads) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.evaluations.append(ev)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_evaluations(run_dir: str | os.PathLike, design_only: bool = False) -> list[Evaluation]:
    """The evaluations in a run folder (head names resolved with its manifest's layout).

    ``design_only`` keeps the masks of the method's design and drops the candidate top-K
    sets refine measured, which are not random and must not enter a fit.
    """
    p = Path(run_dir)
    n_heads = int(json.loads((p / MANIFEST).read_text())["layout"]["n_heads"])
    evals = [Evaluation.from_dict(json.loads(ln), n_heads) for ln in (p / EVALUATIONS).read_text().splitlines() if ln.strip()]
    return [e for e in evals if e.round != REFINE_ROUND] if design_only else evals

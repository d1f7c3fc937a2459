"""The run folder: ``manifest.json``, append-only evaluation logs, resume.

Each evaluated mask is one JSON line (``{"i": index, "heads": [...], "scores": {...}}``),
written, flushed and fsynced before the next mask starts, so a run killed with SIGKILL
loses at most the masks in flight. A torn last line (killed mid-write) is dropped.

Under several processes (``accelerate launch``) each process appends the masks it
evaluates to its own shard: the main process to ``evaluations.jsonl``, process ``k`` to
``evaluations.rank<k>.jsonl``. After every step the main process also appends what the
others evaluated to ``evaluations.jsonl``, and when a run opens or ends it *compacts* the
folder: all logs merged by mask index (a mask logged twice counts once), rewritten as one
``evaluations.jsonl`` in index order, the shards removed. So a resumed run, with any number
of processes, reuses every mask any process finished, and a finished run's folder is the
same as a single-process run's. Old folders with a single ``evaluations.jsonl`` resume as is.

Reopening a folder whose manifest has a different *identity* (model, tasks, documents,
design, seed: everything that changes which masks are evaluated or how they score) is
refused with the differing fields named. A field a folder does not record (written by an
earlier release, before the setting existed) is compared as ``None``; the refusal says so,
and says which value reproduces what the earlier release did (``earlier``), so that value resumes it,
or that no setting does, where that release computed differently.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from capsense.core.files import append_jsonl, atomic_write_json, atomic_write_text, read_jsonl, repair_jsonl_tail
from capsense.core.heads import Head, HeadSet
from capsense.errors import CapsenseError, RunStoreError
from capsense.core.lock import LOCK_FILE

MANIFEST = "manifest.json"
EVALUATIONS = "evaluations.jsonl"
SHARD_GLOB = "evaluations.rank*.jsonl"
REFINE_ROUND = -1  # ``round`` of the evaluations that measure candidate top-K sets (capsense.localize.refine)
POOL_ROUND = -2  # ``round`` of the heads measure-and-choose measured alone to widen its pool (capsense.localize.pool)


def shard_name(rank: int) -> str:
    """The evaluation log process ``rank`` appends to."""
    return EVALUATIONS if rank == 0 else f"evaluations.rank{rank}.jsonl"


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


def _read_log(path: Path, n_heads: int, repair: bool) -> list[Evaluation]:
    """The evaluations in one log; a torn last line (killed writer) is skipped, and cut off if ``repair``."""
    if repair:
        repair_jsonl_tail(path)
    try:
        return [Evaluation.from_dict(d, n_heads) for d in read_jsonl(path)]
    except (CapsenseError, KeyError, TypeError, ValueError) as e:  # a torn line inside, a bad head name among them
        raise RunStoreError(f"{path} holds a line that is not an evaluation ({e}); the file is damaged") from None


def merge(logs: Iterable[list[Evaluation]], where: Path) -> dict[int, Evaluation]:
    """Evaluations by mask index; a mask logged twice counts once (its heads must agree)."""
    out: dict[int, Evaluation] = {}
    for log in logs:
        for e in log:
            seen = out.get(e.index)
            if seen is None:
                out[e.index] = e
            elif seen.heads != e.heads:
                raise RunStoreError(f"{where}: mask {e.index} is logged with two different head sets: the folder is damaged")
    return out


def _all_logs(path: Path, n_heads: int, repair: bool) -> dict[int, Evaluation]:
    files = [path / EVALUATIONS, *sorted(path.glob(SHARD_GLOB))]
    return merge((_read_log(f, n_heads, repair) for f in files), path)


@dataclass
class RunStore:
    """An open run folder. :attr:`done` holds every evaluation any earlier attempt (or any
    process of this one) finished, by mask index; :meth:`append` logs one to this process's shard."""

    path: Path
    manifest: dict[str, Any]
    n_heads: int
    rank: int = 0
    done: dict[int, Evaluation] = field(default_factory=dict)

    @classmethod
    def open(cls, path: str | os.PathLike, manifest: dict[str, Any], identity_keys: list[str], n_heads: int,
             earlier: dict[str, str | None] | None = None) -> "RunStore":
        """Create ``path`` or resume the run in it (compacting its logs); refuse a folder holding something else.

        ``earlier`` says, per identity key, the setting that resumes a folder from before the key
        was recorded (the refusal quotes it), or None where no setting does (that release computed differently).

        Call it on the main process only, holding the folder's lock; the other processes
        then call :meth:`attach`.
        """
        p = Path(path)
        manifest = _check_folder(p, manifest, identity_keys, earlier or {})
        p.mkdir(parents=True, exist_ok=True)
        store = cls(p, manifest, n_heads)
        store.compact()
        store.write_manifest()
        return store

    @classmethod
    def attach(cls, path: str | os.PathLike, n_heads: int, rank: int) -> "RunStore":
        """The folder the main process opened, as process ``rank`` sees it (read-only but for its shard)."""
        p = Path(path)
        manifest = json.loads((p / MANIFEST).read_text())
        return cls(p, manifest, n_heads, rank, _all_logs(p, n_heads, repair=False))

    @property
    def evaluations(self) -> list[Evaluation]:
        """The finished evaluations in index order."""
        return [self.done[i] for i in sorted(self.done)]

    def compact(self) -> None:
        """Merge every log into one ``evaluations.jsonl`` in index order and remove the shards
        (main process, while no other process writes)."""
        self.done = _all_logs(self.path, self.n_heads, repair=True)
        shards = sorted(self.path.glob(SHARD_GLOB))
        main = self.path / EVALUATIONS
        if shards or [e.index for e in _read_log(main, self.n_heads, False)] != sorted(self.done):
            atomic_write_text(main, "".join(self.done[i].to_json(self.n_heads) + "\n" for i in sorted(self.done)))
        for s in shards:  # after the merged log is in place: a kill in between only leaves duplicates
            s.unlink()

    def write_manifest(self) -> None:
        atomic_write_json(self.path / MANIFEST, self.manifest)

    def append(self, ev: Evaluation) -> None:
        """Log one evaluation of this process durably (flush + fsync)."""
        append_jsonl(self.path / shard_name(self.rank), ev.to_json(self.n_heads))
        self.done[ev.index] = ev

    def record(self, evs: Iterable[Evaluation]) -> None:
        """Take in evaluations other processes logged; the main process copies them into ``evaluations.jsonl``."""
        new = [e for e in evs if e.index not in self.done]
        for e in sorted(new, key=lambda e: e.index):
            if self.rank == 0:
                append_jsonl(self.path / EVALUATIONS, e.to_json(self.n_heads))
            self.done[e.index] = e


def _check_folder(p: Path, manifest: dict[str, Any], identity_keys: list[str],
                  earlier: dict[str, str | None]) -> dict[str, Any]:
    """The manifest to write: ``manifest``, or the resumed run's with its creation time kept."""
    mpath = p / MANIFEST
    if p.exists() and not p.is_dir():
        raise RunStoreError(f"`out` {str(p)!r} is a file, not a run folder")
    if mpath.is_file():
        try:
            old = json.loads(mpath.read_text())
        except json.JSONDecodeError:
            raise RunStoreError(f"{mpath} is not valid JSON: not a capsense run folder; choose another `out`") from None
        _check_identity(p, old.get("identity", {}), manifest["identity"], identity_keys, earlier)
        return {**manifest, "created": old.get("created", manifest.get("created")), "resumed": old.get("resumed", 0) + 1}
    if p.is_dir() and any(q.name != LOCK_FILE for q in p.iterdir()):
        raise RunStoreError(f"`out` {str(p)!r} is not empty and holds no {MANIFEST}: not a capsense run folder; choose another `out`")
    return manifest


def _check_identity(p: Path, old: dict[str, Any], new: dict[str, Any], keys: list[str],
                    earlier: dict[str, str | None]) -> None:
    """Refuse to resume a folder whose identity differs, naming the fields and how to resume it."""
    diffs = [k for k in keys if old.get(k) != new.get(k)]
    if not diffs:
        return
    absent = [k for k in diffs if k not in old]
    shown = "; ".join(
        f"{k}: not recorded there (written by an earlier release), {_brief(new.get(k))} now" if k in absent
        else _difference(k, old.get(k), new.get(k)) for k in diffs[:4]
    )
    if lost := [k for k in absent if k in earlier and earlier[k] is None]:
        raise RunStoreError(f"`out` {str(p)!r} holds a different run ({shown}); no setting of this release computes "
                            f"{' and '.join(lost)} as that one did, so none resumes it: choose another `out`")
    hints = [earlier[k] for k in absent if k in earlier]
    how = (f"to resume it give {' and '.join(hints)}" if hints and len(hints) == len(diffs)
           else "rerun with its settings to resume it")
    raise RunStoreError(f"`out` {str(p)!r} holds a different run ({shown}); {how}, or choose another `out`")


def _brief(value: Any, width: int = 80) -> str:
    """``repr(value)``, cut at ``width`` characters (a cut list or mapping says how many items it holds)."""
    text = repr(value)
    if len(text) <= width:
        return text
    return text[:width] + (f"... ({len(value)} items)" if isinstance(value, (list, tuple, dict)) else "...")


def _difference(key: str, old: Any, new: Any) -> str:
    """One identity field's difference in words. A mapping of long values (``doc_ids``: every task's document ids)
    is told by its keys: the whole of both printed some 5,000 characters for one added control."""
    if isinstance(old, dict) and isinstance(new, dict) and len(repr(old)) + len(repr(new)) > 200:
        parts = [f"{', '.join(map(str, names))} {where}" for names, where in (
            (sorted(set(old) - set(new)), "only there"), (sorted(set(new) - set(old)), "only now"),
            (sorted(x for x in set(old) & set(new) if old[x] != new[x]), "changed"))
            if names]
        return f"{key} differ ({'; '.join(parts)})"
    return f"{key}: {_brief(old)} there, {_brief(new)} now"


def recorded_identity(path: str | os.PathLike) -> dict[str, Any]:
    """The identity the run folder ``path`` records; {} where it holds none or an unreadable one (opening it says why)."""
    try:
        identity = json.loads((Path(path) / MANIFEST).read_text()).get("identity")
    except (OSError, ValueError, AttributeError):
        return {}
    return identity if isinstance(identity, dict) else {}


def used_documents(heads_path: str | os.PathLike) -> dict[str, list[int]]:
    """Document ids per task that the locate run behind ``heads_path`` (its heads.json, beside the run's manifest)
    scored ({} if unknown): what validation holds out, and what evaluate says it evaluated in-sample."""
    manifest = Path(heads_path).parent / MANIFEST
    if not manifest.is_file():
        return {}
    probes = json.loads(manifest.read_text()).get("probes", {})
    return {t: [int(d) for d in p.get("doc_ids", [])] for t, p in probes.items()}


def check_run_folder(path: str | os.PathLike) -> None:
    """Refuse, before anything is written, a path that is a file or a non-empty folder holding no run."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise RunStoreError(f"`out` {str(p)!r} is a file, not a run folder")
    if p.is_dir() and not (p / MANIFEST).is_file() and any(q.name != LOCK_FILE for q in p.iterdir()):
        raise RunStoreError(f"`out` {str(p)!r} is not empty and holds no {MANIFEST}: not a capsense run folder; choose another `out`")


def read_evaluations(run_dir: str | os.PathLike, design_only: bool = False, joined: bool = True) -> list[Evaluation]:
    """The evaluations in a run folder, in index order (every log merged; head names resolved
    with its manifest's layout), a mask scored over several calls joined into one (:func:`join_probes`;
    ``joined`` False: as stored, one per call).

    ``design_only`` keeps the masks of the method's design and drops the candidate top-K
    sets refine measured and the single heads it measured to widen its pool, which follow from
    the fit and must not enter one.
    """
    p = Path(run_dir)
    n_heads = int(json.loads((p / MANIFEST).read_text())["layout"]["n_heads"])
    done = _all_logs(p, n_heads, repair=False)
    evals = [done[i] for i in sorted(done)]
    evals = join_probes(evals) if joined else evals
    return [e for e in evals if e.round not in (REFINE_ROUND, POOL_ROUND)] if design_only else evals


def join_probes(evals: Iterable[Evaluation]) -> list[Evaluation]:
    """One evaluation per mask scored over several calls, each on other probes (a single's target, then its
    controls one call each: :func:`capsense.localize.singles.controls_until_beyond`): the same heads in the same
    round with probes none of the earlier ones holds join the first, which keeps its index, with the scores of
    all and their seconds summed. Anything else (the same heads on a probe already scored) stays apart."""
    out: list[Evaluation] = []
    first: dict[tuple[int, tuple[int, ...]], Evaluation] = {}
    for e in evals:
        key = (e.round, tuple(e.heads))
        held = first.get(key)
        if held is not None and not set(held.scores) & set(e.scores):
            held.scores = {**held.scores, **e.scores}
            held.seconds += e.seconds
            continue
        joined = Evaluation(e.index, list(e.heads), dict(e.scores), e.seconds, e.round)
        first[key] = joined
        out.append(joined)
    return out

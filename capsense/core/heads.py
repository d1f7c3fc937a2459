"""Head sets: which (layer, head) pairs to ablate, parsed from specs, lists and heads files.

Accepted forms:

* a spec string: ``L16H21``, ``L16H21+L15H13``, ``[L16H21,L15H13]`` (``+``, ``,`` or
  whitespace between heads; ``+`` is the one that survives lm-eval's comma-split
  ``--model_args``);
* a sequence of ``(layer, head)`` pairs or :class:`Head` objects;
* a heads JSON file, ranked best first::

    {"model": "org/name", "heads": [{"layer": 16, "head": 21, "importance": 0.8, ...}, ...]}
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Union

from capsense.errors import HeadSpecError
from capsense.core.arch import HeadLayout
from capsense.core.files import atomic_write_json


class Head(NamedTuple):
    layer: int
    head: int

    def __str__(self) -> str:
        return f"L{self.layer}H{self.head}"

    @classmethod
    def from_index(cls, index: int, n_heads: int) -> Head:
        """The head at flat position ``index`` (layer-major: ``layer * n_heads + head``)."""
        return cls(int(index) // n_heads, int(index) % n_heads)

    def flat_index(self, n_heads: int) -> int:
        """This head's flat position (layer-major), the inverse of :meth:`from_index`."""
        return self.layer * n_heads + self.head


_HEAD_RE = re.compile(r"^[Ll](\d+)[Hh](\d+)$")
_SPEC_HELP = "expected heads like 'L16H21', 'L16H21+L15H13' or '[L16H21,L15H13]'"

HeadsLike = Union["HeadSet", str, os.PathLike, Iterable]


def _parse_head(token: str) -> Head:
    m = _HEAD_RE.match(token.strip())
    if not m:
        raise HeadSpecError(f"malformed head {token!r}: {_SPEC_HELP}")
    return Head(int(m.group(1)), int(m.group(2)))


@dataclass(frozen=True)
class HeadSet(Sequence):
    """An ordered, duplicate-free set of attention heads (order = rank for ranked files). ``made_for``: the layout of
    the model a heads file's run located them on, where it says; :meth:`check_fits` refuses another model's (a head
    index names another head there, though it may fit)."""

    heads: tuple[Head, ...] = ()
    made_for: HeadLayout | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        seen: dict[Head, None] = {}
        for h in self.heads:
            seen.setdefault(Head(int(h[0]), int(h[1])), None)
        object.__setattr__(self, "heads", tuple(seen))

    # -- construction -------------------------------------------------------------------
    @classmethod
    def parse(cls, spec: HeadsLike, top_k: int | None = None) -> HeadSet:
        """Build a head set from any accepted form; ``top_k`` keeps the first k heads."""
        if isinstance(spec, HeadSet):
            heads = spec
        elif isinstance(spec, (str, os.PathLike)) and looks_like_heads_file(spec):
            return load_heads_file(spec).selected(top_k)
        elif isinstance(spec, str):
            heads = cls.from_spec(spec)
        elif isinstance(spec, Iterable):
            heads = cls.from_pairs(spec)
        else:
            raise HeadSpecError(f"cannot read heads from {type(spec).__name__}: {_SPEC_HELP}")
        return heads.top(top_k) if top_k is not None else heads

    @classmethod
    def from_spec(cls, spec: str) -> HeadSet:
        text = spec.strip()
        if text.startswith("[") != text.endswith("]"):
            raise HeadSpecError(f"malformed head spec {spec!r}: unbalanced brackets; {_SPEC_HELP}")
        text = text.strip("[]").strip()
        if not text:
            return cls()
        tokens = [t for t in re.split(r"[+,\s]+", text) if t]
        return cls(tuple(_parse_head(t) for t in tokens))

    @classmethod
    def named(cls, spec: Any) -> HeadSet | None:
        """The heads a spec string or a list of names or pairs names, or None where it names none or is no spec
        (a path, a sentence, a number): for readers that take a spec where they find one, where :meth:`parse` is for
        what must be one (it raises)."""
        if not spec:
            return None
        try:
            named = cls.from_spec(spec) if isinstance(spec, str) else cls.from_pairs(spec)
        except (HeadSpecError, TypeError):
            return None
        return named or None

    @classmethod
    def from_pairs(cls, pairs: Iterable) -> HeadSet:
        heads = []
        for item in pairs:
            if isinstance(item, str):
                heads.append(_parse_head(item))
                continue
            try:
                layer, head = item
                if isinstance(layer, bool) or isinstance(head, bool):
                    raise TypeError
                heads.append(Head(int(layer), int(head)))
            except (TypeError, ValueError):
                raise HeadSpecError(
                    f"malformed head {item!r}: expected a (layer, head) pair of integers"
                ) from None
        return cls(tuple(heads))

    # -- sequence protocol --------------------------------------------------------------
    def __getitem__(self, i):  # type: ignore[override]
        return self.heads[i]

    def __len__(self) -> int:
        return len(self.heads)

    def __iter__(self) -> Iterator[Head]:
        return iter(self.heads)

    def __contains__(self, item: object) -> bool:
        return item in self.heads

    def __str__(self) -> str:
        return "+".join(str(h) for h in self.heads)

    # -- helpers ------------------------------------------------------------------------
    def top(self, k: int) -> HeadSet:
        """The first ``k`` heads (the top k of a ranked set)."""
        if int(k) < 0:
            raise HeadSpecError(f"top_k must be >= 0, got {k}")
        return HeadSet(self.heads[: int(k)], self.made_for)

    def layers(self) -> list[int]:
        """Sorted layers that hold at least one head of the set."""
        return sorted({h.layer for h in self.heads})

    def by_layer(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for h in self.heads:
            out.setdefault(h.layer, []).append(h.head)
        return out

    def check_fits(self, layout: HeadLayout) -> HeadSet:
        """Raise :class:`HeadSpecError` naming the valid range if a head does not fit, or naming both shapes if the
        heads were located on a model of another shape: a Gemma 3 270M file (18 x 4) fits SmolLM2 (30 x 9), and
        ``capsense evaluate smollm2-135m --heads`` it ablated two unrelated heads without a word. Models of one
        shape are told apart by what both layouts know (:meth:`HeadLayout.differences`: key/value heads, head width,
        model type); a fine-tuned variant of the model passes."""
        differ = self.made_for.differences(layout) if self.made_for is not None else []
        if differ:
            raise HeadSpecError(
                f"these heads were located on {self.made_for.describe()}; this model is {layout.describe()} (they "
                f"differ in {' and '.join(differ)}), and the same indices name other heads there: use a heads file of "
                "this model (or give the heads as a spec)")
        for h in self.heads:
            if not 0 <= h.layer < layout.n_layers:
                raise HeadSpecError(
                    f"layer {h.layer} out of range in {h}: this model has {layout.n_layers} "
                    f"layers (0-{layout.n_layers - 1})"
                )
            if not 0 <= h.head < layout.n_heads:
                raise HeadSpecError(
                    f"head {h.head} out of range in {h}: this model has {layout.n_heads} "
                    f"heads per layer (0-{layout.n_heads - 1})"
                )
        return self


def looks_like_heads_file(spec: str | os.PathLike) -> bool:
    """True when ``spec`` names a heads JSON file rather than a head spec string."""
    s = os.fspath(spec)
    return s.endswith(".json") or os.path.isfile(s)


@dataclass
class HeadsFile:
    """A ranked heads file: the model it was made for, per-head records and run metadata."""

    model: str
    heads: list[dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def made_for(self) -> HeadLayout | None:
        """The layout of the model the run located on (``layout``), where the file says."""
        return HeadLayout.from_dict(self.meta.get("layout"))

    @property
    def revision(self) -> str | None:
        """The Hub revision (branch, tag or commit) its run loaded ``model`` at, where the file says; None: the
        default branch, or a model with one version (a folder, an embedded model)."""
        value = self.meta.get("revision")
        return value if isinstance(value, str) and value else None

    @property
    def head_set(self) -> HeadSet:
        return HeadSet(tuple(Head(int(r["layer"]), int(r["head"])) for r in self.heads), self.made_for)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, **self.meta, "heads": self.heads}

    @property
    def chosen(self) -> HeadSet | None:
        """The set a locate run chose and measured (``refine.heads``; it leads the ranking), or None."""
        refine = self.meta.get("refine")
        named = refine.get("heads") if isinstance(refine, dict) else None
        return HeadSet(HeadSet.from_pairs(named).heads, self.made_for) if named else None

    def selected(self, top_k: int | None = None) -> HeadSet:
        """The heads to act on: the first ``top_k``; without it, the set the run chose; a file with neither a
        chosen set nor ranks (one written by hand), every head in it.

        Why not every head of a ranking: a locate run's ``heads.json`` ranks every head it scored (270 on
        SmolLM2), so ``capsense export MODEL --heads heads.json`` without ``--top-k`` ablated all of them. On the main
        job's file, ``capsense evaluate smollm2-135m --tasks capsense_induction,capsense_prose --limit 8 --heads
        heads.json`` moved prose by +213.5% in nats/token that way, and by -0.7% with the chosen five (round 50). A
        ranking with no chosen set asks for ``top_k``."""
        if top_k is not None:
            return self.head_set.top(top_k)
        if (chosen := self.chosen) is not None:
            return chosen
        if any("rank" in r for r in self.heads):
            raise HeadSpecError(f"the heads file ranks {len(self.heads)} heads and names no chosen set (its run had no "
                                "measure-and-choose step): give `top_k`, how many of its first heads to take")
        return self.head_set


def load_heads_file(path: str | os.PathLike) -> HeadsFile:
    """Read and check a heads JSON file."""
    p = Path(path)
    if not p.is_file():
        raise HeadSpecError(f"heads file {str(p)!r} not found")
    try:
        data = json.loads(p.read_text())
    except OSError as e:  # e.g. permission denied
        raise HeadSpecError(f"cannot read heads file {str(p)!r}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HeadSpecError(
            f"heads file {str(p)!r} is not valid JSON ({e}); expected "
            '{"model": ..., "heads": [{"layer": int, "head": int, ...}, ...]}'
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("heads"), list):
        raise HeadSpecError(
            f"heads file {str(p)!r} has no 'heads' list; expected "
            '{"model": ..., "heads": [{"layer": int, "head": int, ...}, ...]}'
        )
    records = []
    for i, r in enumerate(data["heads"]):
        if not isinstance(r, dict) or not all(
            isinstance(r.get(k), int) and not isinstance(r.get(k), bool) for k in ("layer", "head")
        ):
            raise HeadSpecError(
                f"heads file {str(p)!r}: entry {i} must be an object with integer 'layer' and "
                f"'head', got {r!r}"
            )
        records.append(r)
    meta = {k: v for k, v in data.items() if k not in ("model", "heads")}
    return HeadsFile(model=str(data.get("model", "")), heads=records, meta=meta)


def located_revision(heads: HeadsLike | None, model: str, revision: str | None) -> str | None:
    """The revision of ``model`` to load for ``heads``: ``revision`` when given, else the one the run behind
    ``heads`` (a heads file) loaded, where ``model`` is the model that run located on; None otherwise (a spec,
    another model such as a local copy, a run on the default branch). What validate, evaluate, export and
    ``capsense-masked`` load by default: until round 52 they loaded the default branch whatever revision a run
    located on, and applied its heads to other weights of the same shape without a word."""
    if revision:
        return revision
    if isinstance(heads, (str, os.PathLike)) and looks_like_heads_file(heads):
        hf = load_heads_file(heads)
        return hf.revision if hf.model == model else None
    return None


def write_heads_file(path: str | os.PathLike, heads_file: HeadsFile) -> Path:
    """Write a heads file atomically, with the umask's mode like the rest of its run folder (0644 usually)."""
    return atomic_write_json(path, heads_file.to_dict())

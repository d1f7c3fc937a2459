"""What every capsense task shares: token counts, per-sample results and aggregation.

Each task reports ``acc`` and ``nats_per_token``: the reference continuation's negative
log-likelihood divided by its token count, aggregated token-weighted over documents
(sum of nats / sum of tokens). Token counts need the model's tokenizer: lm-eval hands the
model args (``pretrained``, ``tokenizer``) to ``custom_dataset`` as task metadata, and the
builder stores each continuation's token count in the document, counted the way lm-eval's
``HFLM`` splits (context, continuation). Without a tokenizer the metric is NaN.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable
from typing import Any

log = logging.getLogger("capsense.tasks")


@functools.lru_cache(maxsize=4)
def _load_tokenizer(name: str, revision: str | None = None):
    """:func:`capsense.core.models.load_tokenizer`, once per (name, revision): every task of a run counts with it."""
    from capsense.core.models import load_tokenizer

    return load_tokenizer(name, revision)


class SharedTokenizer:
    """A loaded tokenizer handed to tasks through lm-eval's task metadata, shared where lm-eval would copy it.

    lm-eval deep-copies a task's config, metadata included, each time it reports the task (``dump_config``):
    a deep copy of SmolLM2's fast tokenizer costs about 0.11 s, 12 s of a validation of 18 tasks under 5 head
    sets (round 30's profile). The tokenizer is read, never changed, so every copy can be this one. A task of
    one's own that reads ``metadata["tokenizer"]`` gets the tokenizer's attributes and call through it (under
    the ``lm_eval`` command the same key holds a model name: :func:`tokenizer_from_metadata` reads both).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        if name == "tokenizer":  # (not set yet: while unpickling)
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> "SharedTokenizer":
        return self

    def __copy__(self) -> "SharedTokenizer":
        return self


def tokenizer_from_metadata(metadata: dict[str, Any]):
    """The tokenizer named by lm-eval model args (``tokenizer`` or ``pretrained``, at ``revision`` where given: what
    lm-eval's ``HFLM`` loads for the same args), or None."""
    for key in ("tokenizer", "pretrained"):
        value = metadata.get(key)
        if isinstance(value, SharedTokenizer):
            return value.tokenizer
        if isinstance(value, str) and value:
            return _load_tokenizer(value, metadata.get("revision"))
        if value is not None and hasattr(value, "encode") and key == "tokenizer":
            return value
        if value is not None and hasattr(value, "name_or_path") and key == "pretrained":
            return _load_tokenizer(value.name_or_path)
    return None


def docs_from_pairs(pairs, sep: str = " ") -> list[dict[str, Any]]:
    """Documents ``{"id", "context", "continuation"}`` from (context, answer) pairs, in order; the
    answer follows ``sep`` (a space for words, "" where the pair carries its own spacing)."""
    return [{"id": i, "context": c, "continuation": sep + a} for i, (c, a) in enumerate(pairs)]


def split_pair(context: str, continuation: str) -> tuple[str, str]:
    """Move trailing spaces of the context onto the continuation, as lm-eval does."""
    n = len(context) - len(context.rstrip())
    if n:
        return context[:-n], context[-n:] + continuation
    return context, continuation


def continuation_tokens(tokenizer, context: str, continuation: str) -> int:
    """Number of tokens lm-eval's HFLM scores for ``continuation`` after ``context``."""
    context, continuation = split_pair(context, continuation)
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    return len(whole) - len(ctx)


def to_dataset(docs: list[dict[str, Any]], metadata: dict[str, Any], choices: bool = False):
    """Wrap documents as lm-eval's ``custom_dataset`` result, adding token counts."""
    import datasets

    tokenizer = tokenizer_from_metadata(metadata)
    if tokenizer is None:
        log.warning(
            "capsense tasks: no tokenizer in the model args or --metadata; "
            "nats_per_token will be NaN"
        )
    for d in docs:
        if tokenizer is None:
            d["n_tokens"] = -1
        elif choices:
            d["n_tokens"] = continuation_tokens(
                tokenizer, d["context"], " " + d["choices"][d["gold"]]
            )
        else:
            d["n_tokens"] = continuation_tokens(tokenizer, d["context"], d["continuation"])
    return {"test": datasets.Dataset.from_list(docs)}


def process_loglikelihood(doc: dict[str, Any], results: list) -> dict[str, Any]:
    """Per-sample metrics of a loglikelihood request: greedy match and (nats, tokens)."""
    ll, is_greedy = results[0]
    return {"acc": float(is_greedy), "nats_per_token": (-float(ll), int(doc["n_tokens"]))}


def process_choice(doc: dict[str, Any], results: list) -> dict[str, Any]:
    """Per-sample metrics of a multiple-choice doc: accuracy and the gold choice's nats."""
    lls = [float(r[0]) for r in results]
    gold = int(doc["gold"])
    best = max(range(len(lls)), key=lambda i: lls[i])
    return {"acc": float(best == gold), "nats_per_token": (-lls[gold], int(doc["n_tokens"]))}


def nats_per_token(items: Iterable[tuple[float, int]]) -> float:
    """Token-weighted mean: total nats over total tokens (NaN without token counts)."""
    items = list(items)
    if not items or any(n <= 0 for _, n in items):
        return math.nan
    return sum(nll for nll, _ in items) / sum(n for _, n in items)

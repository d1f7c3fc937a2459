"""lm-eval tasks as token requests: loading a task, drawing its documents, and tokenizing them the way lm-eval's
``HFLM`` does, so that a probe (:mod:`capsense.scoring.probe`) scores what ``lm_eval --model hf`` would.

Three request kinds become (context, continuation) token pairs: a log-likelihood request (:func:`encode_pair`), each
choice of a multiple-choice document (the same), and a perplexity document, ``output_type: loglikelihood_rolling``
(wikitext's kind: the whole text predicted, :func:`rolling_requests`). The checks here load tasks, never the model,
so a run refuses a metric that does not fit its tasks before its load.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import numpy as np

from capsense.errors import CapsenseError

#: lm-eval's output type of a perplexity task (wikitext's): one request per document, its whole text predicted.
ROLLING = "loglikelihood_rolling"
#: The window of a perplexity document's requests where no model says its own (lm-eval's default ``max_length``).
ROLLING_WINDOW = 2048


def load_task(task: str, include_path: Sequence[str | os.PathLike] = (), tokenizer=None):
    """An lm-eval task object by name; capsense's ``lm_eval_tasks`` are always included.

    Without ``tokenizer`` the caller reads the task's shape (its documents, their count, its output type), never a
    score, so capsense's builders' warning that they cannot count tokens (nats_per_token NaN) is held back: a
    compression's held-out check printed it once per task, about results it never computes."""
    import logging

    from lm_eval.tasks import get_task_dict

    from capsense.tasks import logger_level, task_data_errors, task_manager

    metadata = {"tokenizer": tokenizer} if tokenizer is not None else None
    manager = task_manager(include_path, [task], metadata=metadata)
    with task_data_errors([task]), logger_level("capsense.tasks", logging.ERROR if tokenizer is None else None):
        obj = get_task_dict([task], manager)[task]
    if isinstance(obj, dict):
        raise CapsenseError(f"{task!r} is a group of tasks; name one task")
    return obj


def sample_doc_ids(task: str, n_docs: int, limit: int | None, seed: int, exclude: Sequence[int] = ()) -> list[int]:
    """``limit`` document ids (all with None) in a ``seed``-determined order, skipping ``exclude``."""
    excluded = set(int(i) for i in exclude)
    order = [int(i) for i in np.random.default_rng(seed).permutation(n_docs) if int(i) not in excluded]
    if not order:
        raise CapsenseError(f"task {task!r}: no documents left after excluding {len(excluded)}")
    return order[:limit] if limit else order


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of (context, continuation) split the way lm-eval's HFLM splits them."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    if not context:
        prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        return [prefix], tokenizer.encode(continuation)
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    return whole[: len(ctx)], whole[len(ctx) :]


def rolling_requests(tokenizer, text: str, window: int) -> list[tuple[list[int], list[int]]]:
    """A perplexity document's (context, continuation) pairs as ``HFLM.loglikelihood_rolling`` makes them: every token
    of ``text`` predicted once, the first after one prefix token (:func:`encode_pair` with no context), in disjoint
    windows of at most ``window`` tokens (lm-eval's own ``get_rolling_token_windows``, context 1). A text within one
    window is one request; a longer one is several, each predicting its own tokens with no context but its window's."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    (prefix,), tokens = encode_pair(tokenizer, "", text)
    return [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, prefix, window, 1)]


def gold_index(task_obj, doc) -> int:
    """The position of a multiple-choice document's gold answer among its choices."""
    target = task_obj.doc_to_target(doc)
    if isinstance(target, str):
        return task_obj.doc_to_choice(doc).index(target)
    if isinstance(target, list):
        return int(target[0])
    return int(target)


def check_choice_metric(metric: str, task: str, include_path: Sequence[str | os.PathLike] = (), tokenizer=None) -> None:
    """Refuse a multiple-choice score (:data:`~capsense.scoring.CHOICE_METRICS`) for a task without choices; loads
    the task (with ``tokenizer``: capsense's tasks count tokens), not the model, so a run refuses before its load."""
    from capsense.scoring import CHOICE_METRICS

    if metric in CHOICE_METRICS and (kind := load_task(task, include_path, tokenizer).OUTPUT_TYPE) != "multiple_choice":
        raise CapsenseError(f"metric {metric!r} compares each document's choices, and {task!r} is a {kind} task, "
                            f"without choices: use nll or acc, or a multiple-choice target")


def check_accuracy_metric(tasks: Sequence[str], include_path: Sequence[str | os.PathLike] = (), tokenizer=None) -> None:
    """Refuse ``acc`` for a run with a perplexity task (:data:`ROLLING`) among ``tasks``: its requests are windows of
    running text, whose greedy 'exact match' means nothing (lm-eval reports no accuracy for them); loads the tasks, not
    the model."""
    rolling = [t for t in tasks if load_task(t, include_path, tokenizer).OUTPUT_TYPE == ROLLING]
    if rolling:
        raise CapsenseError(f"metric 'acc' is greedy exact match of a continuation, and {', '.join(map(repr, rolling))} "
                            f"{'is a perplexity task' if len(rolling) == 1 else 'are perplexity tasks'} "
                            f"({ROLLING}: the whole text predicted, no answer to match): use nll (nats/token, what "
                            f"its word and byte perplexities are made of)")


@contextmanager
def quiet_request_building(active: bool = True) -> Iterator[None]:
    """lm-eval draws a bar per task while building requests (no switch to turn it off); hide it under ours."""
    import lm_eval.api.task as task_module

    if not active:
        yield
        return
    original = task_module.tqdm
    task_module.tqdm = partial(original, disable=True)
    try:
        yield
    finally:
        task_module.tqdm = original

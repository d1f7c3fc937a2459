"""Per-capability loss: nats/token of reference completions, prompt masked (of a perplexity task: its whole texts),
on fixed probe sets.

Each capability (:mod:`.capabilities`) is an lm-eval task (capsense's offline ones by short name); its probe set is
the task's first ``n_probes`` documents (fixed, so every measurement of every model state sees
the same documents; calibration takes documents from the other end:
:func:`~capsense.compress.capabilities.document_ids`). The loss is the token-weighted cross-entropy of the reference continuation given the prompt, in nats/token, scored by
:class:`capsense.scoring.probe.ProbeScorer`; a compression's response is ``dL = L(compressed) - L(original)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import nn

from capsense.compress.capabilities import document_ids, parse_capabilities, task_of
from capsense.errors import CapsenseError
from capsense.scoring.probe import KeepsRequestScores, Probe, ProbeScorer
from capsense.scoring.requests import ROLLING_WINDOW


def capability_probe(capability: str, tokenizer, n: int, use: str = "probe", include_path: Sequence[str] = (),
                     window: int = ROLLING_WINDOW) -> Probe:
    """A probe of ``capability`` over the ``n`` documents ``use`` reads (first for probes, last for calibration).

    ``include_path``: folders of task YAMLs (a user's task); ``window``: a perplexity task's texts are cut into
    requests of at most this many tokens, as lm-eval cuts them at the model's length (pass
    :func:`~capsense.scoring.probe.model_max_length` of the model that scores it). A generation task (GSM8K's
    kind) is measured on its reference answers, as a locate run measures it (:meth:`Probe.from_reference_answers`)."""
    from capsense.scoring.requests import load_task

    task = task_of(capability)
    task_obj = load_task(task, include_path, tokenizer)
    # ascending doc ids: lm-eval numbers the selected documents in that order
    return Probe.from_loaded_task(task, task_obj, document_ids(len(task_obj.eval_docs), n, use), tokenizer, window)


def build_probes(tokenizer, capabilities: str | Sequence[str], n_probes: int = 64, include_path: Sequence[str] = (),
                 window: int = ROLLING_WINDOW) -> dict[str, Probe]:
    """The fixed probe set of each capability: the first ``n_probes`` documents of its task
    (``include_path``, ``window``: :func:`capability_probe`'s)."""
    if n_probes < 1:
        raise CapsenseError(f"`probes` must be at least 1, got {n_probes}")
    return {cap: capability_probe(cap, tokenizer, n_probes, "probe", include_path, window)
            for cap in parse_capabilities(capabilities, include_path)}


class _KeepingScorer(KeepsRequestScores, ProbeScorer):
    """A scorer that also keeps per-request log-probabilities (for per-document splits)."""


@dataclass
class CapabilityLoss:
    """One capability's measurement: loss, accuracy and per-document nats and token counts. ``acc`` is None
    for a perplexity task: there is no answer to match (:mod:`capsense.scoring.probe`)."""

    capability: str
    task: str
    nll: float
    acc: float | None
    n_docs: int
    n_tokens: int
    doc_nats: list[float]
    doc_tokens: list[int]

    def to_dict(self, per_doc: bool = False) -> dict[str, Any]:
        d = {
            "capability": self.capability, "task": self.task, "nll": self.nll, "acc": self.acc,
            "n_docs": self.n_docs, "n_tokens": self.n_tokens,
        }
        if per_doc:
            d["doc_nats"] = [round(x, 5) for x in self.doc_nats]
            d["doc_tokens"] = self.doc_tokens
        return d


def paired_difference(a: CapabilityLoss, b: CapabilityLoss) -> tuple[float, float | None]:
    """``b``'s loss minus ``a``'s (nats/token) on the same documents, and its standard error over documents.

    The loss is token-weighted (total nats over total tokens), so the difference is the ratio
    ``D = sum e_i / sum t_i`` of each document's nats difference ``e_i`` to its tokens ``t_i``; its
    standard error is the ratio estimator's, ``sqrt(n / (n - 1) * sum (e_i - D t_i)^2) / sum t_i``
    (with equal token counts: the sample standard deviation of the per-document differences over
    ``sqrt(n)``). None with one document (no spread to estimate). Both must have measured the same documents.
    """
    t = np.asarray(a.doc_tokens, dtype=float)
    if a.task != b.task or list(a.doc_tokens) != list(b.doc_tokens):
        raise CapsenseError(f"paired difference needs the same documents; got {a.task} ({a.n_docs} documents) "
                            f"and {b.task} ({b.n_docs})")
    e = np.asarray(b.doc_nats) - np.asarray(a.doc_nats)
    diff = float(e.sum() / t.sum())
    if len(e) < 2:
        return diff, None
    return diff, float(np.sqrt(len(e) / (len(e) - 1) * ((e - diff * t) ** 2).sum()) / t.sum())


def measure_probe(model: nn.Module, probe: Probe, capability: str | None = None, batch_size: int = 16) -> CapabilityLoss:
    """Score one probe with the model as it is (no knockouts)."""
    scorer = _KeepingScorer(model, probe, batch_size=batch_size)
    res = scorer.score()
    assert scorer.last is not None
    logprob = scorer.last[0][0]
    tokens = np.array([len(t) for t in scorer._targets])
    keep = probe.counted
    doc_nats = np.zeros(probe.n_docs)
    doc_tok = np.zeros(probe.n_docs, dtype=int)
    np.add.at(doc_nats, probe.doc_of[keep], -logprob[keep])
    np.add.at(doc_tok, probe.doc_of[keep], tokens[keep])
    return CapabilityLoss(
        capability=capability or probe.name, task=probe.name, nll=float(res["nll"][0]),
        acc=None if "rolling_window" in probe.meta else float(res["acc"][0]),
        n_docs=probe.n_docs, n_tokens=int(doc_tok.sum()), doc_nats=doc_nats.tolist(), doc_tokens=doc_tok.tolist(),
    )


def measure(model: nn.Module, probes: Mapping[str, Probe], batch_size: int = 16,
            progress: str | None = None) -> dict[str, CapabilityLoss]:
    """Per-capability loss of ``model`` on each probe set; what each set's forwards freed is handed back
    (:func:`~capsense.core.memory.return_freed_memory`). ``progress``: the label of a bar over the sets on stderr
    (None: none), what ``capsense measure`` shows (an 8B model's probes take minutes, which it spent silent)."""
    from tqdm.auto import tqdm

    from capsense.core.memory import return_freed_memory

    out = {}
    with tqdm(probes.items(), desc=progress, unit="capability", disable=progress is None) as bar:
        for cap, p in bar:
            bar.set_postfix_str(f"{cap} ({p.n_docs} documents)")
            out[cap] = measure_probe(model, p, cap, batch_size)
            return_freed_memory()
    return out


def loss_change(after: Mapping[str, CapabilityLoss], before: Mapping[str, CapabilityLoss]) -> dict[str, dict[str, Any]]:
    """Per capability: ``after``'s measurement with ``nll0`` (``before``'s loss), ``dL = nll - nll0`` and ``dL_se``, its
    standard error over documents (:func:`paired_difference`; None with one document, or where the two tokenized the
    documents differently: models of two tokenizers)."""
    out = {}
    for cap, a in after.items():
        b = before[cap]
        d = a.to_dict()
        d["nll0"], d["acc0"] = b.nll, b.acc
        d["dL"] = d["nll"] - d["nll0"]
        d["dL_se"] = paired_difference(b, a)[1] if b.task == a.task and list(b.doc_tokens) == list(a.doc_tokens) else None
        out[cap] = d
    return out


def measure_models(model: str, capabilities: str | Sequence[str], n_probes: int = 64, batch_size: int = 16,
                   dtype: str = "float32", reference: str | None = None, per_doc: bool = False,
                   include_path: Sequence[str] = (), device: str = "cpu",
                   device_map: str | dict[str, Any] | None = None, revision: str | None = None,
                   reference_revision: str | None = None, progress: bool = False) -> dict[str, Any]:
    """``model``'s loss per capability on its fixed probe set, as the JSON document ``capsense
    measure`` writes: ``{"model", "probes", "dtype", "capabilities": {cap: {nll, acc, ...}}, "versions", "host"}``.

    With ``reference`` (another model, loaded after ``model`` is freed), each capability also
    gets ``nll0`` (the reference's loss), ``dL = nll - nll0`` and its standard error ``dL_se`` (:func:`loss_change`),
    and the document names it.
    ``per_doc`` adds per-document nats and token counts; ``include_path``: folders of task YAMLs that
    declare capabilities (a user's tasks). A perplexity task's texts are cut at each model's length. Each model loads
    on ``device``, or spread by ``device_map`` (:func:`~capsense.core.models.load_model`); ``revision`` and
    ``reference_revision``: each model's, of a Hub model (the document names them; None: the default branch).
    ``progress``: a bar per model over its capabilities, on stderr.
    """
    from capsense.core.models import load_model
    from capsense.core.provenance import provenance
    from capsense.scoring.probe import model_max_length

    caps = parse_capabilities(capabilities, include_path)
    m, tok = load_model(model, dtype=dtype, device=device, device_map=device_map, revision=revision)
    measured = measure(m, build_probes(tok, caps, n_probes, include_path, model_max_length(m)), batch_size,
                       f"measure {model}" if progress else None)
    result = {c: v.to_dict(per_doc) for c, v in measured.items()}
    doc: dict[str, Any] = {"model": model, **({"revision": revision} if revision else {}), "probes": n_probes,
                           "dtype": dtype, "capabilities": result,
                           **provenance(next(m.parameters()).device, **({"device_map": device_map} if device_map else {}))}
    if reference:
        del m
        r, rtok = load_model(reference, dtype=dtype, device=device, device_map=device_map, revision=reference_revision)
        ref = measure(r, build_probes(rtok, caps, n_probes, include_path, model_max_length(r)), batch_size,
                      f"measure {reference}" if progress else None)
        doc["reference"] = reference
        if reference_revision:
            doc["reference_revision"] = reference_revision
        for c, change in loss_change(measured, ref).items():
            result[c].update({k: change[k] for k in ("nll0", "acc0", "dL", "dL_se")})
    return doc

"""The selectivity verdict of a validation: is every off-target change within tolerance?

A head set is *selective* for its target when knocking it out leaves every other capability
measured about where it was. Validation rows come in three roles: the ``target``; the
``searched`` controls (scored by the locate run on other documents: the choice could fit
them); and the ``held-out`` controls (tasks the search never scored: the honest test). For
every off-target row the verdict takes the relative *worsening* (+0.1 = 10% worse, whichever
way the metric points) and compares it with the ``tolerance`` and with its noise: the random
K-head sets of the same validation (the band up to their mean + 2 sd, at least their worst: what
knocking out K heads at random costs that row). A row *fails* when it is beyond both: worse than
the tolerance and worse than K random heads make it. The verdict says "selective" only when no
row fails, and names the rows beyond tolerance but within noise, and those within tolerance but
above the random band, so a reader sees every caveat. Why noise counts: the first SmolLM2 run with
the default suite moved numbers-and-dates accuracy from 0.36 to 0.32 on 25 held-out documents,
one document, -11%, exactly what the worst random set did (-11%); a one-document flip is the
resolution of such a control, not collateral damage. So each accuracy row also says how many
documents its change is, net (``documents_net`` of ``documents``: the change times the number of
held-out documents, where both values are whole counts of them), and the verdict line quotes it:
round 18's antonyms set halved held-out translation accuracy, which is 5 of 40 documents, where
the worst random set moved 3.

**Noise is counted in documents too** (round 32). The random band stands for noise, but where K random
heads *damage* a task it stops being noise: on Gemma 3 every random 5-head set cost held-out letter
tasks 68-89% of their accuracy, so sequence's set passed with letters at -65.8% (25 of 40 documents),
although "unrelated capabilities barely move" was plainly false. So an accuracy row whose documents are
known also fails, band or not, when it is beyond the tolerance and its loss is beyond :data:`NOISE_Z`
standard errors of the documents themselves (``z``: two-proportion, unpaired, which overstates the noise
of a paired change on the same documents, so it errs towards passing). A one-document flip stays noise
(dates 0.36 -> 0.32 on 25 documents: z 0.3), and the band is never narrower than one document (round 34):
where every random set left a row exactly where it was (a band of zero width, seen on SmolLM2's 25-document
rows), a one-document loss was beyond the band and, beyond the tolerance too, failed by the resolution alone.
Re-judged with that floor (``recipes/bench/rejudge_validations.py``), none of the 24 recorded validations changes
a row's outcome or a verdict. Re-judged from their ``validation.json``, the validations of
rounds 31-32 change no verdict on SmolLM2 (every row beyond tolerance there is under z 1.1); on Gemma 3,
letters (z 5.8) now fails for the sequence set, whose verdict was already NOT selective for its target.

Which rows count: each task is judged by its task-level metric: its accuracy-like metrics
where the clean model scores at least ``MIN_BASE_SCORE`` on them, else (an accuracy of 0.05
halved is noise; prose's greedy whole-passage match is 0 either way) its nats/token. The
nats/token of a task with a usable accuracy is reported in the table, not judged: measured on
SmolLM2, few-shot QA's nats/token rose 42% under the old induction set while its accuracy fell
19%; confidence in the answer is not the capability.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

DEFAULT_TOLERANCE = 0.10  # off-target relative worsening a selective set may cause on held-out documents
MIN_BASE_SCORE = 0.2
#: An off-target accuracy row beyond tolerance fails, even within the random band, when its loss is at least
#: this many standard errors of its documents (module docstring). 3, not 2: a validation judges 15-20 rows,
#: and at 3 (one-sided 0.13% a row) the chance that any of them crosses it by noise alone is about 2-3%.
NOISE_Z = 3.0
LOWER_IS_BETTER = ("nats_per_token", "perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte")


@dataclass
class OffTarget:
    """One off-target row judged: its worsening, the random sets' worsening, and the two checks."""

    task: str
    metric: str
    role: str  # "searched" or "held-out"
    base: float
    ablated: float
    worsening: float
    random_worst: float | None
    random_band: float | None  # the random sets' worsening: up to max(mean + 2 sd, worst)
    within_tolerance: bool
    within_random: bool | None  # None: no random set to compare with
    documents: int | None = None  # held-out documents the row was measured on (None: not given)
    documents_net: int | None = None  # documents lost (+) or gained (-), net; None unless a whole count
    z: float | None = None  # the loss in standard errors of its documents (:func:`document_z`); None: not counted

    @property
    def beyond_noise(self) -> bool:
        """Its documents say the loss is not noise (at least :data:`NOISE_Z` standard errors)."""
        return self.z is not None and self.z >= NOISE_Z

    @property
    def fails(self) -> bool:
        """Beyond the tolerance and beyond noise (what K random heads cost, or its documents' own noise):
        collateral damage."""
        return not self.within_tolerance and (self.within_random is not True or self.beyond_noise)


def lower_is_better(metric: str, declared: bool | None) -> bool:
    """Whether a smaller value is better (lm-eval's declaration first, else the metric's name)."""
    if declared is not None:
        return not declared
    return metric.split(",")[0] in LOWER_IS_BETTER


def worsening(base: float, value: float, lower_better: bool) -> float | None:
    """Relative worsening of ``value`` against ``base`` (positive = worse); None where base is 0."""
    if not np.isfinite(base) or not np.isfinite(value) or base == 0:
        return None
    rel = (value - base) / abs(base)
    return rel if lower_better else -rel


def net_documents(base: float, value: float, n: int | None, lower_better: bool) -> int | None:
    """Documents lost (+) or gained (-) when an accuracy over ``n`` documents goes from ``base`` to
    ``value``; None for a metric that is not a fraction of whole documents (nats/token, or a value
    that is no multiple of 1/n)."""
    if not n or lower_better or not (np.isfinite(base) and np.isfinite(value)):
        return None
    b, v = base * n, value * n
    if abs(b - round(b)) > 1e-6 or abs(v - round(v)) > 1e-6:
        return None
    return int(round(b) - round(v))


def document_z(base: float, value: float, n: int) -> float:
    """How many standard errors an accuracy fell from ``base`` to ``value`` over ``n`` documents (a rise
    is negative): the unpaired two-proportion z, with the pooled accuracy's binomial noise."""
    p = (base + value) / 2
    se = float(np.sqrt(p * (1 - p) * 2 / n))
    return 0.0 if se == 0 else float((base - value) / se)


def _judged_rows(rows: Sequence[Any], usable: set[str], role, tolerance: float,
                 documents: Mapping[str, int] | None = None) -> list[OffTarget]:
    """Each task's task-level row (its accuracy where ``usable``, else nats/token) judged against the
    tolerance and the random K-head band; ``role(task)`` names it, or None to leave the task out."""
    documents = documents or {}
    out = []
    for r in rows:
        low = _low(r)
        name = role(r.task)
        if name is None or (low and r.task in usable) or (not low and r.task not in usable):
            continue
        w = worsening(r.base, r.ablated, low)
        if w is None:
            continue
        n = documents.get(r.task)
        net = net_documents(r.base, r.ablated, n, low)
        rw = [x for x in (worsening(r.base, v, low) for v in r.random_values) if x is not None]
        worst = max(rw) if rw else None
        band = max(float(np.mean(rw) + 2 * np.std(rw)), worst) if rw else None
        out.append(OffTarget(task=r.task, metric=r.metric, role=name, base=r.base, ablated=r.ablated, worsening=w,
                             random_worst=worst, random_band=band, within_tolerance=w <= tolerance,
                             within_random=(w <= max(0.0, band) or (net is not None and net <= 1)) if rw else None,
                             documents=n, documents_net=net, z=None if net is None else document_z(r.base, r.ablated, n)))
    return out


def target_hit(worsening: float | None, within_random: bool | None, tolerance: float) -> bool:
    """The target clearly hurt: worse by more than ``tolerance`` and not within what K random heads do to it
    (``within_random`` None: no random set to compare with). The one rule, for :func:`judge` and for the
    audits that re-read recorded verdicts."""
    return worsening is not None and worsening > tolerance and within_random is not True


def _low(r: Any) -> bool:
    return lower_is_better(r.metric, getattr(r, "higher_is_better", None))


def judge(rows: Sequence[Any], target: str, searched: Sequence[str], tolerance: float = DEFAULT_TOLERANCE,
          documents: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The verdict over validation rows (:class:`capsense.evaluation.validate.ValidationRow`);
    ``documents``: each task's number of held-out documents, for the net document counts."""
    usable = {r.task for r in rows if not _low(r) and np.isfinite(r.base) and r.base >= MIN_BASE_SCORE}
    judged = _judged_rows(rows, usable, lambda t: None if t == target else ("searched" if t in searched else "held-out"),
                          tolerance, documents)
    # the target, judged the same way: it must be hurt beyond the tolerance and what K random heads do
    # (measured on Gemma 3: a set chosen by nats/token left induction accuracy at 1.00)
    tgt = next(iter(_judged_rows(rows, usable, lambda t: "target" if t == target else None, tolerance, documents)), None)
    failing = [j for j in judged if j.fails]
    caution = [j for j in judged if not j.fails and j.within_random is not None and j.within_tolerance != j.within_random]
    worst = max(judged, key=lambda j: j.worsening, default=None)
    worst_held = max((j for j in judged if j.role == "held-out"), key=lambda j: j.worsening, default=None)
    hit = tgt is not None and target_hit(tgt.worsening, tgt.within_random, tolerance)
    line = verdict_line(judged, failing, caution, worst, tolerance)
    if not hit and judged:
        line = ("NOT selective: the target itself is not clearly hurt ("
                + ("no usable target row" if tgt is None else
                   f"{tgt.task} {tgt.metric} {100 * tgt.worsening:+.1f}% worse, tolerance {100 * tolerance:.0f}%"
                   + ("" if tgt.random_worst is None else f", random-K worst {100 * tgt.random_worst:+.1f}%")
                   + ("" if tgt.documents_net is None else f", net {tgt.documents_net} of {tgt.documents} documents"))
                + "); off-target: " + line)
    return {
        "selective": not failing and bool(judged) and hit,
        "target": asdict(tgt) if tgt else None,
        "tolerance": tolerance,
        "line": line,
        "worst": asdict(worst) if worst else None,
        "worst_held_out": asdict(worst_held) if worst_held else None,
        "rows": [{**asdict(j), "fails": j.fails} for j in judged],  # fails: as judged then (rejudge_validations.py)
    }


def _say(j: OffTarget) -> str:
    rnd = "" if j.random_worst is None else f", random-K worst {100 * j.random_worst:+.1f}%"
    docs = "" if j.documents_net is None else f", net {j.documents_net} of {j.documents} documents, z {j.z:.1f}"
    return f"{j.task} {j.metric} {100 * j.worsening:+.1f}% worse ({j.role}{rnd}{docs})"


def verdict_line(judged, failing, caution, worst, tolerance: float) -> str:
    """One sentence: selective or not, and the worst off-target change with its noise."""
    if not judged:
        return "selectivity not judged: no off-target task with a usable metric was validated"
    if failing:
        return (f"NOT selective: {len(failing)} off-target row(s) beyond the {100 * tolerance:.0f}% tolerance and "
                f"beyond noise (the random-K band, or z >= {NOISE_Z:g} over its documents); worst "
                + _say(max(failing, key=lambda j: j.worsening)))
    line = (f"selective: every off-target change within {100 * tolerance:.0f}% or within what K random heads cost "
            f"({len(judged)} rows); worst " + _say(worst))
    beyond = [j for j in caution if not j.within_tolerance]
    above = [j for j in caution if j.within_tolerance]
    if beyond:
        line += ("; beyond tolerance but within noise (the random-K band, or one document): "
                 + ", ".join(f"{j.task} {j.metric}" for j in beyond))
    if above:
        line += "; within tolerance but above the random-K band: " + ", ".join(f"{j.task} {j.metric}" for j in above)
    return line

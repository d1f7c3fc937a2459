"""Control suites: what a selective run checks besides its target.

A head set can spare the two controls a user names and still wreck a capability nobody
listed: the induction heads chosen against prose and arithmetic on SmolLM2 cut zero-shot
factual completion by 62% on held-out tasks (issue 17). So selective runs check broadly by
default, with two suites of short probe sets built offline in code:

* ``default`` (:data:`SCREEN`): scored on every knockout of the search and used to screen
  candidates (:mod:`capsense.localize.screen`) and to choose the set: factual recall, multi-token
  names, numbers and dates, code lines, dialogue and instructions, plain prose, antonyms, and
  few-shot questions in words (quantities with a worked answer, categories of words and things:
  added in round 16 after a set that spared every other control cut held-out word problems by 54.5%).
* ``held-out`` (:data:`HELD_OUT`): never scored by the search; ``capsense validate`` evaluates the
  chosen set on it, so the verdict rests on controls the choice could not fit: everyday
  knowledge, few-shot QA, list continuation, math word problems, (round 17) words translated
  into French and Spanish, subject-verb agreement and the first letters of words, and (round 48) ordinary
  paragraphs scored whole, a perplexity task (:mod:`capsense.tasks.text`). The default suite
  grew in round 16 with questions in words written after this suite had caught a head (L16H0) the
  search missed, so this suite grew too, with families neither suite had, chosen by coverage, the
  clean model's signal and cost, not by which heads they catch (comparisons of two everyday things
  were dropped: SmolLM2 scored 0.46 and 0.60 of them, chance 0.5). (``capsense_rhyme``, three-shot
  multiple choice, costs about 175 tokens a document: name it with ``--tasks`` when wanted.)

A control spec is a list of task names and suite names; ``-name`` drops a task (or a suite's
tasks) from what came before: ``default,capsense_arithmetic,-capsense_dates``. The target task
(and a suite task built on it, :data:`BUILT_ON`) is never its own control. This module imports
nothing heavy (checks run before torch loads).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from capsense.errors import CapsenseError

SCREEN: tuple[str, ...] = (
    "capsense_facts", "capsense_names", "capsense_dates", "capsense_syntax", "capsense_dialogue",
    "capsense_prose", "capsense_antonyms", "capsense_conversions", "capsense_categories",
)
HELD_OUT: tuple[str, ...] = (
    "capsense_recall", "capsense_qa", "capsense_sequence", "capsense_math_problems",
    "capsense_translation", "capsense_agreement", "capsense_letters", "capsense_text",
)
SUITES: dict[str, tuple[str, ...]] = {"default": SCREEN, "held-out": HELD_OUT}
#: Suite tasks built on another task's capability: a suite leaves them out when that task is the
#: target, as it leaves out the target itself (worked unit conversions and word problems are
#: arithmetic: an arithmetic set that wrecks them is doing its job, not collateral damage).
#: Named outright (``capsense_conversions``), such a task is kept.
BUILT_ON: dict[str, frozenset[str]] = {
    "capsense_conversions": frozenset({"capsense_arithmetic", "capsense_addition", "capsense_math_problems"}),
    "capsense_math_problems": frozenset({"capsense_arithmetic", "capsense_addition", "capsense_conversions"}),
}
NONE = "none"  # ``--controls none``: no controls (not selective)


def split_spec(spec: str | Iterable[str] | None) -> list[str]:
    """``"default,capsense_x"`` or ``["default", "capsense_x"]`` -> items, blanks dropped."""
    if spec is None:
        return []
    items = spec.split(",") if isinstance(spec, str) else [p for s in spec for p in str(s).split(",")]
    return [p.strip() for p in items if p.strip()]


def expand_controls(spec: str | Iterable[str] | None, target: str) -> list[str]:
    """The control tasks a spec stands for, in order; a suite adds its tasks but the target and
    those already listed.

    ``none`` (alone) means no controls. Suite names expand to their tasks; ``-name`` removes a
    task or a suite's tasks added before it.
    """
    items = split_spec(spec)
    if items == [NONE]:
        return []
    if NONE in items:
        raise CapsenseError(f"`controls` {','.join(items)!r}: 'none' stands alone (no controls); "
                               "otherwise give task names and suites (" + ", ".join(SUITES) + ")")
    out: list[str] = []
    for item in items:
        drop = item.startswith("-")
        name = item[1:] if drop else item
        tasks = list(SUITES.get(name, (name,)))
        if drop:
            missing = [t for t in tasks if t not in out and t != target]
            if missing == tasks:
                raise CapsenseError(f"`controls`: {item!r} drops {name!r}, which is not among the controls before it "
                                       f"({', '.join(out) or 'none'})")
            out = [t for t in out if t not in tasks]
        elif name in SUITES:  # a suite never lists the target, a task built on it, or a control twice
            out += [t for t in tasks if _in_suite_run(t, target) and t not in out]
        else:  # a task named outright is kept as given (the config refuses the target or a repeat)
            out.append(name)
    if not out and items:
        raise CapsenseError(f"`controls` {','.join(items)!r} leaves no control task; say 'none' for a run without controls")
    return out


def held_out_controls(target: str, used: Sequence[str]) -> list[str]:
    """The held-out suite's tasks that neither are the target (or built on it) nor were scored by the search."""
    return [t for t in HELD_OUT if _in_suite_run(t, target) and t not in used]


def _in_suite_run(task: str, target: str) -> bool:
    """Whether a suite's ``task`` checks a run whose target is ``target`` (not the target, not built on it)."""
    return task != target and target not in BUILT_ON.get(task, ())


def suite_of(task: str) -> str | None:
    """``"default"`` or ``"held-out"`` for a suite task, else None (a task the user named)."""
    return next((name for name, tasks in SUITES.items() if task in tasks), None)

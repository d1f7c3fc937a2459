"""Conversions: few-shot questions about quantities, answered with a number and its unit
(a control of the default suite).

``Question: How many minutes are in 3 hours?\\nAnswer: 3 x 60 = 180 minutes.``: reading the
quantities out of a question, one multiplication, division or clock step, and the worked answer in
the question-and-answer format of two solved shots. Measured on SmolLM2 (nats/token change of the
reference, 32 documents): answers with the number alone moved by L16H0 +4.6% only (SmolLM2 gets 5%
of them), worked answers +20 to +37%; one shot costs the round-14 induction set +3.4% to +5.8%
(few-shot format copying leans on induction heads), two shots -3.9%, so two. Written for issue 21:
on SmolLM2 the induction set chosen with groups priced at their real cost cut held-out math word
problems by 54.5% and QA by 13.6% while every control of the suite moved at most 5.2%
(recipes/results/RESULTS-locate.md, round 15): nothing the search scored asked a question in words
about numbers. Units, clock times, money and halves/doubles here, not the stories with named people
of ``capsense_math_problems`` (held out), so the held-out suite still checks what the search could
not fit.
Templates and values are written for capsense; documents follow a seeded order.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

# (unit asked for, larger unit, factor)
UNITS = (
    ("minutes", "hours", 60), ("seconds", "minutes", 60), ("hours", "days", 24), ("days", "weeks", 7),
    ("months", "years", 12), ("centimeters", "meters", 100), ("millimeters", "centimeters", 10),
    ("grams", "kilograms", 1000), ("meters", "kilometers", 1000), ("cents", "dollars", 100), ("eggs", "dozen", 12),
)


def _to_small(r: random.Random) -> tuple[str, str]:
    small, big, f = r.choice(UNITS)
    n = r.randint(2, 9)
    return f"How many {small} are in {n} {big}?", f"{n} x {f} = {n * f} {small}."


def _to_big(r: random.Random) -> tuple[str, str]:
    small, big, f = r.choice([u for u in UNITS if u[1] != "dozen"])
    n = r.randint(2, 9)
    return f"How many {big} make {n * f} {small}?", f"{n * f} / {f} = {n} {big}."


def _clock(r: random.Random) -> tuple[str, str]:
    h, k = r.randint(1, 6), r.randint(2, 5)
    return f"It is {h} o'clock. What time will it be in {k} hours?", f"{h} + {k} = {h + k} o'clock."


def _half(r: random.Random) -> tuple[str, str]:
    n = 2 * r.randint(6, 49)
    return f"What is half of {n}?", f"{n} / 2 = {n // 2}."


def _double(r: random.Random) -> tuple[str, str]:
    n = r.randint(6, 49)
    return f"What is twice {n}?", f"2 x {n} = {2 * n}."


def _change(r: random.Random) -> tuple[str, str]:
    price = r.randint(11, 89)
    paid = 100 if price > 45 else 50
    return f"What is the change from {paid} cents for a {price}-cent stamp?", f"{paid} - {price} = {paid - price} cents."


TEMPLATES: tuple[Callable[[random.Random], tuple[str, str]], ...] = (_to_small, _clock, _half, _to_big, _change, _double)


def make_docs(n: int = 120, shots: int = 2, seed: int = 1729) -> list[dict[str, Any]]:
    """``n`` documents cycling through the templates, each after ``shots`` solved questions."""
    rng = random.Random(seed)
    docs: list[dict[str, Any]] = []
    seen: set[str] = set()
    i = 0
    while len(docs) < n:
        template = TEMPLATES[i % len(TEMPLATES)]
        i += 1
        q, a = template(rng)
        if q in seen:
            continue
        seen.add(q)
        parts = []
        while len(parts) < shots:  # shots never repeat the question: answering must not be copying
            sq, sa = TEMPLATES[rng.randrange(len(TEMPLATES))](rng)
            if sq != q:
                parts.append(f"Question: {sq}\nAnswer: {sa}")
        docs.append({"id": len(docs), "template": template.__name__.lstrip("_"),
                     "context": "\n\n".join(parts + [f"Question: {q}\nAnswer:"]), "continuation": f" {a}"})
    return docs

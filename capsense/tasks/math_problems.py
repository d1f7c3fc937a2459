"""Math: one- and two-step arithmetic word problems, written for capsense, deterministic.

Each document has two solved problems, then a question; the reference continuation is the
worked equation and the answer (``" 12 + 7 = 19. The answer is 19."``), so the capability
loss covers setting up the computation and carrying it out.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

NAMES = ("Tom", "Anna", "Ben", "Maria", "Sam", "Lucy", "Omar", "Mia", "Jack", "Nora", "Leo", "Emma")
ITEMS = ("apples", "stickers", "marbles", "cookies", "books", "pencils", "cards", "stamps", "shells", "balloons")


def _add(r: random.Random, n: str, it: str) -> tuple[str, str, int]:
    a, b = r.randint(10, 89), r.randint(10, 89)
    return f"{n} has {a} {it}. {n} buys {b} more. How many {it} does {n} have now?", f"{a} + {b}", a + b


def _sub(r: random.Random, n: str, it: str) -> tuple[str, str, int]:
    a = r.randint(30, 99)
    b = r.randint(10, a - 5)
    return f"{n} had {a} {it} and gave {b} to a friend. How many {it} does {n} have left?", f"{a} - {b}", a - b


def _mul_box(r: random.Random, n: str, it: str) -> tuple[str, str, int]:
    a, b = r.randint(3, 12), r.randint(2, 9)
    return f"A box holds {a} {it}. How many {it} are in {b} boxes?", f"{a} * {b}", a * b


def _div(r: random.Random, n: str, it: str) -> tuple[str, str, int]:
    b, q = r.randint(2, 9), r.randint(2, 12)
    return (
        f"{n} shares {b * q} {it} equally among {b} friends. How many {it} does each friend get?",
        f"{b * q} / {b}", q,
    )


def _sales(r: random.Random, n: str, it: str) -> tuple[str, str, int]:
    a, b = r.randint(10, 60), r.randint(10, 60)
    return f"A shop sold {a} {it} in the morning and {b} in the afternoon. How many {it} did it sell in total?", f"{a} + {b}", a + b


def _bus(r: random.Random, n: str, it: str) -> tuple[str, str, int]:
    a = r.randint(20, 60)
    b = r.randint(3, a - 5)
    return f"A bus has {a} passengers. At the next stop {b} people get off. How many passengers are on the bus now?", f"{a} - {b}", a - b


def _pages(r: random.Random, n: str, it: str) -> tuple[str, str, int]:
    a, b = r.randint(5, 20), r.randint(2, 9)
    return f"{n} reads {a} pages a day. How many pages does {n} read in {b} days?", f"{a} * {b}", a * b


def _rows(r: random.Random, n: str, it: str) -> tuple[str, str, int]:
    a, b = r.randint(3, 12), r.randint(4, 12)
    return f"A hall has {a} rows of chairs with {b} chairs in each row. How many chairs are there?", f"{a} * {b}", a * b


def _age(r: random.Random, n: str, it: str) -> tuple[str, str, int]:
    a, b = r.randint(5, 40), r.randint(2, 15)
    return f"{n} is {a} years old. {n}'s sister is {b} years older. How old is the sister?", f"{a} + {b}", a + b


def _rope(r: random.Random, n: str, it: str) -> tuple[str, str, int]:
    a = r.randint(20, 90)
    b = r.randint(5, a - 5)
    return f"A rope is {a} meters long. {n} cuts off {b} meters. How long is the rope now?", f"{a} - {b}", a - b


def _save(r: random.Random, n: str, it: str) -> tuple[str, str, int]:
    a, b = r.randint(3, 15), r.randint(2, 9)
    return f"{n} saves {a} dollars each week. How many dollars has {n} saved after {b} weeks?", f"{a} * {b}", a * b


def _two_step(r: random.Random, n: str, it: str) -> tuple[str, str, int]:
    a, b = r.randint(2, 6), r.randint(3, 10)
    c = r.randint(1, a * b - 1)
    return (
        f"{n} buys {a} packs of {b} {it} and then loses {c}. How many {it} does {n} have now?",
        f"{a} * {b} - {c}", a * b - c,
    )


TEMPLATES: tuple[Callable[[random.Random, str, str], tuple[str, str, int]], ...] = (
    _add, _sub, _mul_box, _div, _sales, _bus, _pages, _rows, _age, _rope, _save, _two_step,
)


def _solved(question: str, expr: str, answer: int) -> tuple[str, str]:
    return f"Question: {question}\nAnswer:", f" {expr} = {answer}. The answer is {answer}."


def make_docs(n: int = 480, shots: int = 2, seed: int = 2718) -> list[dict[str, Any]]:
    """``n`` documents cycling through the templates, each after ``shots`` solved problems."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        parts = []
        for _ in range(shots):
            t = TEMPLATES[rng.randrange(len(TEMPLATES))]
            q, a = _solved(*t(rng, rng.choice(NAMES), rng.choice(ITEMS)))
            parts.append(q + a)
        template = TEMPLATES[i % len(TEMPLATES)]
        question, expr, answer = template(rng, rng.choice(NAMES), rng.choice(ITEMS))
        q, a = _solved(question, expr, answer)
        docs.append({
            "id": i, "template": template.__name__.lstrip("_"), "context": "\n\n".join(parts + [q]),
            "continuation": a, "answer": answer,
        })
    return docs

"""Sequences: the next item of a well-known sequence (weekdays, months, numbers, letters).

``Monday, Tuesday, Wednesday,`` continues with `` Thursday``: the model must recognise the
sequence and step it forward, which small models do well (not by copying: the answer is not
in the context). Sequences wrap around (``Saturday, Sunday,`` -> `` Monday``).
"""

from __future__ import annotations

import random
import string
from typing import Any

WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December")
NUMBER_WORDS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                "eleven", "twelve")
LETTERS = tuple(string.ascii_uppercase)
NUMBERS = tuple(str(i) for i in range(1, 100))
FAMILIES = {"weekdays": WEEKDAYS, "months": MONTHS, "number_words": NUMBER_WORDS, "letters": LETTERS, "numbers": NUMBERS}
WRAPS = {"weekdays", "months"}


def make_docs(n: int = 500, seed: int = 2468) -> list[dict[str, Any]]:
    """``n`` documents cycling through the families: 3 to 6 consecutive items, then the next."""
    rng = random.Random(seed)
    names = list(FAMILIES)
    docs = []
    for i in range(n):
        family = names[i % len(names)]
        items = FAMILIES[family]
        length = rng.randint(3, 6)
        last = len(items) - 1 if family in WRAPS else len(items) - length - 1
        start = rng.randint(0, last)
        seq = [items[(start + j) % len(items)] for j in range(length + 1)]
        docs.append({"id": i, "family": family, "context": ", ".join(seq[:-1]) + ",", "continuation": " " + seq[-1]})
    return docs

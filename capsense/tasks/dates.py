"""Numbers and dates: calendar steps, counts, famous years and unit facts (default suite).

``The day after Monday is`` continues with `` Tuesday``; ``World War II ended in`` with
`` 1945``; ``There are sixty minutes in an`` with `` hour``. Numbers stated in words and in
digits, in plain sentences (no list to continue, unlike ``capsense_sequence``). Written for
capsense.
"""

from __future__ import annotations

from typing import Any

from capsense.tasks.common import docs_from_pairs

DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
YEARS = (
    ("World War II ended in", "1945"),
    ("World War I began in", "1914"),
    ("Christopher Columbus reached the Americas in", "1492"),
    ("The United States declared independence in", "1776"),
    ("The Berlin Wall fell in", "1989"),
    ("Neil Armstrong walked on the Moon in", "1969"),
    ("The Titanic sank in", "1912"),
    ("The French Revolution began in", "1789"),
)
COUNTS = (
    ("There are sixty minutes in an", "hour"),
    ("There are seven days in a", "week"),
    ("There are twelve months in a", "year"),
    ("There are twenty-four hours in a", "day"),
    ("A year usually has 365", "days"),
    ("A leap year has", "366 days"),
    ("A dozen eggs is", "twelve eggs"),
    ("Christmas Day is on December", "25"),
    ("New Year's Day is on January", "1"),
    ("A century is one hundred", "years"),
    ("Water boils at 100 degrees", "Celsius"),
    ("A triangle has three", "sides"),
    ("A square has four equal", "sides"),
    ("Half of one hundred is", "fifty"),
)


def make_docs() -> list[dict[str, Any]]:
    """Weekday and month steps (after/before), famous years and counts, interleaved (about 60 documents)."""
    steps = []
    for i, d in enumerate(DAYS):
        steps.append((f"The day after {d} is", DAYS[(i + 1) % 7]))
    for i, m in enumerate(MONTHS):
        steps.append((f"The month before {m} is", MONTHS[i - 1]) if i % 2 else (f"The month after {m} is", MONTHS[(i + 1) % 12]))
    groups = [steps, list(YEARS), list(COUNTS)]
    pairs = [g[i] for i in range(max(map(len, groups))) for g in groups if i < len(g)]
    return docs_from_pairs(pairs)

"""Code lines: short Python completions (default suite).

``import numpy as`` continues with `` np``; ``for i in range(10):\n    print(`` with ``i)``.
Idioms of everyday Python, a line or two each, so the code control costs a few tokens per
document (HumanEval's ``capsense_code`` scores whole function bodies: hundreds of tokens).
Written for capsense.
"""

from __future__ import annotations

from typing import Any

from capsense.tasks.common import docs_from_pairs

PAIRS = (
    ("import numpy as", " np"),
    ("import pandas as", " pd"),
    ("import matplotlib.pyplot as", " plt"),
    ("from collections import", " defaultdict"),
    ("for i in range(10):\n    print(", "i)"),
    ("def add(a, b):\n    return a", " + b"),
    ("def square(x):\n    return x *", " x"),
    ("if __name__ == \"__main__\":\n", "    main()"),
    ("with open(\"data.txt\") as f:\n    text = f.", "read()"),
    ("numbers = [1, 2, 3]\ntotal = sum(", "numbers)"),
    ("class Dog:\n    def __init__(self, name):\n        self.name =", " name"),
    ("try:\n    x = int(s)\nexcept", " ValueError:"),
    ("words = text.split()\ncount = len(", "words)"),
    ("def is_even(n):\n    return n % 2 ==", " 0"),
    ("items = []\nitems.append(", "item)"),
    ("print(\"Hello,", " World!\")"),
    ("for key, value in d.", "items():"),
    ("x = [i * i for i in", " range(10)]"),
    ("while True:\n    line = input()\n    if not line:\n", "        break"),
    ("def factorial(n):\n    if n == 0:\n        return", " 1"),
    ("import os\npath = os.path.", "join("),
    ("name = input(\"What is your name? \")\nprint(\"Hello, \" +", " name)"),
    ("def greet(name):\n    return f\"Hello, {", "name}\""),
    ("import json\ndata = json.", "load(f)"),
    ("result = sorted(values, reverse=", "True)"),
    ("if x > 0:\n    sign = 1\nelse:\n    sign =", " -1"),
    ("def main():\n    pass\n\n\nif __name__ == \"__main__\":\n    main", "()"),
    ("for i, item in enumerate(", "items):"),
    ("assert add(2, 3) ==", " 5"),
    ("return None if x is None else", " x"),
    ("import sys\nargs = sys.", "argv"),
    ("lines = [line.strip() for line in", " f]"),
)


def make_docs() -> list[dict[str, Any]]:
    """One document per (code, completion) pair, in the listed order."""
    return docs_from_pairs(PAIRS, sep="")

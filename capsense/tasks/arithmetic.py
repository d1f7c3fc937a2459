"""Arithmetic: few-shot two-digit addition and subtraction, two-by-one-digit multiplication.

Prompts use spaces around operators and ``=`` (``23 + 45 = 68``): small Llama-family
tokenizers split digits, and SmolLM2 does far better with the spaced form.
"""

from __future__ import annotations

import random
from typing import Any

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _problem(rng: random.Random, op: str) -> tuple[str, int]:
    if op == "*":
        a, b = rng.randint(10, 99), rng.randint(2, 9)
    else:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if op == "-" and b > a:
            a, b = b, a
    return f"{a} {op} {b} =", OPS[op](a, b)


def make_docs(n: int = 600, shots: int = 3, seed: int = 4321, ops: str = "+-*") -> list[dict[str, Any]]:
    """``n`` documents cycling through ``ops``, each with ``shots`` solved examples first."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        op = ops[i % len(ops)]
        lines = []
        for _ in range(shots):
            q, a = _problem(rng, op)
            lines.append(f"{q} {a}")
        q, a = _problem(rng, op)
        context = "\n".join(lines) + "\n" + q
        docs.append({"id": i, "op": op, "context": context, "continuation": f" {a}", "answer": a})
    return docs


def make_addition_docs(n: int = 500, shots: int = 3, seed: int = 8765) -> list[dict[str, Any]]:
    """Two-digit addition only: the arithmetic sub-skill SmolLM2-135M does best."""
    return make_docs(n=n, shots=shots, seed=seed, ops="+")

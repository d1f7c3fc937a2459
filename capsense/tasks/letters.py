"""Letters: the first letter of a word, asked after one solved question (held-out suite).

``Question: What is the first letter of "garden"?\\nAnswer:`` continues with `` g``: what a word
is made of, which a model must know from inside its tokens (each word here is one token or two).
Written for round 17, when the held-out suite grew with families neither suite had. Measured on
SmolLM2-135M (float32, all 46 documents): zero shots 0.000 (the answer's form is not pinned), one
shot 0.783 at 32.6 tokens a document; spelling the whole word (``g-a-r-d-e-n``, one shot) 0.022,
so the first letter is kept. Words are written for capsense; the order and the shot are seeded.
"""

from __future__ import annotations

import random
from typing import Any

WORDS = (
    "cat", "dog", "house", "water", "apple", "green", "table", "river", "music", "bread", "chair", "light",
    "money", "paper", "stone", "happy", "night", "plant", "horse", "smile", "cloud", "train", "sugar", "pencil",
    "garden", "window", "yellow", "summer", "orange", "doctor", "friend", "silver", "basket", "rabbit", "winter",
    "button", "candle", "dinner", "forest", "island", "ladder", "monkey", "pocket", "spider", "tunnel", "wallet",
)


def _question(word: str) -> str:
    return f'Question: What is the first letter of "{word}"?\nAnswer:'


def make_docs(shots: int = 1, seed: int = 1901) -> list[dict[str, Any]]:
    """One document per word, in a seeded order, each after ``shots`` other solved words."""
    rng = random.Random(seed)
    docs = []
    for k in rng.sample(range(len(WORDS)), len(WORDS)):
        others = rng.sample([j for j in range(len(WORDS)) if j != k], shots)
        lines = [f"{_question(WORDS[j])} {WORDS[j][0]}" for j in others]
        docs.append({"id": len(docs), "context": "\n\n".join(lines + [_question(WORDS[k])]),
                     "continuation": f" {WORDS[k][0]}"})
    return docs

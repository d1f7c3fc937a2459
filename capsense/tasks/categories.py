"""Categories: few-shot questions about words and things, answered in a word or two (a control of
the default suite).

``Question: What kind of animal is a salmon?\\nAnswer: a fish``: what a thing is, irregular
plurals and past tenses, colours and materials of everyday things, asked in the
question-and-answer format of one solved shot (three shots cost twice the tokens, 961 against 461
per 16 documents on SmolLM2, for the same sensitivity: L16H0 +18.5% against +17.0% nats/token). Written for issue 21 beside
``capsense_conversions``: the default suite asked for facts only zero-shot (``capsense_facts``),
and an induction set that spared every searched control cut held-out few-shot QA by 13.6% on
SmolLM2 (round 15). The knowledge here is lexical and everyday, not the capitals, authors and
science of ``capsense_qa`` (held out), so the held-out suite still checks what the search could
not fit. Items are written for capsense; documents interleave the families in a seeded order.
"""

from __future__ import annotations

import random
from typing import Any

KINDS = (
    ("a salmon", "a fish"), ("a sparrow", "a bird"), ("a cobra", "a snake"), ("a beetle", "an insect"),
    ("a dolphin", "a mammal"), ("a frog", "an amphibian"), ("a shark", "a fish"), ("an eagle", "a bird"),
    ("an ant", "an insect"), ("a whale", "a mammal"), ("a crocodile", "a reptile"), ("an owl", "a bird"),
)
THINGS = (
    ("a carrot", "a vegetable"), ("a banana", "a fruit"), ("a hammer", "a tool"), ("a violin", "an instrument"),
    ("a rose", "a flower"), ("an oak", "a tree"), ("a spoon", "a piece of cutlery"), ("a trumpet", "an instrument"),
    ("a potato", "a vegetable"), ("a cherry", "a fruit"), ("a saw", "a tool"), ("a tulip", "a flower"),
)
PLURALS = (
    ("mouse", "mice"), ("child", "children"), ("foot", "feet"), ("tooth", "teeth"), ("goose", "geese"),
    ("man", "men"), ("woman", "women"), ("person", "people"), ("leaf", "leaves"), ("knife", "knives"),
    ("sheep", "sheep"), ("ox", "oxen"),
)
PAST = (
    ("go", "went"), ("eat", "ate"), ("see", "saw"), ("write", "wrote"), ("run", "ran"), ("swim", "swam"),
    ("drink", "drank"), ("take", "took"), ("buy", "bought"), ("think", "thought"), ("bring", "brought"), ("fly", "flew"),
)
COLOURS = (
    ("a ripe banana", "yellow"), ("grass", "green"), ("snow", "white"), ("coal", "black"), ("a ripe tomato", "red"),
    ("a clear sky", "blue"), ("a carrot", "orange"), ("milk", "white"), ("an old penny", "brown"),
)
MATERIALS = (
    ("a window pane", "glass"), ("a candle", "wax"), ("a brick", "clay"), ("a paper bag", "paper"),
    ("a wooden chair", "wood"), ("a tyre", "rubber"), ("an ice cube", "water"), ("a wool scarf", "wool"),
)


def _families() -> list[list[tuple[str, str]]]:
    return [
        [(f"What kind of animal is {x}?", a) for x, a in KINDS],
        [(f"What is {x}?", a) for x, a in THINGS],
        [(f"What is the plural of {x}?", a) for x, a in PLURALS],
        [(f"What is the past tense of {x}?", a) for x, a in PAST],
        [(f"What colour is {x}?", a) for x, a in COLOURS],
        [(f"What is {x} made of?", a) for x, a in MATERIALS],
    ]


def make_docs(shots: int = 1, seed: int = 1414) -> list[dict[str, Any]]:
    """One document per item, the families interleaved, each after ``shots`` solved questions of
    other items (from any family)."""
    families = _families()
    items = [f[i] for i in range(max(map(len, families))) for f in families if i < len(f)]
    rng = random.Random(seed)
    docs = []
    for k, (q, a) in enumerate(items):
        others = rng.sample([j for j in range(len(items)) if j != k], shots)
        lines = [f"Question: {items[j][0]}\nAnswer: {items[j][1]}" for j in others]
        docs.append({"id": k, "context": "\n\n".join(lines + [f"Question: {q}\nAnswer:"]), "continuation": f" {a}"})
    return docs

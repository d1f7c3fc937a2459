"""Translation: common English words into French and Spanish (held-out suite).

``English: water\\nFrench:`` continues with `` eau``. Everyday nouns, colours, adjectives and
numbers whose translation is one word and not in doubt (``car`` is left out: coche or carro in
Spanish). Written for round 17: the default suite grew in round 16 with few-shot questions after the
held-out suite had caught a head that wrecked word problems and QA, so for questions in words the
held-out verdict had become weaker evidence. No task the search scores asks for a word in another
language as a family (``capsense_dialogue`` has two translation turns among 30 replies), so this
one checks what the search could not fit. Two solved words of the same language come first: on
SmolLM2-135M (float32, all 60 documents) zero shots got 0.050 (3.34 nats/token; the answer's form is
not pinned), two shots 0.217 (2.39 nats/token) at 27.9 tokens a document. Items are written for
capsense; documents alternate the two languages in a seeded order.
"""

from __future__ import annotations

import random
from typing import Any

FRENCH = (
    ("dog", "chien"), ("cat", "chat"), ("house", "maison"), ("water", "eau"), ("bread", "pain"),
    ("book", "livre"), ("tree", "arbre"), ("sun", "soleil"), ("moon", "lune"), ("red", "rouge"),
    ("green", "vert"), ("black", "noir"), ("white", "blanc"), ("small", "petit"), ("apple", "pomme"),
    ("milk", "lait"), ("bird", "oiseau"), ("horse", "cheval"), ("school", "école"), ("door", "porte"),
    ("sea", "mer"), ("city", "ville"), ("night", "nuit"), ("hand", "main"), ("cheese", "fromage"),
    ("flower", "fleur"), ("king", "roi"), ("mother", "mère"), ("father", "père"), ("three", "trois"),
)
SPANISH = (
    ("dog", "perro"), ("cat", "gato"), ("house", "casa"), ("water", "agua"), ("bread", "pan"),
    ("book", "libro"), ("tree", "árbol"), ("sun", "sol"), ("moon", "luna"), ("red", "rojo"),
    ("green", "verde"), ("black", "negro"), ("white", "blanco"), ("small", "pequeño"), ("apple", "manzana"),
    ("milk", "leche"), ("bird", "pájaro"), ("horse", "caballo"), ("school", "escuela"), ("door", "puerta"),
    ("sea", "mar"), ("city", "ciudad"), ("night", "noche"), ("hand", "mano"), ("cheese", "queso"),
    ("flower", "flor"), ("king", "rey"), ("mother", "madre"), ("father", "padre"), ("three", "tres"),
)
LANGUAGES = {"French": FRENCH, "Spanish": SPANISH}


def make_docs(shots: int = 2, seed: int = 1789) -> list[dict[str, Any]]:
    """One document per (language, word), the languages alternating, the words in a seeded order;
    each after ``shots`` other solved words of the same language."""
    rng = random.Random(seed)
    orders = {lang: rng.sample(range(len(pairs)), len(pairs)) for lang, pairs in LANGUAGES.items()}
    docs = []
    for i in range(len(FRENCH)):
        for lang, pairs in LANGUAGES.items():
            k = orders[lang][i]
            others = rng.sample([j for j in range(len(pairs)) if j != k], shots)
            lines = [f"English: {pairs[j][0]}\n{lang}: {pairs[j][1]}" for j in others]
            docs.append({"id": len(docs), "language": lang,
                         "context": "\n\n".join(lines + [f"English: {pairs[k][0]}\n{lang}:"]),
                         "continuation": f" {pairs[k][1]}"})
    return docs

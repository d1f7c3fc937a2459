"""Agreement: the verb that agrees with its subject across a phrase about something else (held-out suite).

``The keys near the box`` with the choices `` is`` / `` are`` (`` are`` is right; chance 0.5):
English grammar, the subject's number carried past an attractor noun of the other number (Linzen
et al. 2016's test of syntax in language models). Written for round 17, when the held-out suite
grew with families neither suite had (the search scores Python syntax and prose, no agreement).
SmolLM2-135M gets 0.979 of all 48 documents zero-shot (float32), at 12.2 tokens a document over
both choices. Nouns, prepositions and verbs are written for capsense; the subject's number, the
attractor and the preposition are seeded.
"""

from __future__ import annotations

import random
from typing import Any

NOUNS = (
    ("key", "keys"), ("dog", "dogs"), ("teacher", "teachers"), ("car", "cars"), ("book", "books"),
    ("girl", "girls"), ("box", "boxes"), ("child", "children"), ("painting", "paintings"),
    ("bridge", "bridges"), ("player", "players"), ("window", "windows"), ("letter", "letters"),
    ("farmer", "farmers"), ("cup", "cups"), ("road", "roads"),
)
PREPS = ("near", "behind", "next to", "under", "beside", "of")
VERBS = (("is", "are"), ("was", "were"), ("has", "have"))


def make_docs(n: int = 48, seed: int = 1957) -> list[dict[str, Any]]:
    """``n`` documents, the subjects and verbs in turn; the attractor always of the other number."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        subject, verb = NOUNS[i % len(NOUNS)], VERBS[i % len(VERBS)]
        plural = rng.random() < 0.5
        attractor = rng.choice([x for x in NOUNS if x != subject])
        prep = rng.choice(PREPS)
        docs.append({"id": i, "context": f"The {subject[plural]} {prep} the {attractor[not plural]}",
                     "choices": list(verb), "gold": int(plural)})
    return docs

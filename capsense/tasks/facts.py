"""Factual recall: zero-shot completions of well-known facts (a control of the default suite).

``The capital of France is`` continues with `` Paris``: no examples, no question format, only
the fact stored in the weights. Few-shot QA (``capsense_qa``) did not see the damage that two
induction-candidate heads did to such completions on SmolLM2 (one of them alone: qa +4%,
zero-shot factual completion -46%), so the suite asks for facts the plain way.
Entities, templates and answers are written for capsense; documents follow a fixed order.
"""

from __future__ import annotations

from typing import Any

from capsense.tasks.common import docs_from_pairs

CAPITALS = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
    ("Russia", "Moscow"), ("Egypt", "Cairo"), ("England", "London"), ("Greece", "Athens"), ("Portugal", "Lisbon"),
    ("Austria", "Vienna"), ("Ireland", "Dublin"), ("Poland", "Warsaw"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
    ("China", "Beijing"), ("Thailand", "Bangkok"), ("Kenya", "Nairobi"), ("Hungary", "Budapest"), ("Peru", "Lima"),
)
LANGUAGES = (
    ("France", "French"), ("Germany", "German"), ("Italy", "Italian"), ("Spain", "Spanish"), ("Japan", "Japanese"),
    ("Russia", "Russian"), ("Brazil", "Portuguese"), ("China", "Chinese"), ("Greece", "Greek"), ("Mexico", "Spanish"),
)
LANDMARKS = (
    ("The Eiffel Tower", "Paris"), ("The Colosseum", "Rome"), ("Big Ben", "London"), ("The Kremlin", "Moscow"),
    ("The Statue of Liberty", "New York"), ("The Brandenburg Gate", "Berlin"), ("The Acropolis", "Athens"),
    ("The Forbidden City", "Beijing"), ("The Sydney Opera House", "Sydney"), ("The Golden Gate Bridge", "San Francisco"),
)
PLAIN = (
    ("The largest ocean on Earth is the", "Pacific"),
    ("The longest river in Africa is the", "Nile"),
    ("The highest mountain in the world is Mount", "Everest"),
    ("The largest desert in Africa is the", "Sahara"),
    ("The planet closest to the Sun is", "Mercury"),
    ("The Red Planet is another name for", "Mars"),
    ("The chemical symbol for water is", "H2O"),
    ("The currency of Japan is the", "yen"),
    ("The currency of the United States is the", "dollar"),
    ("The pyramids of Giza are in", "Egypt"),
    ("Kangaroos are native to", "Australia"),
    ("The Amazon rainforest is mostly in", "Brazil"),
    ("Penguins live mostly in the Southern", "Hemisphere"),
    ("The Great Wall is in", "China"),
    ("Mount Fuji is the highest mountain in", "Japan"),
)


def make_docs() -> list[dict[str, Any]]:
    """Capitals, languages, landmarks' cities and plain facts, interleaved (about 55 documents)."""
    groups = [
        [(f"The capital of {c} is", a) for c, a in CAPITALS],
        [(f"The official language of {c} is", a) for c, a in LANGUAGES],
        [(f"{m} is in the city of", a) for m, a in LANDMARKS],
        list(PLAIN),
    ]
    pairs = [g[i] for i in range(max(map(len, groups))) for g in groups if i < len(g)]
    return docs_from_pairs(pairs)

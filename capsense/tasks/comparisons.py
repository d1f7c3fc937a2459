"""Comparisons: which of two everyday things is heavier, faster, hotter... (held-out suite).

``Question: Which is heavier, a brick or a feather?\\nAnswer:`` with the two things as the choices
(`` a brick`` is right; chance 0.5): knowledge of everyday things put to a comparison in words.
Written for round 17: the default suite grew in round 16 with few-shot questions after the
held-out suite had caught a head that wrecked word problems and QA, so for questions in words the
held-out verdict had become weaker evidence. No task the search scores compares two things (one
turn of ``capsense_dialogue`` does), so this family checks what the search could not fit. Scored as
two choices, not as a copied answer: both things are in the question, and a continuation's loss
alone would reward copying either. Items are written for capsense; which thing the question names
first is seeded.
"""

from __future__ import annotations

import random
from typing import Any

#: (comparative, the thing that has more of it, the thing that has less)
ITEMS = (
    ("heavier", "a brick", "a feather"), ("heavier", "a truck", "a bicycle"), ("heavier", "a piano", "a pencil"),
    ("heavier", "a horse", "a rabbit"), ("heavier", "a bowling ball", "a tennis ball"), ("heavier", "an anchor", "a leaf"),
    ("faster", "a cheetah", "a turtle"), ("faster", "a plane", "a bicycle"), ("faster", "a rabbit", "a snail"),
    ("faster", "a train", "a horse cart"), ("faster", "a racing car", "a tractor"), ("faster", "a horse", "a tortoise"),
    ("hotter", "fire", "ice"), ("hotter", "an oven", "a fridge"), ("hotter", "the Sun", "the Moon"),
    ("hotter", "boiling water", "snow"), ("hotter", "a desert at noon", "a glacier"), ("hotter", "summer", "winter"),
    ("taller", "a giraffe", "a dog"), ("taller", "a tree", "a flower"), ("taller", "a skyscraper", "a cottage"),
    ("taller", "an adult", "a baby"), ("taller", "a mountain", "a hill"), ("taller", "a lighthouse", "a fence"),
    ("longer", "a year", "a week"), ("longer", "an hour", "a minute"), ("longer", "a mile", "an inch"),
    ("longer", "a train", "a car"), ("longer", "a river", "a puddle"), ("longer", "a novel", "a postcard"),
    ("softer", "a pillow", "a rock"), ("softer", "cotton", "stone"), ("softer", "a kitten's fur", "a brick wall"),
    ("louder", "thunder", "a whisper"), ("louder", "a drum", "a feather falling"), ("louder", "a jet engine", "a ticking clock"),
    ("sweeter", "honey", "a lemon"), ("sweeter", "sugar", "salt"), ("sweeter", "a cake", "a pickle"),
    ("sharper", "a knife", "a spoon"), ("sharper", "a needle", "a ball"), ("sharper", "an axe", "a pillow"),
    ("colder", "ice", "soup"), ("colder", "a glacier", "a beach"), ("colder", "a snowball", "a cup of tea"),
    ("brighter", "the Sun", "a candle"), ("brighter", "a lamp", "a shadow"), ("brighter", "noon", "midnight"),
)


def make_docs(shots: int = 0, seed: int = 1066) -> list[dict[str, Any]]:
    """One document per item, the items in a seeded order, the right thing named first in about
    half of the questions; each after ``shots`` other solved questions."""
    rng = random.Random(seed)
    order = rng.sample(range(len(ITEMS)), len(ITEMS))
    first = [rng.random() < 0.5 for _ in ITEMS]

    def question(k: int) -> tuple[str, list[str]]:
        word, more, less = ITEMS[k]
        pair = [more, less] if first[k] else [less, more]
        return f"Question: Which is {word}, {pair[0]} or {pair[1]}?\nAnswer:", pair

    docs = []
    for k in order:
        others = rng.sample([j for j in range(len(ITEMS)) if j != k], shots)
        context, choices = question(k)
        lines = [f"{question(j)[0]} {ITEMS[j][1]}" for j in others]
        docs.append({"id": len(docs), "context": "\n\n".join(lines + [context]), "choices": choices,
                     "gold": choices.index(ITEMS[k][1])})
    return docs

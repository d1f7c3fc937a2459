"""Multi-token names: people, works and places completed from a description (default suite).

``The theory of relativity was developed by Albert`` continues with `` Einstein``; some
answers are whole names (`` George Washington``), so the model must produce several tokens
of an entity, not only recognise it. Written for capsense.
"""

from __future__ import annotations

from typing import Any

from capsense.tasks.common import docs_from_pairs

PAIRS = (
    ("The theory of relativity was developed by Albert", "Einstein"),
    ("The play Romeo and Juliet was written by William", "Shakespeare"),
    ("The first President of the United States was", "George Washington"),
    ("The first person to walk on the Moon was", "Neil Armstrong"),
    ("The Mona Lisa was painted by Leonardo", "da Vinci"),
    ("The theory of evolution was proposed by Charles", "Darwin"),
    ("The laws of motion were formulated by Isaac", "Newton"),
    ("The telephone was invented by Alexander Graham", "Bell"),
    ("Penicillin was discovered by Alexander", "Fleming"),
    ("The novel Pride and Prejudice was written by Jane", "Austen"),
    ("The novel War and Peace was written by Leo", "Tolstoy"),
    ("The Starry Night was painted by Vincent van", "Gogh"),
    ("The composer of the Moonlight Sonata was Ludwig van", "Beethoven"),
    ("The physicist who studied radioactivity with her husband Pierre was Marie", "Curie"),
    ("The founder of Microsoft is Bill", "Gates"),
    ("The civil rights leader who gave the I Have a Dream speech was Martin Luther", "King"),
    ("The leader of India's independence movement was Mahatma", "Gandhi"),
    ("The sixteenth President of the United States was Abraham", "Lincoln"),
    ("The explorer who sailed to America in 1492 was Christopher", "Columbus"),
    ("The author of Adventures of Huckleberry Finn was Mark", "Twain"),
    ("The novel 1984 was written by George", "Orwell"),
    ("The Harry Potter books were written by J.K.", "Rowling"),
    ("The largest city in the United States is New", "York"),
    ("The capital of the United States is Washington,", "D.C."),
    ("The Beatles were a band from Liverpool whose members included John", "Lennon"),
    ("The detective who lives at 221B Baker Street is Sherlock", "Holmes"),
    ("The wizard who mentors Frodo in The Lord of the Rings is", "Gandalf"),
    ("The French emperor defeated at Waterloo was Napoleon", "Bonaparte"),
    ("The scientist who developed the polio vaccine was Jonas", "Salk"),
    ("The queen who ruled the United Kingdom for seventy years was Queen", "Elizabeth II"),
    ("The city known as the Big Apple is New York", "City"),
    ("The mouse created by Walt Disney is Mickey", "Mouse"),
    ("The author of The Adventures of Tom Sawyer was Mark", "Twain"),
    ("The painter of the ceiling of the Sistine Chapel was", "Michelangelo"),
    ("The inventor of the light bulb is often said to be Thomas", "Edison"),
    ("The first woman to win a Nobel Prize was Marie", "Curie"),
    ("The ancient Greek philosopher who taught Plato was", "Socrates"),
    ("The boy who never grows up in the story by J. M. Barrie is Peter", "Pan"),
    ("The girl who falls down a rabbit hole in the story by Lewis Carroll is", "Alice"),
    ("The scientist famous for E = mc2 is Albert", "Einstein"),
)


def make_docs() -> list[dict[str, Any]]:
    """One document per (description, name) pair, in the listed order."""
    return docs_from_pairs(PAIRS)

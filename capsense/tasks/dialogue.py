"""Dialogue and instructions: the reply of an assistant or a person in a short exchange (default suite).

``User: Thank you so much for your help!\nAssistant: You're`` continues with `` welcome``;
``User: Translate "thank you" into French.\nAssistant:`` with `` Merci``. Formulaic replies,
simple instructions (translate, spell, count, answer yes or no) and everyday turns of
conversation. Written for capsense.
"""

from __future__ import annotations

from typing import Any

from capsense.tasks.common import docs_from_pairs

PAIRS = (
    ("User: Thank you so much for your help!\nAssistant: You're", " welcome"),
    ("User: Hello!\nAssistant: Hello! How can I", " help you"),
    ("User: Translate \"thank you\" into French.\nAssistant:", " Merci"),
    ("User: Translate \"hello\" into Spanish.\nAssistant:", " Hola"),
    ("User: What is the opposite of \"hot\"?\nAssistant: The opposite of \"hot\" is", " \"cold\""),
    ("User: Is the sky blue on a clear day? Answer yes or no.\nAssistant:", " Yes"),
    ("User: Is fire cold? Answer yes or no.\nAssistant:", " No"),
    ("User: What is 2 plus 2?\nAssistant: 2 plus 2 is", " 4"),
    ("User: How many days are in a week?\nAssistant: There are", " seven days"),
    ("User: Please spell the word \"cat\".\nAssistant: C-A-", "T"),
    ("User: Can you recommend a fruit that is yellow?\nAssistant: A", " banana"),
    ("User: Good morning!\nAssistant: Good", " morning"),
    ("User: What color is grass?\nAssistant: Grass is", " green"),
    ("User: Write the plural of \"child\".\nAssistant: The plural of \"child\" is", " \"children\""),
    ("A: How are you today?\nB: I'm fine, thank", " you"),
    ("A: Excuse me, where is the train station?\nB: It's just around the", " corner"),
    ("A: Would you like some tea?\nB: Yes,", " please"),
    ("A: Happy birthday!\nB: Thank", " you"),
    ("A: See you tomorrow!\nB: See you", " tomorrow"),
    ("A: What time is it?\nB: It's three o'", "clock"),
    ("A: Sorry I'm late.\nB: That's all", " right"),
    ("A: Nice to meet you.\nB: Nice to meet you", " too"),
    ("User: Summarize in one word: \"The weather is sunny and warm.\"\nAssistant:", " Sunny"),
    ("User: What is the capital of Italy? Reply with one word.\nAssistant:", " Rome"),
    ("User: Give me a synonym for \"happy\".\nAssistant: A synonym for \"happy\" is", " \"joyful\""),
    ("User: Count from one to three.\nAssistant: One, two,", " three"),
    ("User: What do you call a baby dog?\nAssistant: A baby dog is called a", " puppy"),
    ("User: Which is bigger, an elephant or a mouse?\nAssistant: An", " elephant"),
    ("Customer: I'd like a cup of coffee, please.\nWaiter: Would you like milk or", " sugar"),
    ("Teacher: Please open your books to page ten.\nStudent: Which", " book"),
)


def make_docs() -> list[dict[str, Any]]:
    """One document per exchange, in the listed order."""
    return docs_from_pairs(PAIRS, sep="")

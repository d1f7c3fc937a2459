"""QA: short factual questions with one-or-few-word answers, written for capsense.

Each document shows three other solved questions (fixed by the seed) and then asks one;
the reference continuation is the answer (``" Paris"``). The facts are stable, general
knowledge: capitals, chemical symbols, authors, science, geography and everyday facts.
"""

from __future__ import annotations

import random
from typing import Any

FACTS: tuple[tuple[str, str], ...] = (
    # capitals
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Spain?", "Madrid"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of China?", "Beijing"),
    ("What is the capital of Russia?", "Moscow"),
    ("What is the capital of Egypt?", "Cairo"),
    ("What is the capital of Canada?", "Ottawa"),
    ("What is the capital of Australia?", "Canberra"),
    ("What is the capital of Brazil?", "Brasília"),
    ("What is the capital of Argentina?", "Buenos Aires"),
    ("What is the capital of Mexico?", "Mexico City"),
    ("What is the capital of India?", "New Delhi"),
    ("What is the capital of the United Kingdom?", "London"),
    ("What is the capital of Ireland?", "Dublin"),
    ("What is the capital of Portugal?", "Lisbon"),
    ("What is the capital of Greece?", "Athens"),
    ("What is the capital of Turkey?", "Ankara"),
    ("What is the capital of Poland?", "Warsaw"),
    ("What is the capital of Austria?", "Vienna"),
    ("What is the capital of Sweden?", "Stockholm"),
    ("What is the capital of Norway?", "Oslo"),
    ("What is the capital of Finland?", "Helsinki"),
    ("What is the capital of Denmark?", "Copenhagen"),
    ("What is the capital of the Netherlands?", "Amsterdam"),
    ("What is the capital of Belgium?", "Brussels"),
    ("What is the capital of Switzerland?", "Bern"),
    ("What is the capital of Hungary?", "Budapest"),
    ("What is the capital of Kenya?", "Nairobi"),
    ("What is the capital of South Korea?", "Seoul"),
    ("What is the capital of Thailand?", "Bangkok"),
    ("What is the capital of Peru?", "Lima"),
    ("What is the capital of Chile?", "Santiago"),
    ("What is the capital of Cuba?", "Havana"),
    ("What is the capital of Iran?", "Tehran"),
    ("What is the capital of Iraq?", "Baghdad"),
    ("What is the capital of Indonesia?", "Jakarta"),
    ("What is the capital of the Philippines?", "Manila"),
    ("What is the capital of Vietnam?", "Hanoi"),
    # chemistry
    ("What is the chemical symbol for gold?", "Au"),
    ("What is the chemical symbol for silver?", "Ag"),
    ("What is the chemical symbol for iron?", "Fe"),
    ("What is the chemical symbol for sodium?", "Na"),
    ("What is the chemical symbol for potassium?", "K"),
    ("What is the chemical symbol for oxygen?", "O"),
    ("What is the chemical symbol for carbon?", "C"),
    ("What is the chemical symbol for hydrogen?", "H"),
    ("What is the chemical symbol for lead?", "Pb"),
    ("What is the chemical symbol for copper?", "Cu"),
    ("What is the chemical formula of water?", "H2O"),
    ("What gas do plants absorb from the air for photosynthesis?", "carbon dioxide"),
    ("What gas do humans need to breathe to stay alive?", "oxygen"),
    ("What is the most abundant gas in Earth's atmosphere?", "nitrogen"),
    # authors and works
    ("Who wrote Romeo and Juliet?", "William Shakespeare"),
    ("Who wrote Hamlet?", "William Shakespeare"),
    ("Who wrote Pride and Prejudice?", "Jane Austen"),
    ("Who wrote War and Peace?", "Leo Tolstoy"),
    ("Who wrote the novel 1984?", "George Orwell"),
    ("Who wrote Don Quixote?", "Miguel de Cervantes"),
    ("Who wrote Oliver Twist?", "Charles Dickens"),
    ("Who wrote The Odyssey?", "Homer"),
    ("Who wrote Adventures of Huckleberry Finn?", "Mark Twain"),
    ("Who wrote Moby-Dick?", "Herman Melville"),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci"),
    ("Who painted The Starry Night?", "Vincent van Gogh"),
    ("Who composed the Fifth Symphony that begins with four famous notes?", "Ludwig van Beethoven"),
    # science
    ("What is the largest planet in the solar system?", "Jupiter"),
    ("What is the closest planet to the Sun?", "Mercury"),
    ("Which planet is known as the Red Planet?", "Mars"),
    ("Which planet has the most famous rings?", "Saturn"),
    ("What is the name of the star at the center of our solar system?", "the Sun"),
    ("What is the natural satellite of the Earth called?", "the Moon"),
    ("At what temperature in degrees Celsius does water freeze?", "0"),
    ("At what temperature in degrees Celsius does water boil at sea level?", "100"),
    ("How many legs does a spider have?", "eight"),
    ("How many legs does an insect have?", "six"),
    ("What is the largest mammal?", "the blue whale"),
    ("What is the fastest land animal?", "the cheetah"),
    ("What organ pumps blood through the human body?", "the heart"),
    ("How many bones are in the adult human body?", "206"),
    ("What force pulls objects toward the Earth?", "gravity"),
    ("Who developed the theory of relativity?", "Albert Einstein"),
    ("Who proposed the theory of evolution by natural selection?", "Charles Darwin"),
    ("Who formulated the laws of motion and universal gravitation?", "Isaac Newton"),
    ("What is the hardest natural substance?", "diamond"),
    ("What is the boiling point of water in degrees Fahrenheit?", "212"),
    # geography
    ("What is the longest river in Africa?", "the Nile"),
    ("What is the largest ocean on Earth?", "the Pacific Ocean"),
    ("What is the highest mountain in the world?", "Mount Everest"),
    ("What is the largest desert in Africa?", "the Sahara"),
    ("On which continent is Brazil?", "South America"),
    ("On which continent is Kenya?", "Africa"),
    ("On which continent is Germany?", "Europe"),
    ("What is the largest country by area?", "Russia"),
    ("What is the most populous country in South America?", "Brazil"),
    ("Which ocean lies between Europe and North America?", "the Atlantic Ocean"),
    ("In which country are the pyramids of Giza?", "Egypt"),
    ("In which city is the Eiffel Tower?", "Paris"),
    ("In which city is the Colosseum?", "Rome"),
    ("In which country is the Great Wall?", "China"),
    ("What is the official language of Brazil?", "Portuguese"),
    ("What is the official language of Mexico?", "Spanish"),
    ("What currency is used in Japan?", "the yen"),
    ("What currency is used in the United Kingdom?", "the pound"),
    # everyday facts
    ("How many days are in a week?", "seven"),
    ("How many months are in a year?", "twelve"),
    ("How many days are in a leap year?", "366"),
    ("How many minutes are in an hour?", "60"),
    ("How many hours are in a day?", "24"),
    ("How many sides does a triangle have?", "three"),
    ("How many sides does a hexagon have?", "six"),
    ("How many players are on a soccer team on the field?", "eleven"),
    ("What color do you get by mixing blue and yellow?", "green"),
    ("What color do you get by mixing red and white?", "pink"),
    ("What is the first letter of the English alphabet?", "A"),
    ("How many continents are there?", "seven"),
    ("What is the square root of 81?", "9"),
    ("What is 7 times 8?", "56"),
    ("What is the freezing point of water in degrees Fahrenheit?", "32"),
    ("In which season do leaves fall from the trees?", "autumn"),
    ("What do bees make?", "honey"),
    ("What is the young of a cat called?", "a kitten"),
    ("What is the young of a dog called?", "a puppy"),
    ("What is frozen water called?", "ice"),
    ("Which instrument has 88 keys?", "the piano"),
    ("Which animal is known as the king of the jungle?", "the lion"),
    # history
    ("In which year did World War II end?", "1945"),
    ("Who was the first President of the United States?", "George Washington"),
    ("Who was the first person to walk on the Moon?", "Neil Armstrong"),
    ("In which year did Christopher Columbus first reach the Americas?", "1492"),
    ("Which ship sank after hitting an iceberg in 1912?", "the Titanic"),
    ("Which empire built the Colosseum?", "the Roman Empire"),
    ("Who invented the telephone?", "Alexander Graham Bell"),
    ("Who discovered penicillin?", "Alexander Fleming"),
)


def make_docs(shots: int = 3, seed: int = 1618) -> list[dict[str, Any]]:
    """One document per fact, in a seeded shuffle, each after ``shots`` other solved questions."""
    rng = random.Random(seed)
    order = list(range(len(FACTS)))
    rng.shuffle(order)
    docs = []
    for i, k in enumerate(order):
        others = rng.sample([j for j in range(len(FACTS)) if j != k], shots)
        lines = [f"Question: {FACTS[j][0]}\nAnswer: {FACTS[j][1]}" for j in others]
        q, a = FACTS[k]
        docs.append({"id": i, "fact": k, "context": "\n\n".join(lines + [f"Question: {q}\nAnswer:"]), "continuation": f" {a}"})
    return docs

"""Prose control: neutral everyday English, written for capsense.

Each passage becomes one document: its first sentence is the context and the rest the
continuation. The passages are also the default reference set for mean ablation.
"""

from __future__ import annotations

from typing import Any

PASSAGES = (
    "The library opens at nine in the morning. Most visitors come in the afternoon, when the reading room is warm and quiet.",
    "Our neighbour keeps a small vegetable garden behind the house. Every summer she gives us more tomatoes than we can eat.",
    "The train was late again this morning. People waited on the platform, checking their phones and looking down the tracks.",
    "A good soup starts with a simple stock. Onions, carrots and celery are cooked slowly before any water is added.",
    "The museum has moved its old maps to a new room. The light there is softer, so the paper will last longer.",
    "Rain fell for most of the weekend. By Monday the river had risen, and the path along the bank was closed.",
    "She learned to ride a bicycle when she was seven. Her father held the seat until she no longer needed him to.",
    "The bakery on the corner sells bread until noon. After that, only a few rolls and some biscuits are left.",
    "Every autumn the school holds a book fair. Parents donate old books, and the money buys new ones for the classrooms.",
    "The hotel room had a view of the harbour. In the evening we watched the fishing boats come back one by one.",
    "Walking is one of the easiest ways to stay active. A short walk after dinner can also help you sleep better.",
    "The meeting was moved to Thursday afternoon. Several people were travelling on Wednesday and could not attend.",
    "Our cat sleeps on the windowsill most of the day. When the sun moves, she moves with it to stay in the light.",
    "The old bridge was built more than a hundred years ago. It was repaired last year and now carries only bicycles.",
    "He keeps a notebook by his bed. When he wakes with an idea, he writes it down before he forgets it.",
    "The market is busiest on Saturday mornings. Farmers arrive early to set up their stalls before the crowds come.",
    "Fresh snow covered the village overnight. Children were out with their sleds before breakfast.",
    "The kitchen was painted a pale yellow. It made the small room feel brighter, even on grey days.",
    "Most of the guests left before midnight. A few stayed to help clear the tables and wash the glasses.",
    "The new park has a pond, a playground and a long path for running. On weekends it is full of families.",
    "My grandmother wrote letters to her sister every week. They kept writing to each other for more than forty years.",
    "The bus stops outside the hospital every twenty minutes. At night it runs only once an hour.",
    "A small shop in the square repairs watches and clocks. The owner learned the trade from his uncle.",
    "The concert began with a quiet piece for strings. Later the whole orchestra joined in, and the hall filled with sound.",
    "We planted three apple trees at the bottom of the garden. It will be a few years before they give any fruit.",
    "The office kitchen has a kettle, a fridge and a long table. At lunch it is the most crowded room on the floor.",
    "He forgot his umbrella on the train. Luckily, someone handed it in at the station the next day.",
    "The lake is cold even in August. Only the bravest swimmers go in before the afternoon sun has warmed it.",
    "Our team finished the project a week early. We spent the extra time testing and writing notes for the next group.",
    "The village has one shop, one school and one church. Everyone seems to know everyone else by name.",
    "She bought a second-hand piano last spring. Now she practises for half an hour every evening after work.",
    "The road along the coast is narrow and winding. Drivers are asked to slow down near the cliffs.",
    "The children built a small boat out of wood and string. It floated for a few minutes before it tipped over.",
    "The restaurant changes its menu with the seasons. In winter it serves stews, and in summer mostly salads and fish.",
    "A storm knocked down several trees near the school. Workers cleared the road before the buses arrived.",
    "He collects stamps from countries he has never visited. Each one comes with a story he likes to tell.",
    "The hospital opened a new wing for children. It has bright walls, large windows and a room full of toys.",
    "Our street was repaved last month. The new surface is smooth, and the noise from the traffic is lower.",
    "The festival lasts three days and takes over the whole town. Music plays in the square from morning until late at night.",
    "She keeps her plants on a shelf by the window. Once a week she waters them and turns them toward the light.",
    "The ferry crosses the bay twice a day. In rough weather the afternoon crossing is often cancelled.",
    "A family of ducks lives by the pond in the park. In spring the ducklings follow their mother in a straight line.",
    "The teacher asked the class to write about their holidays. Most of them wrote about the beach or visiting relatives.",
    "The farm sells eggs and honey from a table by the gate. Customers leave the money in a small wooden box.",
    "The clock in the town hall has stopped again. Nobody is sure who is responsible for winding it.",
    "We took the long way home through the hills. The views were worth the extra hour in the car.",
    "The café is small, with only six tables. In the morning there is often a queue out of the door.",
    "He spent the weekend fixing the fence at the back of the garden. By Sunday evening it was straight again.",
    "Autumn leaves covered the path through the woods. They made a soft sound under our feet as we walked.",
    "The cinema shows old films on Tuesday nights. Tickets are cheaper, and the seats are rarely full.",
    "My brother is learning to cook. Last night he made pasta with a sauce of garlic, butter and lemon.",
    "The lighthouse is no longer in use. It has been turned into a small museum about the history of the coast.",
    "The garden centre sells seeds, tools and plants. In spring it is one of the busiest shops in the area.",
    "She keeps a list of books she wants to read. The list grows faster than she can read them.",
    "The swimming pool closes for cleaning every Monday. On the other days it opens at seven in the morning.",
    "A new family moved into the house across the road. They have two small children and a large brown dog.",
    "The mountain hut offers beds and simple meals to walkers. It is open only from June to September.",
    "Our office moved to the third floor last week. The new rooms are larger and have windows on both sides.",
    "The river is wide and slow near the town. Further up the valley it runs fast between steep rocks.",
    "He always takes the stairs instead of the lift. He says it is the only exercise he gets on a working day.",
    "The post office is closed on Sundays. Parcels can still be left in the machine outside the door.",
    "Every year the town plants flowers along the main street. By June the whole street is full of colour.",
    "The old house has thick stone walls. It stays cool in summer and keeps the heat in during winter.",
    "She walked to the top of the hill to watch the sunrise. The sky turned from grey to pink and then to gold.",
    "The band practises in a garage at the end of our road. On warm evenings we can hear them from the kitchen.",
    "The school library is being renovated. Until it reopens, books can be borrowed from the town library instead.",
    "We had a picnic by the river on Sunday. The weather was warm, and there were few people about.",
    "The tailor on the high street can shorten trousers in a day. For a suit he usually needs a week.",
    "A light wind moved the curtains in the open window. Outside, the street was quiet except for a passing car.",
    "He learned to swim late, when he was already thirty. Now he swims a kilometre three times a week.",
)


def make_docs() -> list[dict[str, Any]]:
    """One document per passage: first sentence as context, the rest as continuation."""
    docs = []
    for i, passage in enumerate(PASSAGES):
        first, rest = passage.split(". ", 1)
        docs.append({"id": i, "context": first + ".", "continuation": " " + rest})
    return docs

"""Ordinary text: short encyclopedia-style paragraphs, written for capsense, scored whole (a perplexity task).

``capsense_text`` is lm-eval's ``loglikelihood_rolling`` kind (wikitext's): each paragraph is predicted whole, every
token from the ones before it. It reports bits per byte, a log-loss whose relative change is that of nats per token,
the scale ``capsense validate`` judges every loss row on; word and byte perplexity (wikitext's other two) are its
exponentials: on SmolLM2 the main job's set moved word perplexity +1.0% where bits per byte moved +0.2% (round 48). It is in the
held-out suite (:data:`capsense.tasks.suite.HELD_OUT`, round 48): whether a model still writes ordinary text after an
edit is a check nobody should have to name, and no other suite task scores running text whole (``capsense_prose``, in
the default suite, scores the rest of a passage after its first sentence). 40 paragraphs of 2 sentences, on geography,
nature, history, food and everyday technology.
"""

from __future__ import annotations

from typing import Any

PARAGRAPHS: tuple[str, ...] = (
    "The Danube is the second longest river in Europe. It rises in the Black Forest of Germany and flows east through "
    "ten countries before it reaches the Black Sea, passing four capital cities on the way.",
    "Photosynthesis is the process by which green plants turn light into chemical energy. Water and carbon dioxide "
    "go in, and sugar and oxygen come out, most of it in the leaves.",
    "The printing press was developed in Europe in the fifteenth century. Books that had been copied by hand for "
    "months could now be made in days, and the number of readers grew quickly.",
    "A violin has four strings tuned a fifth apart. The player draws a bow of horsehair across them, and the hollow "
    "wooden body makes the sound louder and warmer.",
    "Honey bees live in colonies of many thousands. A single queen lays the eggs, while the workers gather nectar, "
    "build the comb and keep the hive at a steady temperature.",
    "The Sahara is the largest hot desert in the world. Most of it is rock and gravel rather than sand, and some "
    "parts receive almost no rain for years at a time.",
    "Bread is made from flour, water, salt and yeast. The yeast feeds on sugars in the dough and releases gas, which "
    "makes the loaf rise before it is baked.",
    "The first modern Olympic Games were held in Athens in 1896. Athletes from fourteen nations took part, and the "
    "marathon was run along a route from the town of Marathon.",
    "Glaciers form where more snow falls in winter than melts in summer. Over many years the snow is pressed into ice, "
    "which slowly flows downhill under its own weight.",
    "The human heart has four chambers. The right side pumps blood to the lungs, and the left side pumps it to the rest "
    "of the body, about seventy times a minute at rest.",
    "Chess is played on a board of sixty-four squares. Each player starts with sixteen pieces, and the game ends when "
    "one king is attacked and cannot escape.",
    "The Moon takes about twenty-seven days to orbit the Earth. Because it turns once in the same time, the same side "
    "always faces us.",
    "Coffee plants grow best in the tropics, on hills with rich soil and regular rain. The seeds inside the red fruit "
    "are dried and roasted before they are ground.",
    "A lighthouse warns ships of rocks and marks the entrance to a harbour. Each one flashes in its own pattern, so "
    "sailors can tell at night which light they are looking at.",
    "The Great Wall of China was built and rebuilt over many centuries. Its walls, towers and trenches stretch across "
    "mountains, deserts and grasslands in the north of the country.",
    "Volcanoes form where molten rock from deep inside the Earth reaches the surface. Some erupt violently, while "
    "others release slow rivers of lava.",
    "The bicycle became popular in the late nineteenth century. Cheap and easy to repair, it gave many people their "
    "first chance to travel beyond their own town.",
    "Penguins live almost entirely in the southern half of the world. They cannot fly, but their wings work as "
    "flippers, and some species dive hundreds of metres for fish.",
    "Paper money was first used in China more than a thousand years ago. Merchants found it easier to carry than heavy "
    "strings of metal coins.",
    "The Amazon rainforest covers much of northern South America. It holds a large share of the world's plant and "
    "animal species, many of which have never been described.",
    "A rainbow appears when sunlight shines through drops of rain. Each drop bends the light and splits it into "
    "colours, from red on the outside to violet on the inside.",
    "The telephone turned speech into an electrical signal that could travel along a wire. Within a few decades, "
    "exchanges connected millions of homes and offices.",
    "Cheese is made by curdling milk and separating the solid curds from the liquid whey. The curds are salted, pressed "
    "and often left to age for months.",
    "Mount Everest is the highest mountain above sea level. Climbers usually reach its summit in May, when the winds "
    "are weaker than at other times of the year.",
    "Whales are mammals, not fish. They breathe air through a blowhole on the top of the head and feed their young on "
    "milk.",
    "The library of Alexandria was one of the largest in the ancient world. Scholars came from far away to read and "
    "copy its scrolls.",
    "Earthquakes happen when blocks of rock slip past each other along a fault. The energy released travels through "
    "the ground as waves that can be felt far away.",
    "Tea is the most widely drunk beverage after water. The leaves of the same plant become green, black or oolong "
    "tea depending on how they are processed.",
    "Windmills were once used to grind grain and pump water. Modern wind turbines use the same moving air to make "
    "electricity.",
    "The octopus has eight arms lined with suckers. It can change the colour of its skin in a moment and squeeze "
    "through any gap larger than its beak.",
    "Roman roads were built with layers of stone and gravel. Many were so well made that they are still used, two "
    "thousand years later.",
    "Salt has been traded for thousands of years. Before refrigerators, it was one of the main ways to keep meat and "
    "fish from spoiling.",
    "The piano was invented in Italy around the year 1700. Unlike earlier keyboard instruments, it could play both "
    "softly and loudly, which gave it its name.",
    "Tides are caused mainly by the pull of the Moon on the oceans. Most coasts see two high tides and two low tides "
    "every day.",
    "Rice is the main food of more than half the people on Earth. It is usually grown in flooded fields, which keep "
    "weeds down and the roots moist.",
    "The compass uses a magnetised needle that turns to point north. It allowed sailors to find their way even when "
    "clouds hid the sun and the stars.",
    "Elephants are the largest animals living on land. They use their trunks to breathe, smell, drink and pick up "
    "objects as small as a single leaf.",
    "A canal is a waterway dug by people to carry boats or water. Locks raise and lower boats where the land changes "
    "height.",
    "Snowflakes form when water vapour freezes around tiny particles high in the clouds. Most have six sides, but no "
    "two grow in exactly the same way.",
    "The railway changed how people lived and worked. Goods that had taken weeks to move by road could cross a country "
    "in a day.",
)


def make_docs() -> list[dict[str, Any]]:
    """One document per paragraph: ``text`` is the whole paragraph."""
    return [{"id": i, "text": p} for i, p in enumerate(PARAGRAPHS)]

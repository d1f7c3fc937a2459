"""A new user's own task, as one would write it: capitals of 60 countries as an lm-eval YAML over a JSON file.

Round 25's check of how capsense behaves on a task it was never built or tuned for (a factual-recall target,
close to the default suite's factual-recall control). It writes the task folder and prints the commands::

    python recipes/bench/newuser_task.py /tmp/usertask
    HF_HUB_OFFLINE=1 capsense locate smollm2-135m --task user_capitals --include-path /tmp/usertask \\
        --limit 24 --fe-budget 20 --out RUN
    HF_HUB_OFFLINE=1 capsense validate smollm2-135m --heads RUN/heads.json --top-k 5 \\
        --include-path /tmp/usertask --limit 40 --out RUN/validate

Round 27 added a second task of another kind, a multiple-choice one (the plural of 24 English nouns among 4
choices, ``user_plural``, written beside the first), located with ``--limit 12`` so that 12 documents are held out
for validation::

    HF_HUB_OFFLINE=1 capsense locate smollm2-135m --task user_plural --include-path /tmp/usertask \
        --limit 12 --fe-budget 20 --out RUN
    HF_HUB_OFFLINE=1 capsense validate smollm2-135m --heads RUN/heads.json --top-k 5 \
        --include-path /tmp/usertask --limit 40 --out RUN/validate

Round 48 added a third kind, a perplexity task (lm-eval's ``loglikelihood_rolling``, wikitext's kind: 40 short
encyclopedia-style paragraphs written for it, each scored whole, reported as word and byte perplexity,
``user_text``), as a control beside the default suite and as a held-out task of the validation::

    HF_HUB_OFFLINE=1 capsense locate smollm2-135m --task capsense_induction --controls default,user_text \
        --include-path /tmp/usertask --control-limit 16 --limit 24 --fe-budget 20 --top-m 16 --refine 24 --out RUN
    HF_HUB_OFFLINE=1 capsense validate smollm2-135m --heads RUN/heads.json --top-k 5 \
        --include-path /tmp/usertask --limit 40 --out RUN/validate

Results: recipes/results/RESULTS-locate.md, "Round 25", "Round 27" and "Round 48".
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

CAPITALS = (
    "France Paris|Germany Berlin|Italy Rome|Spain Madrid|Portugal Lisbon|Greece Athens|Poland Warsaw|Austria Vienna|"
    "Hungary Budapest|Sweden Stockholm|Norway Oslo|Finland Helsinki|Denmark Copenhagen|Ireland Dublin|Belgium Brussels|"
    "Netherlands Amsterdam|Russia Moscow|Ukraine Kyiv|Egypt Cairo|Kenya Nairobi|Nigeria Abuja|Ghana Accra|Morocco Rabat|"
    "Japan Tokyo|China Beijing|India Delhi|Thailand Bangkok|Vietnam Hanoi|Indonesia Jakarta|Philippines Manila|Peru Lima|"
    "Chile Santiago|Argentina Buenos Aires|Colombia Bogota|Venezuela Caracas|Cuba Havana|Mexico Mexico City|Canada Ottawa|"
    "Australia Canberra|Iran Tehran|Iraq Baghdad|Syria Damascus|Lebanon Beirut|Turkey Ankara|Czechia Prague|"
    "Romania Bucharest|Bulgaria Sofia|Serbia Belgrade|Croatia Zagreb|Iceland Reykjavik|Ethiopia Addis Ababa|"
    "Sudan Khartoum|Senegal Dakar|Nepal Kathmandu|Pakistan Islamabad|Afghanistan Kabul|Mongolia Ulaanbaatar|Qatar Doha|"
    "Jordan Amman|Israel Jerusalem"
)

YAML = """task: user_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "The capital city of {{{{country}}}} is"
doc_to_target: " {{{{capital}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(folder: Path) -> Path:
    """``folder``/capitals.jsonl and capitals.yaml (the YAML names the JSON file by its absolute path)."""
    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    rows = [dict(zip(("country", "capital"), p.split(" ", 1))) for p in CAPITALS.split("|")]
    data = folder / "capitals.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "capitals.yaml").write_text(YAML.format(data=data))
    return folder


NOUNS = ("cat cats|dog dogs|house houses|tree trees|car cars|book books|pen pens|cup cups|box boxes|fox foxes|"
         "bus buses|city cities|baby babies|leaf leaves|knife knives|wolf wolves|mouse mice|child children|man men|"
         "woman women|tooth teeth|foot feet|goose geese|person people")

PLURAL_YAML = """task: user_plural
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "The plural of {{{{word}}}} is"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_plural_task(folder: Path) -> Path:
    """``folder``/plural.jsonl and plural.yaml: each noun's plural among 4 choices (3 other nouns' plurals, drawn
    with a fixed seed), a multiple-choice task with the answer's position varying."""
    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    pairs = [p.split(" ") for p in NOUNS.split("|")]
    plurals = [p for _, p in pairs]
    rng, rows = random.Random(0), []
    for word, plural in pairs:
        wrong = [x for x in plurals if x != plural]
        rng.shuffle(wrong)
        choices = [plural, *wrong[:3]]
        rng.shuffle(choices)
        rows.append({"word": word, "choices": choices, "label": choices.index(plural)})
    data = folder / "plural.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "plural.yaml").write_text(PLURAL_YAML.format(data=data))
    return folder


ARTICLES = (
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

TEXT_YAML = """task: user_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""


def write_text_task(folder: Path) -> Path:
    """``folder``/text.jsonl and text.yaml: the 40 paragraphs above as a perplexity task (``loglikelihood_rolling``:
    each paragraph predicted whole, lm-eval's word and byte perplexities), as a user would add wikitext's kind."""
    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "text.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ARTICLES))
    (folder / "text.yaml").write_text(TEXT_YAML.format(data=data))
    return folder


if __name__ == "__main__":
    out = write_task(Path(sys.argv[1] if len(sys.argv) > 1 else "usertask"))
    write_plural_task(out)
    write_text_task(out)
    print(f"wrote {out}/capitals.yaml and capitals.jsonl (task user_capitals, 60 documents), "
          f"{out}/plural.yaml and plural.jsonl (task user_plural, 24 documents), "
          f"{out}/text.yaml and text.jsonl (task user_text, {len(ARTICLES)} documents)")

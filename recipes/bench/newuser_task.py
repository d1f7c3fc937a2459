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

Round 48 added a third kind, a perplexity task (lm-eval's ``loglikelihood_rolling``, wikitext's kind: the 40 short
encyclopedia-style paragraphs of ``capsense_text``, each scored whole, reported as word and byte perplexity,
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
    """``folder``/text.jsonl and text.yaml: the 40 paragraphs of ``capsense_text`` (:mod:`capsense.tasks.text`) as a
    user's own perplexity task (``loglikelihood_rolling``: each paragraph predicted whole, lm-eval's word and byte
    perplexities), written as a user would add wikitext's kind: a JSON file and a YAML."""
    from capsense.tasks.text import PARAGRAPHS

    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "text.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in PARAGRAPHS))
    (folder / "text.yaml").write_text(TEXT_YAML.format(data=data))
    return folder


if __name__ == "__main__":
    out = write_task(Path(sys.argv[1] if len(sys.argv) > 1 else "usertask"))
    write_plural_task(out)
    write_text_task(out)
    print(f"wrote {out}/capitals.yaml and capitals.jsonl (task user_capitals, 60 documents), "
          f"{out}/plural.yaml and plural.jsonl (task user_plural, 24 documents), "
          f"{out}/text.yaml and text.jsonl (task user_text, 40 documents)")

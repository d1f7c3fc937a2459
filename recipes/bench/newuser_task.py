"""A new user's own task, as one would write it: capitals of 60 countries as an lm-eval YAML over a JSON file.

Round 25's check of how capsense behaves on a task it was never built or tuned for (a factual-recall target,
close to the default suite's factual-recall control). It writes the task folder and prints the commands::

    python recipes/bench/newuser_task.py /tmp/usertask
    HF_HUB_OFFLINE=1 capsense locate smollm2-135m --task user_capitals --include-path /tmp/usertask \\
        --limit 24 --fe-budget 20 --out RUN
    HF_HUB_OFFLINE=1 capsense validate smollm2-135m --heads RUN/heads.json --top-k 5 \\
        --include-path /tmp/usertask --limit 40 --out RUN/validate

Results: recipes/results/RESULTS-locate.md, "Round 25".
"""

from __future__ import annotations

import json
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


if __name__ == "__main__":
    out = write_task(Path(sys.argv[1] if len(sys.argv) > 1 else "usertask"))
    print(f"wrote {out}/capitals.yaml and capitals.jsonl (task user_capitals, 60 documents)")

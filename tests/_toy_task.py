"""A tiny offline lm-eval task (JSONL + YAML in a folder) and a tiny model folder for locate tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

from conftest import save_tiny_folder

TOY_TASK = "toy_copy"
TOY_CONTROL = "toy_count"
TOY_GEN = "toy_copy_gen"  # the copy task as generation (exact_match, char_code)
TOY_GEN_FN = "toy_copy_gen_fn"  # the same with a metric function reporting len@chars
TOY_MC = "toy_next"  # multiple choice: the letter after a run of letters, four choices
TOY_ROLLING = "toy_text"  # perplexity (loglikelihood_rolling): runs of words, some longer than the tiny model's 128


def _write_task(folder: Path, name: str, docs: list[dict], body: str) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{continuation}}"\ntarget_delimiter: ""\n' + body
    )


def write_toy_tasks(folder: Path, n_docs: int = 40) -> Path:
    """Two log-likelihood tasks (copy a letter string: target; continue a count: control), a
    multiple-choice one (the next letter), a perplexity one (runs of words) and the copy task as generation."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    copy_docs, count_docs = [], []
    for _ in range(n_docs):
        w = "".join(rng.choice("abcdefgh") for _ in range(8))
        copy_docs.append({"context": f"{w} {w[:4]}", "continuation": w[4:6]})
        a = rng.randint(1, 5)
        count_docs.append({"context": " ".join(str(a + i) for i in range(4)), "continuation": f" {a + 4}"})
    loglik = "output_type: loglikelihood\nmetric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    _write_task(folder, TOY_TASK, copy_docs, loglik)
    _write_task(folder, TOY_CONTROL, count_docs, loglik)
    letters = "abcdefghijkl"
    mc_docs = []
    for _ in range(n_docs):
        i = rng.randint(0, len(letters) - 5)
        wrong = rng.sample([c for c in letters if c != letters[i + 3]], 3)
        gold = rng.randint(0, 3)
        choices = wrong[:gold] + [letters[i + 3]] + wrong[gold:]
        mc_docs.append({"context": " ".join(letters[i : i + 3]), "choices": [f" {c}" for c in choices], "gold": gold})
    (folder / f"{TOY_MC}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in mc_docs))
    (folder / f"{TOY_MC}.yaml").write_text(
        f"task: {TOY_MC}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / f'{TOY_MC}.jsonl'}\n"
        'test_split: test\noutput_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{gold}}"\ntarget_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "off"]
    text_docs = [{"text": " ".join(rng.choice(words) for _ in range(rng.choice([3, 8, 30, 60])))} for _ in range(n_docs)]
    (folder / f"{TOY_ROLLING}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in text_docs))
    (folder / f"{TOY_ROLLING}.yaml").write_text(
        f"task: {TOY_ROLLING}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / f'{TOY_ROLLING}.jsonl'}\n"
        'test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )
    _write_task(folder, TOY_GEN, copy_docs, (
        "output_type: generate_until\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 3\n  do_sample: false\n"
        "process_results: !function toy_gen_metrics.process\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: char_code\n    aggregation: mean\n    higher_is_better: false\n"
        "filter_list:\n  - name: first\n    filter:\n      - function: take_first\n"
    ))
    # the same, scored by a metric function that reports under another name (like HumanEval's
    # pass_at_k -> pass@1): gen_len -> len@chars
    _write_task(folder, TOY_GEN_FN, copy_docs, (
        "output_type: generate_until\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 3\n  do_sample: false\n"
        "metric_list:\n  - metric: !function toy_gen_metrics.gen_len\n    aggregation: mean\n    higher_is_better: true\n"
    ))
    # char_code: a graded, deterministic function of the generation (a random tiny model never
    # matches exactly), so tests can tell masks apart.
    (folder / "toy_gen_metrics.py").write_text(
        "def process(doc, results):\n"
        "    gen = results[0]\n"
        "    return {'exact_match': float(gen.strip() == doc['continuation'].strip()),\n"
        "            'char_code': sum(ord(c) for c in gen) / (128.0 * max(1, len(gen)))}\n"
        "\n\ndef gen_len(references, predictions, **kwargs):\n"
        "    return {'len@chars': float(len(predictions[0]))}\n"
    )
    return folder


def make_toy_setup(root: Path) -> tuple[Path, Path]:
    """(model folder, task folder) under ``root``."""
    return save_tiny_folder("llama", root / "model"), write_toy_tasks(root / "tasks")


def write_toy_recipe(root: Path, locate: dict, validate: dict) -> Path:
    """A `capsense run` recipe over a fresh toy setup under ``root``: the toy model, ``toy_copy``
    located against ``toy_count`` with the ``locate`` fields, then validated with ``validate``'s."""
    import yaml

    model, tasks = make_toy_setup(root / "toy")
    recipe = {"name": "toy", "model": str(model), "out": str(root / "out"),
              "locate": {"task": TOY_TASK, "controls": [TOY_CONTROL], "include_path": [str(tasks)], **locate},
              "validate": {k: ([str(tasks)] if v == "TASKS" else v) for k, v in validate.items()}}
    path = root / "toy.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path

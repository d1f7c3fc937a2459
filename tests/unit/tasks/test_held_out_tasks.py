"""The held-out suite's round-17 tasks: built offline and deterministically, well formed, loaded by lm-eval."""

from __future__ import annotations

import pytest

from capsense.scoring.probe import build_probe
from capsense.tasks import comparisons, translation
from conftest import make_char_tokenizer


def test_translation_asks_each_word_once_per_language_and_never_shows_its_answer():
    docs = translation.make_docs()
    assert docs == translation.make_docs() and len(docs) == 2 * len(translation.FRENCH) == 60
    assert [d["language"] for d in docs[:4]] == ["French", "Spanish", "French", "Spanish"]
    for lang, pairs in translation.LANGUAGES.items():
        ours = [d for d in docs if d["language"] == lang]
        asked = [d["context"].rsplit("\n", 2)[-2].removeprefix("English: ") for d in ours]
        assert sorted(asked) == sorted(e for e, _ in pairs)  # every word once
        answer = dict(pairs)
        for d, word in zip(ours, asked):
            assert d["context"].endswith(f"English: {word}\n{lang}:") and d["continuation"] == f" {answer[word]}"
    assert all(d["context"].count("English:") == 1 for d in docs)  # zero shots by default
    for d in translation.make_docs(shots=2):  # shots: other words of the same language, solved
        *shots, last = d["context"].split("\n\n")
        assert len(shots) == 2 and all(s.split("\n")[1].startswith(d["language"] + ": ") for s in shots)
        assert d["continuation"].strip() not in {s.split(": ")[-1] for s in shots}


def test_comparisons_score_the_two_things_and_the_right_one_is_not_always_first():
    docs = comparisons.make_docs()
    assert docs == comparisons.make_docs() and len(docs) == len(comparisons.ITEMS) >= 40
    firsts = 0
    for d in docs:
        assert len(d["choices"]) == 2 and d["choices"][0] != d["choices"][1]
        word = d["context"].split()[3].rstrip(",")
        more, = [m for w, m, l in comparisons.ITEMS if w == word and {m, l} == set(d["choices"])]
        assert d["context"] == f"Question: Which is {word}, {d['choices'][0]} or {d['choices'][1]}?\nAnswer:"
        assert d["choices"][d["gold"]] == more
        firsts += d["gold"] == 0
    assert 0.35 <= firsts / len(docs) <= 0.65  # answering "the first one" is no better than chance
    assert len({d["context"] for d in docs}) == len(docs)
    assert len({frozenset(d["choices"]) for d in docs}) == len(docs)  # no pair of things asked twice
    one = comparisons.make_docs(shots=1)
    assert all(d["context"].count("Question:") == 2 and d["context"].split("\n\n")[-1] in {e["context"] for e in docs}
               for d in one)


@pytest.mark.parametrize("task,module,kind", [
    ("capsense_translation", translation, "loglikelihood"), ("capsense_comparisons", comparisons, "multiple_choice"),
])
def test_lm_eval_loads_the_yaml_into_a_probe(task, module, kind):
    docs = module.make_docs()
    probe = build_probe(task, make_char_tokenizer(), limit=None, seed=0)
    assert probe.kind == kind and sorted(probe.doc_ids) == list(range(len(docs)))
    per_doc = 2 if kind == "multiple_choice" else 1
    assert probe.n_requests == per_doc * len(docs)
    if kind == "multiple_choice":
        assert [int(probe.gold[i]) for i in range(probe.n_docs)] == [docs[d]["gold"] for d in probe.doc_ids]

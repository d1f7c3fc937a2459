"""The held-out suite's round-17 and round-48 tasks: built offline and deterministically, well formed, loaded by lm-eval."""

from __future__ import annotations

import pytest

from capsense.scoring.probe import build_probe
from capsense.tasks import agreement, letters, text, translation
from conftest import make_char_tokenizer


def test_translation_asks_each_word_once_per_language_after_two_solved_words_of_that_language():
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
            *shots, _ = d["context"].split("\n\n")
            assert len(shots) == 2 and all(s.split("\n")[1].startswith(lang + ": ") for s in shots)
            assert answer[word] not in {s.split(": ")[-1] for s in shots}  # answering is not copying
    assert all(d["context"].count("English:") == 1 for d in translation.make_docs(shots=0))


def test_agreement_puts_an_attractor_of_the_other_number_between_subject_and_verb():
    docs = agreement.make_docs()
    assert docs == agreement.make_docs() and len(docs) == 48
    plural = {p for _, p in agreement.NOUNS}
    for d in docs:
        words = d["context"].split()
        subject, attractor = words[1], words[-1]
        assert d["context"].startswith("The ") and tuple(d["choices"]) in agreement.VERBS
        assert d["gold"] == (subject in plural) and (attractor in plural) != (subject in plural)
    golds = [d["gold"] for d in docs]
    assert 0.35 <= sum(golds) / len(golds) <= 0.65  # "always plural" is no better than chance
    assert len({d["context"] for d in docs}) == len(docs)


def test_letters_ask_each_word_once_after_a_solved_other_word():
    docs = letters.make_docs()
    assert docs == letters.make_docs() and len(docs) == len(letters.WORDS) == len(set(letters.WORDS))
    asked = [d["context"].rsplit('"', 2)[-2] for d in docs]
    assert sorted(asked) == sorted(letters.WORDS)
    for d, word in zip(docs, asked):
        shot, last = d["context"].split("\n\n")
        assert d["continuation"] == f" {word[0]}" and last.endswith("Answer:") and word not in shot
        assert shot.endswith(" " + shot.split('"')[1][0])  # the shot is solved right


@pytest.mark.parametrize("task,module,kind", [
    ("capsense_translation", translation, "loglikelihood"), ("capsense_letters", letters, "loglikelihood"),
    ("capsense_agreement", agreement, "multiple_choice"), ("capsense_text", text, "loglikelihood"),
])
def test_lm_eval_loads_the_yaml_into_a_probe(task, module, kind):
    docs = module.make_docs()
    probe = build_probe(task, make_char_tokenizer(), limit=None, seed=0)
    assert probe.kind == kind and sorted(probe.doc_ids) == list(range(len(docs)))
    per_doc = 2 if kind == "multiple_choice" else 1
    assert probe.n_requests == per_doc * len(docs)
    if kind == "multiple_choice":
        assert [int(probe.gold[i]) for i in range(probe.n_docs)] == [docs[d]["gold"] for d in probe.doc_ids]


def test_ordinary_text_is_forty_distinct_paragraphs_scored_whole():
    docs = text.make_docs()
    assert docs == text.make_docs() and len(docs) == 40 and [d["id"] for d in docs] == list(range(40))
    assert len({d["text"] for d in docs}) == 40 and all(d["text"].endswith(".") for d in docs)
    tok = make_char_tokenizer()
    probe = build_probe("capsense_text", tok, limit=None, seed=0)  # a perplexity task: the whole paragraph predicted
    by_doc = {probe.doc_ids[i]: c for i, c in zip(probe.doc_of, probe.continuation_ids)}
    assert all(by_doc[d["id"]] == tok.encode(d["text"]) for d in docs) and probe.meta["rolling_window"] == 2048

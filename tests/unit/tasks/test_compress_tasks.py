"""The capabilities written for compression: math word problems and factual QA."""

from __future__ import annotations

import re

from conftest import make_char_tokenizer

from capsense.compress.capabilities import CAPABILITIES, parse_capabilities
from capsense.compress.capability_loss import build_probes
from capsense.tasks import math_problems, qa


def test_math_word_problems_are_deterministic_and_correct():
    docs = math_problems.make_docs()
    assert docs == math_problems.make_docs() and len(docs) == 480
    assert len({d["template"] for d in docs[:12]}) == 12  # the first 12 cover every template
    for d in docs:
        m = re.fullmatch(r" (.+) = (-?\d+)\. The answer is (-?\d+)\.", d["continuation"])
        assert m, d["continuation"]
        assert eval(m.group(1).replace("/", "//")) == int(m.group(2)) == int(m.group(3)) == d["answer"]
        assert d["answer"] >= 0
        assert d["context"].endswith("Answer:") and d["context"].count("Question:") == 3
        for shot in re.findall(r"Answer: (.+?) = (-?\d+)\.", d["context"]):
            assert eval(shot[0].replace("/", "//")) == int(shot[1])


def test_qa_is_deterministic_with_unique_questions():
    docs = qa.make_docs()
    assert docs == qa.make_docs() and len(docs) == len(qa.FACTS)
    assert len({q for q, _ in qa.FACTS}) == len(qa.FACTS)
    assert sorted(d["fact"] for d in docs) == list(range(len(qa.FACTS)))
    for d in docs:
        q, a = qa.FACTS[d["fact"]]
        assert d["context"].endswith(f"Question: {q}\nAnswer:") and d["continuation"] == f" {a}"
        assert d["context"].count("Question:") == 4


def test_capability_probes_are_the_first_documents_of_their_tasks():
    tok = make_char_tokenizer()
    probes = build_probes(tok, "math,qa", 5)
    assert probes["qa"].doc_ids == list(range(5)) and probes["qa"].n_requests == 5
    first = qa.make_docs()[0]
    assert tok.decode(probes["qa"].continuation_ids[0]) == first["continuation"]
    assert set(parse_capabilities("math,code,qa")) <= set(CAPABILITIES)

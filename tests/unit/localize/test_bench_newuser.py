"""recipes/bench/newuser_task.py: the two tasks a new user would write load through lm-eval as capsense reads them."""

from __future__ import annotations

import json

from capsense.tasks.text import PARAGRAPHS
from conftest import load_bench_script, make_char_tokenizer


def test_both_user_tasks_load_with_their_documents(tmp_path):
    from capsense.scoring.probe import build_probe

    mod = load_bench_script("newuser_task")
    folder = mod.write_plural_task(mod.write_task(tmp_path / "usertask"))
    rows = [json.loads(ln) for ln in (folder / "plural.jsonl").read_text().splitlines()]
    assert len(rows) == 24 and all(len(r["choices"]) == 4 == len(set(r["choices"])) for r in rows)
    assert [r["choices"][r["label"]] for r in rows][:3] == ["cats", "dogs", "houses"]  # the gold choice is the plural
    assert len({r["label"] for r in rows}) > 1  # its position varies
    tok = make_char_tokenizer()
    plural = build_probe("user_plural", tok, None, 0, [str(folder)])
    assert plural.kind == "multiple_choice" and len(plural.doc_ids) == 24 and plural.n_requests == 96
    capitals = build_probe("user_capitals", tok, 12, 0, [str(folder)])
    assert len(capitals.doc_ids) == 12 and capitals.n_requests == 12
    mod.write_text_task(folder)
    text = build_probe("user_text", tok, None, 0, [str(folder)])  # a perplexity task: each paragraph one window
    assert text.kind == "loglikelihood" and len(text.doc_ids) == 40 == text.n_requests
    assert sorted(len(t) for t in text.continuation_ids) == sorted(len(tok.encode(a)) for a in PARAGRAPHS)

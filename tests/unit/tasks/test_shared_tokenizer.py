"""A loaded tokenizer in lm-eval's task metadata is shared by lm-eval's copies of the task config, not copied."""

import copy

from capsense.scoring.requests import load_task
from capsense.tasks.common import SharedTokenizer, continuation_tokens, tokenizer_from_metadata
from conftest import make_char_tokenizer


def test_copies_share_the_tokenizer_and_it_still_reads_as_one():
    tok = make_char_tokenizer()
    shared = SharedTokenizer(tok)
    assert copy.deepcopy(shared) is shared and copy.copy(shared) is shared
    assert copy.deepcopy({"metadata": {"tokenizer": shared}})["metadata"]["tokenizer"] is shared
    assert tokenizer_from_metadata({"tokenizer": shared}) is tok
    # a task of one's own that reads metadata["tokenizer"] directly gets the tokenizer's behaviour
    assert shared.encode("ab cd", add_special_tokens=False) == tok.encode("ab cd", add_special_tokens=False)
    assert shared("ab")["input_ids"] == tok("ab")["input_ids"]
    assert continuation_tokens(shared, "ab", " cd") == continuation_tokens(tok, "ab", " cd")


def test_a_task_reported_twice_keeps_one_tokenizer_and_counts_with_it():
    tok = make_char_tokenizer()
    task = load_task("capsense_induction", tokenizer=tok)
    first, second = task.dump_config(), task.dump_config()  # what lm-eval does for each reported task
    held = [d["metadata"]["tokenizer"] for d in (first, second)]
    assert held[0] is held[1] and isinstance(held[0], SharedTokenizer) and held[0].tokenizer is tok
    doc = task.eval_docs[0]  # continuations counted with the char tokenizer: more tokens than words
    assert doc["n_tokens"] == continuation_tokens(tok, doc["context"], doc["continuation"]) > 1

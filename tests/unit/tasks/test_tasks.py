import math

import pytest

from capsense.scoring.probe import Probe, ProbeScorer
from capsense.scoring.requests import encode_pair
from capsense.tasks import arithmetic, choice, code, induction, prose, sequence, tasks_dir
from capsense.tasks.common import continuation_tokens, nats_per_token, process_choice, process_loglikelihood
from conftest import make_char_tokenizer, make_tiny_model


def test_data_is_deterministic():
    for make in (induction.make_docs, arithmetic.make_docs, prose.make_docs, choice.make_docs):
        assert make() == make()


def test_induction_continuation_is_a_copy():
    for d in induction.make_docs(n=50):
        first, repeat = d["context"].split("\n")
        seq, k = first.split(), len(repeat.split())
        assert repeat.split() == seq[:k] and d["continuation"] == " " + seq[k]


def test_sequence_continuation_is_the_next_item():
    docs = sequence.make_docs(n=100)
    assert docs == sequence.make_docs(n=100)  # deterministic
    assert {d["family"] for d in docs} == set(sequence.FAMILIES)
    for d in docs:
        items = sequence.FAMILIES[d["family"]]
        seq = d["context"].rstrip(",").split(", ")
        i = items.index(seq[-1])
        assert d["continuation"] == " " + items[(i + 1) % len(items)]
        assert [items.index(x) for x in seq] == [(items.index(seq[0]) + j) % len(items) for j in range(len(seq))]
        assert d["continuation"].strip() not in seq  # not a copy


def test_arithmetic_answers_are_right():
    for d in arithmetic.make_docs(n=60):
        a, op, b, eq = d["context"].split("\n")[-1].split()
        assert eq == "=" and int(d["continuation"]) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        for shot in d["context"].split("\n")[:-1]:
            x, o, y, _, z = shot.split()
            assert int(z) == eval(f"{x}{o}{y}")


def test_code_reads_humaneval_and_mc_gold():
    docs = code.make_docs()
    assert len(docs) == 164 and docs[0]["task_id"] == "HumanEval/0"
    for d in choice.make_docs():
        assert len(d["choices"]) == 4 and len(set(d["choices"])) == 4 and 0 <= d["gold"] < 4


def test_token_count_matches_probe_split():
    tok = make_char_tokenizer()
    for ctx, cont in [("12 + 3 = ", "15"), ("abc", " def"), ("x", "y")]:
        c, t = encode_pair(tok, ctx, cont)
        assert continuation_tokens(tok, ctx, cont) == len(t)
        assert len(c) + len(t) == len(tok.encode(ctx + cont))


def test_metrics():
    assert process_loglikelihood({"n_tokens": 4}, [(-2.0, True)]) == {"acc": 1.0, "nats_per_token": (2.0, 4)}
    r = process_choice({"n_tokens": 2, "gold": 1}, [(-3.0, False), (-1.0, False), (-2.0, False)])
    assert r == {"acc": 1.0, "nats_per_token": (1.0, 2)}
    assert nats_per_token([(2.0, 4), (6.0, 4)]) == 1.0
    assert math.isnan(nats_per_token([(2.0, -1)]))


def test_probe_scores_equal_hand_computation():
    import torch

    tok = make_char_tokenizer()
    model = make_tiny_model("llama")
    pairs = [("12 + 3 =", " 15"), ("ab", "cd"), ("hello", " world!")]
    probe = Probe.from_pairs("t", pairs, tok)
    got = ProbeScorer(model, probe, batch_size=2).score()
    total, n = 0.0, 0
    with torch.no_grad():
        for ctx, cont in pairs:
            c, t = encode_pair(tok, ctx, cont)
            ids = torch.tensor([c + t])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            total -= sum(logp[len(c) - 1 + i, t[i]].item() for i in range(len(t)))
            n += len(t)
    assert got["nll"][0] == pytest.approx(total / n, abs=1e-5)


def test_tasks_dir_has_yamls():
    names = {p.stem for p in tasks_dir().glob("capsense_*.yaml")}
    assert {"capsense_induction", "capsense_arithmetic", "capsense_code", "capsense_prose", "capsense_antonyms", "capsense_sequence"} <= names

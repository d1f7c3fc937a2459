"""capsense-masked's log-likelihoods at the continuations' positions only: lm-eval hf's numbers, on hf's batches."""

from __future__ import annotations

import pytest
import torch

from capsense.evaluation import loglikelihood
from capsense.evaluation.loglikelihood import continuation_loglikelihoods
from conftest import ARCHS, make_char_tokenizer, make_tiny_model


def _requests() -> list:
    """Multi-token continuations, a context shared by one-token choices (lm-eval's cache groups them), a duplicate,
    lengths that pad, and one longer than the model's length below (truncated from the left)."""
    reqs = [(("a", "b"), [1, 2, 3, 4], [5, 6]), (("a", "c"), [1, 2, 3, 4], [7]), (("a", "d"), [1, 2, 3, 4], [8]),
            (("x", "y"), [9, 10], [11, 12, 13]), (("p", "q"), [3] * 9, [4]), (("a", "c"), [1, 2, 3, 4], [7]),
            (("long", "z"), list(range(1, 30)), [2, 3])]
    return [(s, list(c), list(t)) for s, c, t in reqs]


def _reference(model, reqs, max_length: int) -> list[tuple[float, bool]]:
    """Each request alone, every position's logits, the log-softmax over all of them: what hf computes."""
    out = []
    with torch.no_grad():
        for _, ctx, cont in reqs:
            inp = (ctx + cont)[-(max_length + 1):][:-1]
            lp = torch.log_softmax(model(torch.tensor([inp])).logits[0], dim=-1)
            pos = range(len(inp) - len(cont), len(inp))
            out.append((float(sum(lp[p, t] for p, t in zip(pos, cont))), all(int(lp[p].argmax()) == t for p, t in zip(pos, cont))))
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("one_token_cache", [True, False])
def test_each_request_scores_as_its_full_forward_does(arch, one_token_cache):
    model = make_tiny_model(arch)
    reqs, recorded, done = _requests(), [], []
    got = continuation_loglikelihoods(model, reqs, 16, 3, "cpu", one_token_cache=one_token_cache, done=done.append,
                                      record=lambda s, a: recorded.append((s, a)))
    ref = _reference(model, reqs, 16)
    assert [g[1] for g in got] == [r[1] for r in ref]
    assert [g[0] for g in got] == pytest.approx([r[0] for r in ref], abs=1e-4)
    assert sum(done) == len(reqs) and sorted(s for s, _ in recorded) == sorted(s for s, _, _ in reqs)
    assert got[1] == got[5]  # the duplicate request


def test_a_request_without_context_or_too_long_is_refused():
    model = make_tiny_model("llama")
    with pytest.raises(Exception, match="a context and a continuation of 1 to 4 tokens"):
        continuation_loglikelihoods(model, [(("", "x"), [], [5])], 4, 2, "cpu")
    with pytest.raises(Exception, match="got 2 and 5"):
        continuation_loglikelihoods(model, [(("a", "x"), [1, 2], [5, 6, 7, 8, 9])], 4, 2, "cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("ll-model")
    make_char_tokenizer().save_pretrained(root)
    make_tiny_model("llama").save_pretrained(root)
    return root


def _lm(folder, **kw):
    from capsense.evaluation.lm_eval_model import CapsenseMaskedLM

    return CapsenseMaskedLM(pretrained=str(folder), batch_size=3, device="cpu", **kw)


@pytest.fixture
def calls(monkeypatch):
    seen = []
    real = loglikelihood.continuation_loglikelihoods

    def spy(*args, **kwargs):
        seen.append(len(args[1]))
        return real(*args, **kwargs)

    monkeypatch.setattr(loglikelihood, "continuation_loglikelihoods", spy)
    return seen


def test_capsense_masked_takes_the_path_and_matches_hf_under_heads(folder, calls):
    reqs = _requests()[:5]
    fast = _lm(folder, heads="L0H1+L2H3")
    full = _lm(folder, heads="L0H1+L2H3", full_logits="true")
    assert fast.loglikelihood_path() == "continuations" and full.loglikelihood_path() == "hf"
    got, want = fast._loglikelihood_tokens(reqs), full._loglikelihood_tokens(reqs)
    assert calls == [5]  # the default ran capsense's path once, full_logits hf's
    assert [g[1] for g in got] == [w[1] for w in want]
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-5)
    plain = _lm(folder)._loglikelihood_tokens(reqs)
    assert max(abs(a[0] - b[0]) for a, b in zip(got, plain)) > 1e-3  # the heads were ablated on this path


def test_reduced_precision_auto_batches_and_unknown_architectures_keep_hfs_path(folder, calls, monkeypatch):
    lm = _lm(folder, dtype="bfloat16")
    assert lm.loglikelihood_path() == "hf" and _lm(folder).loglikelihood_path("auto") == "hf"
    other = _lm(folder)
    monkeypatch.setattr(other.model.config, "model_type", "some_new_family")  # its logits may follow the head elsewise
    assert other.loglikelihood_path() == "hf"
    lm._loglikelihood_tokens(_requests()[:3])
    assert calls == []
    with pytest.raises(Exception, match="full_logits must be true or false"):
        _lm(folder, full_logits="maybe")
